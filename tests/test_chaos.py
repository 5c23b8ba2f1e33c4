"""Chaos: three etcd replicas, 500 simulated workers joining and leaving in
storms, and the leader killed (SIGKILL, then restarted) every few seconds.

Every worker is an asyncio client that does what the client library does:
tries the replica it believes leads, follows NOT_LEADER hints, re-attaches
with its own member id and secret after a failure, and renews its lease
every third of the TTL. Each answered call is recorded; a checker then reads
the history and the final state (benchmarks/chaos_history.py checks it):

- no two members hold the same rank of a job in one generation, and every
  member of a world saw the same world (size, generation, master);
- generations never go backwards for a member;
- no answered Leave comes back: the member is unknown at the end;
- every completed Join is in the final state unless answered Leave (a Leave
  retried after a failover may find its first try applied: NOT_FOUND), or its
  renewals failed for a whole lease (counted, and expected only when the
  machine is overloaded).

COMMCTX_CHAOS_S sets how long the storms go on (default 20 s; docs/benchmarks.md
gives the longest local run)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import random
import signal
import time

import grpc
import pytest

from benchmarks.chaos_history import History as Recorded
from benchmarks.chaos_history import Op, check
from commctx.transport import leader_hint
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .conftest import eventually
from .etcd import Replicas, etcd_binary

DURATION_S = float(os.environ.get("COMMCTX_CHAOS_S", "20"))
pytestmark = [pytest.mark.slow(32), pytest.mark.timeout(DURATION_S * 3 + 180), pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary")]
WORKERS, PER_JOB, KILL_EVERY_S, LEASE_TTL_S, STORM_S = 500, 4, 3.0, 6.0, 20 / 6


class Fleet:
    """Channels to every replica and the one believed to lead; calls that follow hints."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.channels = {a: grpc.aio.insecure_channel(a) for a in addresses}
        self.leader = addresses[0]

    async def call(self, method: str, request, deadline: float, timeout: float = 5.0):
        """The answer of the current leader; NOT_LEADER and unreachable replicas are retried until `deadline`."""
        attempt = 0
        while True:
            address = self.leader
            try:
                rpc = getattr(pb_grpc.RendezvousStub(self.channels[address]), method)
                return await rpc(request, timeout=min(timeout, max(0.1, deadline - time.monotonic())))
            except grpc.aio.AioRpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                        or time.monotonic() >= deadline:
                    raise
                hint = leader_hint(err)
                if self.leader == address:
                    self.leader = hint or self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)]
            await asyncio.sleep(min(0.05 * 2 ** attempt, LEASE_TTL_S / 3) * random.uniform(0.5, 1))  # the client's backoff
            attempt = min(attempt + 1, 6)

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()


@dataclasses.dataclass
class History:
    joined: dict[str, tuple[str, int, int, int, str]] = dataclasses.field(default_factory=dict)  # member -> (job, gen, rank, size, master)
    left: dict[str, float] = dataclasses.field(default_factory=dict)  # answered Leave -> when
    generations: dict[str, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    secrets: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # member -> (job, secret)
    failed_calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    settled: int = 0  # workers whose history is final
    renewed: dict[str, list[float]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))  # answer times
    lost: dict[str, float] = dataclasses.field(default_factory=dict)  # member -> when the renewal that found it gone began


async def worker(fleet: Fleet, history: History, job: str, node: str, leave_after: float | None,
                 checked: asyncio.Event) -> None:
    """Joins, renews every TTL/3, and leaves after `leave_after` s; or (None) stays,
    renewing until the checker is done. Counts itself settled once its history is final."""
    member, secret = os.urandom(16).hex(), os.urandom(16).hex()
    history.secrets[member] = (job, secret)
    request = pb.JoinRequest(job_id=job, spec=pb.JobSpec(world_size=PER_JOB), node_key=node, address="127.0.0.1",
                             master_port=random.randint(20000, 60000), member_id=member, member_secret=secret,
                             wait_timeout_ms=60_000)
    settled = False
    try:
        try:
            answer = await fleet.call("Join", request, time.monotonic() + 90, timeout=30)
        except grpc.aio.AioRpcError as err:
            history.failed_calls[f"Join {err.code().name}"] += 1
            return
        a = answer.assignment
        history.renewed[member].append(time.monotonic())
        history.joined[member] = (job, a.generation, a.rank, a.world_size, a.dist_url)
        history.generations[member].append(a.generation)
        ends = time.monotonic() + leave_after if leave_after is not None else None
        if ends is None:
            history.settled, settled = history.settled + 1, True
        while not checked.is_set() and (ends is None or time.monotonic() < ends):
            began = time.monotonic()
            try:
                renewed = await fleet.call("KeepAlive", pb.KeepAliveRequest(
                    job_id=job, member_id=member, member_secret=secret, generation=a.generation), time.monotonic() + LEASE_TTL_S)
                history.generations[member].append(renewed.generation)
                history.renewed[member].append(time.monotonic())
            except grpc.aio.AioRpcError as err:
                history.failed_calls[f"KeepAlive {err.code().name}"] += 1
                if err.code() is grpc.StatusCode.NOT_FOUND:
                    history.lost[member] = began
                    break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(checked.wait(), LEASE_TTL_S / 3 * random.uniform(0.8, 1.0))
        if ends is not None:
            try:
                await fleet.call("Leave", pb.LeaveRequest(job_id=job, member_id=member, member_secret=secret), time.monotonic() + 30)
                history.left[member] = time.monotonic()
            except grpc.aio.AioRpcError as err:
                history.failed_calls[f"Leave {err.code().name}"] += 1
                if err.code() is grpc.StatusCode.NOT_FOUND:  # a retry of a Leave applied before a failover: gone
                    history.left[member] = time.monotonic()
    finally:
        if not settled:
            history.settled += 1


async def killer(replicas: Replicas, stop: asyncio.Event, kills: list[float]) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), KILL_EVERY_S)
            return
        except TimeoutError:
            pass
        leader = await asyncio.to_thread(replicas.leader, 15)
        os.kill(replicas.procs[leader].popen.pid, signal.SIGKILL)
        kills.append(time.monotonic())
        replicas.procs[leader].stop()
        replicas.procs[leader] = await asyncio.to_thread(replicas.start, leader)


async def test_chaos_history_is_consistent(cluster):
    replicas = cluster
    fleet = Fleet([replicas.address(i) for i in range(3)])
    history, stop, checked, kills = History(), asyncio.Event(), asyncio.Event(), []
    chaos = asyncio.create_task(killer(replicas, stop, kills))
    started, jobs, tasks = time.monotonic(), 0, []
    try:
        while time.monotonic() - started < DURATION_S:
            # A storm every STORM_S: 41 jobs of 4 join at once; a third leave within 3 s; in a long run the
            # rest leave after 10-30 s, but those of the last 30 s, which stay to the end.
            storm, left_s = [], DURATION_S - (time.monotonic() - started)
            for _ in range(WORKERS // PER_JOB // 3):
                job, dice = f"job-{jobs}", random.random()
                jobs += 1
                stay = random.uniform(0.5, 3) if dice < 0.35 else None if left_s < 30 else random.uniform(10, 30)
                storm += [worker(fleet, history, job, f"node{w % 2}", stay, checked) for w in range(PER_JOB)]
            tasks += [asyncio.ensure_future(s) for s in storm]
            await asyncio.sleep(STORM_S)  # the scenario's pace, not a wait for something: a storm every STORM_S
    finally:
        stop.set()
        await chaos
    await eventually(lambda: history.settled >= len(tasks), 180,  # every Join answered or given up, every Leave done
                     lambda: f"{len(tasks) - history.settled} workers did not settle", interval_s=0.1)

    # -- the checker (benchmarks/chaos_history.py) over the recorded calls and a final KeepAlive of each member --
    ops: list[Op] = []
    for member, (job, gen, rank, size, master) in history.joined.items():
        for i, (t, g) in enumerate(zip(history.renewed[member], history.generations[member])):  # calls in turn
            ops.append(Op(len(ops), "keepalive" if i else "join", job, member, start=t, end=t, generation=g,
                          rank=None if i else rank, world="" if i else f"{size} {master}"))
        if member in history.lost:
            ops.append(Op(len(ops), "keepalive", job, member, start=history.lost[member], end=history.lost[member],
                          ok=False, error="NOT_FOUND"))
        if member in history.left:
            ops.append(Op(len(ops), "leave", job, member, start=history.left[member], end=history.left[member]))
    problems = []
    for member, (job, secret) in history.secrets.items():
        if member not in history.joined:
            continue
        began = time.monotonic()
        try:
            renewed = await fleet.call("KeepAlive", pb.KeepAliveRequest(job_id=job, member_id=member, member_secret=secret,
                                                                         generation=history.joined[member][1]), time.monotonic() + 30)
            ops.append(Op(len(ops), "probe", job, member, start=began, end=time.monotonic(), generation=renewed.generation))
            if member not in history.left and renewed.generation != history.joined[member][1]:
                problems.append(f"{member} of {job}: generation {renewed.generation}, joined {history.joined[member][1]}")
        except grpc.aio.AioRpcError as err:
            ops.append(Op(len(ops), "probe", job, member, start=began, end=time.monotonic(), ok=False, error=err.code().name))
    report = check(Recorded(ops=ops, lease_ttl_s=LEASE_TTL_S, checks_convergence=False))
    problems += [str(v) for v in report.violations]
    lost = {v.ids[0] for v in report.violations if v.invariant == "join_kept"}
    expired = sum(1 for o in ops if o.kind == "probe" and not o.ok and o.member not in history.left) - len(lost)
    checked.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    await fleet.close()
    summary = (f"{DURATION_S:g} s, {jobs} jobs, {len(history.joined)} joins answered, {len(history.left)} leaves answered, "
               f"{len(kills)} leaders killed, {expired} members expired after renewals failed for a lease, "
               f"failed calls {dict(history.failed_calls)}")
    print(summary)
    assert not problems, summary + "\n" + "\n".join(problems[:30])
    assert len(kills) >= DURATION_S / (KILL_EVERY_S + 1) - 1 and len(history.joined) >= WORKERS and history.left, summary
