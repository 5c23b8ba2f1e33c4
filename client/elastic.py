"""Elastic training on CommContext: a failure costs the loop a step, not a restart.

    from commctx import CommContext
    from commctx.elastic import Elastic, ElasticSampler

    ctx = CommContext.join(world_size=4, spec={"elastic": {"min_size": 2}})
    elastic = Elastic(ctx, state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
                      load_state_dict=lambda s: (model.load_state_dict(s["model"]), optim.load_state_dict(s["optim"])))
    elastic.run(train_step, steps=1000)           # train_step(step): one step over ctx's groups

Three parts, usable alone:

  * `guard()`: a collective that fails because the world changed raises
    `WorldChanged` (a RuntimeError of commctx's own, with torch's error as its
    cause) instead of torch's RuntimeError; any other error passes unchanged.
    When a collective fails before the server has said anything (a peer's
    connection broke: a crash), the guard tells the server, which then drops
    the members whose sessions closed without waiting out their reconnect
    grace, and waits at most a lease for the news.
  * `recover()`: before every step; rejoins the next world (CommContext.rejoin)
    when it is ready or the current one failed, and heals it.
  * `heal()`: after every (re)join, members that lack the training state get
    it from one that holds it: the lowest rank among those at the highest
    step. Every member says, in one all_gather of two integers over GLOBAL,
    whether it holds the state and at which step; the source then sends the
    `state_dict()` (serialised with torch.save) to the others, point to point
    (a broadcast when everyone else needs it, as in a job's first world,
    where rank 0's fresh state is the one). Survivors of the previous world
    at the same step pay for the all_gather only. The step counter comes along.

The state must not change in a step that raised: apply the update after the
step's last collective, as DDP and torch's optimizers do. `ElasticSampler`
gives each rank its share of a fixed global batch at any world size, so that
a step means the same samples before and after a change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from commctx.common.modes import GLOBAL

from .context import CommContext
from .errors import WorldChanged
from .news import News, WorldChange

log = logging.getLogger("commctx")

__all__ = ["Elastic", "ElasticSampler", "Heal", "WorldChanged"]

NEWS_SLACK_S = 1.0  # beyond a lease: how long a failed collective waits for the server's news at most


@dataclasses.dataclass(frozen=True)
class Heal:
    """What one heal did: who sent the state to whom, at which step."""

    generation: int
    step: int  # the step every member is at afterwards
    source: int  # the global rank whose state counted
    receivers: tuple[int, ...]  # ranks that loaded it (empty: everyone held it already)
    nbytes: int  # size of the serialised state sent (0: nothing sent)
    seconds: float


class Elastic:
    """A training loop's state across world changes: the step counter, and
    the callables that read and restore the rest (as torchft's Manager takes).

    Attributes:
        step: the number of steps completed; `run` counts it, a hand-written
            loop increments it after each step.
        last_heal: what the latest heal did (None before the first).
    """

    def __init__(self, ctx: CommContext, *, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
                 step: int = 0, rejoin_timeout: float = 600.0) -> None:
        if not callable(state_dict) or not callable(load_state_dict):
            raise TypeError("state_dict and load_state_dict must be callables (e.g. model.state_dict, model.load_state_dict)")
        self.ctx = ctx
        self.step = step
        self.last_heal: Heal | None = None
        self._state_dict = state_dict
        self._load_state_dict = load_state_dict
        self._rejoin_timeout = rejoin_timeout
        self._holds = False  # this process's state is the job's (healed once)
        self._healed = -1  # the generation last healed in
        self._broken = False  # a collective of the current world failed because the world changed

    # -- a failed collective --------------------------------------------------------

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Raises WorldChanged for a RuntimeError (torch's collective errors)
        raised inside, when the world changed; anything else passes unchanged.

        A RuntimeError with no change announced yet is reported to the server
        as a failed collective of this generation, and the news awaited for at
        most a lease TTL and a second: a crashed peer's stream is closed, and
        the server drops it at once; a hung peer goes at its lease. No news
        within that: the error was not the world's, and is raised as it was.
        """
        try:
            yield
        except WorldChanged:
            raise
        except RuntimeError as exc:
            change = self._news_after(exc)
            if change is None:
                raise
            self._broken = True
            raise WorldChanged(change) from exc

    def _news(self) -> News | None:
        """The membership's news (its Session, or its HostLink); None under torchrun on commctx."""
        membership = self.ctx._membership
        return membership.session if membership is not None else None

    def _news_after(self, exc: RuntimeError) -> WorldChange | None:
        news = self._news()
        if news is None:  # torchrun on commctx: its agent restarts the workers
            return None
        change = news.world_change
        if change is None and news.assignment is not None:
            news.report_failure(news.assignment.generation)
            log.info("a collective failed (%s); waiting for the rendezvous server's news", str(exc).splitlines()[0][:160])
            change = news.wait_world_change(news.lease_ttl_s + NEWS_SLACK_S)
        return change

    # -- moving on ------------------------------------------------------------------

    def recover(self, timeout: float | None = None) -> Heal | None:
        """Brings this worker into a healed world, and is cheap when it is in
        one: call it before every step. It rejoins when a world change is
        pending and either the next world is ready (a world that grows runs on
        until then), the change is final, or a collective of this world failed
        (guard() raised WorldChanged: then it waits for the next world); then it
        heals a world it has not healed yet; again if the world changes meanwhile.

        Returns:
            The heal, or None when this world was healed already.

        Raises:
            MemberNotFound: the job cannot go on for this worker (the reason says why).
            RendezvousTimeout: no new world within `timeout` (default: rejoin_timeout).
        """
        deadline = time.monotonic() + (self._rejoin_timeout if timeout is None else timeout)
        while True:
            news = self._news()
            change = news.world_change if news is not None else None
            if change is not None and (self._broken or change.final or news.next_ready):
                self.ctx.rejoin(timeout=max(0.001, deadline - time.monotonic()))
                self._broken = False
            assignment = self.ctx.assignment
            if self._healed == (assignment.generation if assignment is not None else 0):
                return None
            try:
                with self.guard():
                    return self.heal()
            except WorldChanged as exc:
                log.warning("the world changed while healing: %s", exc)

    def run(self, train_step: Callable[[int], Any], steps: int) -> int:
        """Runs `train_step(step)` until `steps` steps are done, across world
        changes: recover() before every step (it heals the first world, and
        moves to a next world that is ready), and a step that failed because
        the world changed is done again in the next world.

        Returns:
            The step count (`steps`).

        Raises:
            MemberNotFound: the job cannot go on for this worker.
        """
        while self.step < steps:
            self.recover()
            try:
                with self.guard():
                    train_step(self.step)
            except WorldChanged as exc:
                log.warning("step %d: %s", self.step, exc)
                continue
            self.step += 1
        self._finish()
        return self.step

    def _finish(self) -> None:
        """Waits until every member has finished the last step too: a worker
        that left at once would end the world under a peer still inside the
        last collective (its abort on the news), and it would do that step again."""
        try:
            with self.guard():
                dist.barrier(group=self.ctx.get_group(GLOBAL))
        except RuntimeError as exc:  # a peer went first: this worker's steps are done all the same
            log.info("the final barrier ended early: %s", str(exc).splitlines()[0][:200])

    # -- the state ------------------------------------------------------------------

    def heal(self) -> Heal:
        """Gives the state to the members of this world that lack it. Every
        member calls it once after entering a world (recover and run do).

        A collective over GLOBAL; a RuntimeError inside it is a peer lost
        meanwhile (call it under guard()).
        """
        start = time.perf_counter()
        ctx = self.ctx
        group = ctx.get_group(GLOBAL)
        rank, size = ctx.get_global_rank(), ctx.get_world_size(GLOBAL)
        device = _device_of(group)
        mine = torch.tensor([int(self._holds), self.step], dtype=torch.int64, device=device)
        table = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(table, mine, group=group)
        rows = [(bool(t[0]), int(t[1])) for t in (row.cpu() for row in table)]
        holders = [r for r, (holds, _) in enumerate(rows) if holds] or [0]  # nobody yet: rank 0's fresh state
        step = max(rows[r][1] for r in holders)
        source = min(r for r in holders if rows[r][1] == step)
        receivers = tuple(r for r, (holds, at) in enumerate(rows) if r != source and not (holds and at == step))
        nbytes = 0
        if receivers and (rank == source or rank in receivers):
            if len(receivers) == size - 1:  # everyone else: one broadcast
                nbytes = _broadcast(self._state_dict if rank == source else None, source, group, device, self._load_state_dict)
            elif rank == source:
                nbytes = _send(self._state_dict(), receivers, group, device)
            else:
                nbytes = _receive(source, group, device, self._load_state_dict)
        generation = ctx.assignment.generation if ctx.assignment is not None else 0
        self.step, self._holds, self._healed = step, True, generation
        self.last_heal = Heal(generation, step, source, receivers, nbytes, time.perf_counter() - start)
        if receivers:
            log.info("healed generation %d at step %d: rank %d sent %d bytes to ranks %s", generation, step, source,
                     nbytes, list(receivers))
        return self.last_heal


def _device_of(group: dist.ProcessGroup) -> torch.device:
    """Where the group's tensors live: this rank's GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pack(state: Any, device: torch.device) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)


def _unpack(payload: torch.Tensor) -> Any:
    # The sender is a member of the same job running the same code (as for
    # broadcast_object_list): arbitrary objects in a state dict are allowed.
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=False)


def _send(state: Any, receivers: tuple[int, ...], group: dist.ProcessGroup, device: torch.device) -> int:
    payload = _pack(state, device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    for work in [dist.isend(length, r, group=group) for r in receivers]:
        work.wait()
    for work in [dist.isend(payload, r, group=group) for r in receivers]:
        work.wait()
    return payload.numel()


def _receive(source: int, group: dist.ProcessGroup, device: torch.device, load: Callable[[Any], None]) -> int:
    length = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(length, source, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, source, group=group)
    load(_unpack(payload))
    return payload.numel()


def _broadcast(state_dict: Callable[[], Any] | None, source: int, group: dist.ProcessGroup, device: torch.device,
               load: Callable[[Any], None]) -> int:
    payload = _pack(state_dict(), device) if state_dict is not None else None
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, source, group=group)
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, source, group=group)
    if state_dict is None:
        load(_unpack(payload))
    return payload.numel()


class ElasticSampler:
    """The samples of each step, shared out over whatever world runs it.

    Step s is a global batch of `global_batch` samples: positions s*B to
    (s+1)*B - 1 of an endless sequence of epochs over `num_samples` samples,
    each epoch in its own order (a permutation seeded by seed + epoch, or
    0..n-1 without `shuffle`). Rank r of a world of W takes the r-th of W
    near-equal contiguous slices of that batch. A world change therefore
    changes who computes which samples of a step, never which samples the
    step holds: with gradients summed over the world and divided by the
    global batch, a step's update is the same at any world size.
    """

    def __init__(self, num_samples: int, global_batch: int, *, seed: int = 0, shuffle: bool = True) -> None:
        for name, value in (("num_samples", num_samples), ("global_batch", global_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation)

    def _epoch(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(self.num_samples)
            self._order = (epoch, order)
        return self._order[1]

    def indices(self, step: int, rank: int, world_size: int) -> list[int]:
        """The dataset indices rank `rank` of a world of `world_size` takes at `step`."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if step < 0:
            raise ValueError(f"step must be at least 0, not {step}")
        b = self.global_batch
        first, end = step * b + rank * b // world_size, step * b + (rank + 1) * b // world_size
        out: list[int] = []
        while first < end:
            epoch, offset = divmod(first, self.num_samples)
            take = min(end - first, self.num_samples - offset)
            out += self._epoch(epoch)[offset:offset + take].tolist()
            first += take
        return out
