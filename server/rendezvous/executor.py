"""Carrying out what the state machine decided, as torch elastic's
_RendezvousOpExecutor does: persist, then announce, then wake.

`Executor` takes the `Actions` of every transition in submission order. Each
turn it takes everything queued, commits all their writes as one store
transaction (in a worker thread when the store does I/O: group commit comes
from the queue, not from a timer), and only then hands over the notes, puts
the pushed events in their session sinks and wakes the Join waiters, in
order. So a formed world is durable before anyone hears of it, and nobody
hears of a later change before an earlier one. Long lists of pushes and wakes
go in slices, yielding the event loop between them, and worlds too big to
plan inside a transition are planned in a worker thread.

`Waiters` holds the Join calls waiting for their world. `Executor` also arms
the one timer that runs the machine's `expire_due` when its next deadline
comes (coalesced to 50 ms ticks).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable

from ..errors import Conflict, NotFound, Unavailable
from .deadlines import Deadlines
from .history import Watchers
from .machine import Actions, Rendezvous, plan_or_error
from .model import JobStopped, MemberGone, NewWorld, Note, PlanRequest, WaitOutcome
from .store import Fenced, Store, StoreError

log = logging.getLogger("commctx.server")

SLICE = 50  # pushes or wakes between two yields of the event loop: each wakes a coroutine that runs in the next turn
TICK_S = 0.05  # deadlines are served on ticks of this length


class Waiters:
    """Join calls waiting to be placed, by job and member, with their deadlines."""

    def __init__(self) -> None:
        self._by_job: dict[str, dict[str, asyncio.Future[NewWorld]]] = {}
        self._deadlines = Deadlines()  # (job id, member id, id of the future)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._live = 0  # waiting futures

    def add(self, job_id: str, member_id: str, timeout_s: float | None) -> asyncio.Future[NewWorld]:
        """A future that resolves to the member's world, or raises NotFound,
        Conflict, or TimeoutError after `timeout_s`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[NewWorld] = loop.create_future()
        waiting = self._by_job.setdefault(job_id, {})
        earlier = waiting.get(member_id)
        if earlier is not None:  # a retried Join took over: the earlier call is answered now, not left to time out
            self._live -= 1
            if not earlier.done():
                earlier.set_exception(Conflict(f"a later Join call for member {member_id} of job {job_id!r} took over this one"))
        waiting[member_id] = future
        self._live += 1
        if timeout_s is not None:
            at = loop.time() + timeout_s
            self._deadlines.push(at, (job_id, member_id, id(future)))
            if at < self._timer_at:
                self._arm(loop, at)
        return future

    def discard(self, job_id: str, member_id: str, future: asyncio.Future) -> None:
        waiting = self._by_job.get(job_id)
        if waiting is not None and waiting.get(member_id) is future:
            del waiting[member_id]
            self._live -= 1
            if not waiting:
                del self._by_job[job_id]
        if len(self._deadlines) > 2 * self._live + 1024:  # answered waits' deadlines: drop them, not hold them for the timeout
            self._deadlines.keep(self._waiting)

    def waiting(self, job_id: str, member_id: str) -> bool:
        """Whether a Join call waits for this member."""
        return member_id in self._by_job.get(job_id, {})

    def _waiting(self, key: tuple[str, str, int]) -> bool:
        future = self._by_job.get(key[0], {}).get(key[1])
        return future is not None and id(future) == key[2]

    def _ended_by(self, job_id: str, outcome: WaitOutcome) -> list[asyncio.Future[NewWorld]]:
        """The waits `outcome` ends: its member's, the whole job's, or those of the world's members."""
        waiting = self._by_job.get(job_id, {})
        if isinstance(outcome, MemberGone):
            return [f for f in (waiting.get(outcome.member_id),) if f is not None]
        if isinstance(outcome, JobStopped):
            return list(waiting.values())
        return [f for mid, f in waiting.items() if mid in outcome.plan.ranks]

    def refuse(self, job_id: str, outcome: WaitOutcome, exc: Exception) -> None:
        """Ends with `exc` the waits `outcome` would have ended."""
        for future in self._ended_by(job_id, outcome):
            if not future.done():
                future.set_exception(exc)

    def fail_all(self, exc: Exception) -> None:
        """Ends every wait with `exc` (the server can no longer answer them)."""
        for waiting in self._by_job.values():
            for future in waiting.values():
                if not future.done():
                    future.set_exception(exc)

    async def wake(self, job_id: str, outcome: WaitOutcome) -> None:
        futures = self._ended_by(job_id, outcome)
        if isinstance(outcome, MemberGone):
            error: Exception | None = NotFound(f"member {outcome.member_id} left job {job_id!r} while waiting")
        else:
            error = Conflict(outcome.reason) if isinstance(outcome, JobStopped) else None
        for i, future in enumerate(futures):
            if not future.done():
                if error is None:
                    future.set_result(outcome)
                else:
                    future.set_exception(error)
            if i % SLICE == SLICE - 1:
                await asyncio.sleep(0)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(at, self._expire, loop), at

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer, self._timer_at = None, math.inf
        now = loop.time()
        while (entry := self._deadlines.pop_due(now)) is not None:
            job_id, member_id, key = entry[1]
            future = self._by_job.get(job_id, {}).get(member_id)
            if future is not None and id(future) == key and not future.done():
                future.set_exception(TimeoutError())
        if self._deadlines.next() < math.inf:
            self._arm(loop, self._deadlines.next())


class Executor:
    """Carries out actions in submission order; owns the deadline timer.

    Start with `start()`, stop with `stop()` (idempotent).
    """

    def __init__(
        self,
        machine: Rendezvous,
        store: Store,
        epoch: int,
        waiters: Waiters,
        notes: Callable[[Note], None],
        *,
        watchers: Watchers | None = None,
        on_store_error: Callable[[Exception | None], None] = lambda exc: None,
        on_fenced: Callable[[Fenced], None] = lambda exc: None,
        retry_s: float = 1.0,
    ) -> None:
        self._machine = machine
        self._store = store
        self._epoch = epoch
        self._waiters = waiters
        self._notes = notes
        self.watchers = watchers if watchers is not None else Watchers()
        self._on_store_error = on_store_error
        self._on_fenced = on_fenced
        self._retry_s = retry_s
        self._queue: collections.deque[tuple[Actions, asyncio.Future[None] | None]] = collections.deque()
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._failing = False
        self._failing_why = ""
        self._busy = False  # a batch is being carried out
        self._planning: set[asyncio.Task] = set()
        self.fenced: Fenced | None = None
        self._closed: Exception | None = None  # what carry_out raises once nothing more is carried out

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="commctx-executor")
        self._rearm()

    async def stop(self) -> None:
        """Carries out what is queued (if the store allows), then stops. Idempotent."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is None:
            return
        if self._queue and self.fenced is None and not self._failing:
            await self.settled()
        for task in self._planning:
            task.cancel()
        await asyncio.gather(*self._planning, return_exceptions=True)
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    def submit(self, actions: Actions) -> None:
        """Queues a transition's actions (and what transitions that raised still implied)."""
        actions = self._with_outbox(actions)
        if actions:
            self._queue.append((actions, None))
            self._ready.set()
        self._rearm()

    async def carry_out(self, actions: Actions) -> None:
        """Queues a transition's actions and returns once they are carried out
        (its writes durable). For answers that must not outrun the store.

        Raises:
            Unavailable: the writes failed, or another server took the store over.
        """
        if self._closed is not None:
            raise self._closed
        actions = self._with_outbox(actions)
        done = asyncio.get_running_loop().create_future()
        self._queue.append((actions, done))
        self._ready.set()
        self._rearm()
        await done

    def _with_outbox(self, actions: Actions) -> Actions:
        outbox = self._machine.take_outbox() if self._machine.has_outbox else None
        if outbox is None:
            return actions
        outbox.extend(actions)
        return outbox

    async def settled(self) -> None:
        """Returns once everything submitted so far is carried out."""
        if self._queue or self._busy:
            await self.carry_out(Actions())

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                self._busy = True
                batch = list(self._queue)
                writes = [w for actions, _ in batch for w in actions.writes]
                if writes and not await self._commit(writes):
                    if self.fenced is not None:
                        return
                    self._refuse(batch)
                    await asyncio.sleep(self._retry_s)  # the disk may free up; nothing is announced meanwhile
                    continue
                for _ in batch:
                    self._queue.popleft()
                for actions, done in batch:
                    for note in actions.notes:
                        self._notes(note)
                    for job_id, event in actions.events:
                        self.watchers.publish(job_id, event)
                    for i, (sink, event) in enumerate(actions.pushes):
                        sink.put_nowait(event)
                        if i % SLICE == SLICE - 1:
                            await asyncio.sleep(0)
                    for job_id, outcome in actions.wakes:
                        await self._waiters.wake(job_id, outcome)
                    for request in actions.plans:
                        task = asyncio.create_task(self._plan(request), name=f"commctx-plan-{request.job_id}")
                        self._planning.add(task)
                        task.add_done_callback(self._planning.discard)
                    if done is not None and not done.done():
                        done.set_result(None)
                self._busy = False

    def _fail_all(self, error: Exception) -> None:
        """Nothing queued will be carried out: every call awaiting it hears `error`."""
        self._closed = error
        for _, done in self._queue:
            if done is not None and not done.done():
                done.set_exception(error)
        self._queue.clear()
        self._waiters.fail_all(error)

    async def abandon(self, error: Exception) -> None:
        """Stops at once, writing nothing more (the store is no longer this
        server's to write): what is queued is dropped, and every call awaiting
        it, and every Join waiting, hears `error`."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in [*self._planning, *([self._task] if self._task is not None else [])]:
            task.cancel()
        await asyncio.gather(*self._planning, *([self._task] if self._task is not None else []), return_exceptions=True)
        self._task = None
        self._fail_all(error)

    def _refuse(self, batch: list[tuple[Actions, asyncio.Future[None] | None]]) -> None:
        """The batch's writes failed: the Join calls it would wake and the calls
        awaiting it (Leave, a re-attaching Join) hear UNAVAILABLE now, not at
        their timeouts. The writes stay queued and are retried, announcing nothing."""
        error = Unavailable(f"the server cannot write its state ({self._failing_why}); retry")
        for actions, done in batch:
            for job_id, outcome in actions.wakes:
                self._waiters.refuse(job_id, outcome, error)
            if done is not None and not done.done():
                done.set_exception(error)

    async def _plan(self, request: PlanRequest) -> None:
        """Plans a big world in a worker thread (the event loop keeps running:
        the thread gives up the GIL every few milliseconds) and hands the result
        to the state machine."""
        plan = await asyncio.to_thread(plan_or_error, request.candidates, request.spec)
        self.submit(self._machine.planned(request, plan))

    async def _commit(self, writes: list) -> bool:
        try:
            if self._store.blocking:
                await asyncio.to_thread(self._store.commit, writes, self._epoch)
            else:
                self._store.commit(writes, self._epoch)
        except Fenced as exc:
            self.fenced = exc
            log.error("store_fenced", extra={"fields": {"reason": str(exc)}})
            self._fail_all(Unavailable(f"this server no longer owns its store ({exc}); retry: another server serves it"))
            self._on_fenced(exc)
            return False
        except StoreError as exc:
            self._failing_why = str(exc)
            if not self._failing:  # once per outage: the log, the health status, the hold on new worlds
                self._failing = True
                log.error("store_failed", extra={"fields": {"reason": str(exc)}})
                self._on_store_error(exc)
                self._machine.hold_worlds(str(exc))
            return False
        if self._failing:
            self._failing = False
            log.warning("store_recovered")
            self._on_store_error(None)
            self.submit(self._machine.hold_worlds(None))
        return True

    # -- deadlines -----------------------------------------------------------------

    def _rearm(self) -> None:
        at = self._machine.next_deadline()
        if at >= self._timer_at or at == math.inf:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, at - self._machine.now())
        fire_at = math.ceil((loop.time() + delay) / TICK_S) * TICK_S  # coalesce deadlines into ticks
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(fire_at, self._fire), at

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        actions, more = self._machine.expire_due()
        if actions:
            self._queue.append((actions, None))
            self._ready.set()
        if more:  # an expiry storm: the rest after other work has had the loop
            self._timer, self._timer_at = asyncio.get_running_loop().call_soon(self._fire), -math.inf
        else:
            self._rearm()
