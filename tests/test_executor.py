"""The executor carries out the machine's actions: persist, then announce, then
wake, in submission order; a fenced or failing store holds announcements back.
Real event loop, the real state machine, stores that can be made slow or fail."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from commctx.common.planning import JobSpec
from commctx.server.errors import NotFound, Unavailable
from commctx.server.rendezvous.executor import Executor
from commctx.server.rendezvous.machine import Rendezvous
from commctx.server.rendezvous.model import JobState, MemberGone, NewWorld
from commctx.server.rendezvous.params import JoinParams
from commctx.server.rendezvous.store import Fenced, StoreError
from commctx.server.rendezvous.waiting import Waiters

from .conftest import consistently, eventually
from .stores import DictStore as MemoryStore  # the contract tests' reference store, keeping records


class GatedStore(MemoryStore):
    """A memory store whose commits run in a worker thread and wait for `gate`."""

    blocking = True

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.failures = 0  # how many commits to refuse with StoreError
        self.failing_until = 0.0  # and every commit before this monotonic time
        self.commits = 0
        self.refused = 0
        self.at_gate = 0  # commits that reached a closed gate

    def commit(self, writes, epoch):
        if not self.gate.is_set():
            self.at_gate += 1
        assert self.gate.wait(10)
        if self.failures or time.monotonic() < self.failing_until:
            self.failures = max(0, self.failures - 1)
            self.refused += 1
            raise StoreError("disk full (simulated)")
        super().commit(writes, epoch)
        self.commits += 1


def params(job: str, world: int, node: str = "n") -> JoinParams:
    return JoinParams.build(job_id=job, spec=JobSpec.build(world), node_key=node, address="10.0.0.1", port=30000)


class Rig:
    def __init__(self, store: MemoryStore, lease_ttl_s: float = 10.0) -> None:
        self.store = store
        self.machine = Rendezvous(lease_ttl_s=lease_ttl_s)
        self.waiters = Waiters()
        self.notes = []
        self.store_errors = []
        self.fenced = []
        self.executor = Executor(self.machine, store, store.take_over(), self.waiters, self.notes.append,
                                 on_store_error=self.store_errors.append, on_fenced=self.fenced.append, retry_s=0.01)
        self.executor.start()

    def join(self, job: str, world: int, node: str = "n") -> tuple[str, asyncio.Future]:
        joined, actions, _ = self.machine.join(params(job, world, node))
        waiter = self.waiters.add(job, joined.member_id, 30)
        self.executor.submit(actions)
        return joined.member_id, waiter


@pytest.fixture
async def rig():
    r = Rig(GatedStore())
    yield r
    r.store.gate.set()
    await r.executor.stop()


async def test_a_formed_world_is_durable_before_anyone_hears_of_it(rig):
    a, wa = rig.join("j", 2)
    await rig.executor.settled()
    rig.store.gate.clear()  # the disk is slow
    b, wb = rig.join("j", 2)
    await eventually(lambda: rig.store.at_gate, what="the world's commit waits at the gate")
    assert not wa.done() and not wb.done()  # formed in memory, not yet durable: nobody told
    assert [j.state for j in rig.store.load()] == ["forming"]
    rig.store.gate.set()
    world = await asyncio.wait_for(wa, 5)
    assert isinstance(world, NewWorld) and (await wb) is world
    assert [(j.state, j.generation) for j in rig.store.load()] == [("formed", 1)]
    assert [n.event for n in rig.notes] == ["join", "join", "formed"]


async def test_actions_are_carried_out_in_submission_order_and_commits_are_grouped(rig):
    rig.store.gate.clear()
    members = [rig.join("big", 50, f"n{i % 5}") for i in range(50)]
    rig.store.gate.set()
    worlds = await asyncio.gather(*(w for _, w in members))
    assert {w.generation for w in worlds} == {1}
    assert rig.store.commits < 10  # fifty joins' writes went in a handful of transactions
    assert [n.event for n in rig.notes] == ["join"] * 50 + ["formed"]


async def test_a_failing_store_refuses_waits_at_once_and_forms_no_world_until_it_recovers(rig):
    rig.store.failures = 10**9  # the disk is full until further notice
    a, wa = rig.join("j", 1)  # its world formed in memory; the commit that would announce it fails
    with pytest.raises(Unavailable, match=r"cannot write its state \(disk full \(simulated\)\); retry"):
        await asyncio.wait_for(wa, 5)  # at once, not at the 30 s timeout
    assert [type(e) for e in rig.store_errors] == [StoreError]

    refused = rig.store.refused
    k1, wk1 = rig.join("k", 2, "n1")
    k2, wk2 = rig.join("k", 2, "n2")  # complete, but no world forms while nothing can be written
    await eventually(lambda: rig.store.refused >= refused + 2, what="k's joins refused by the store, twice")
    view = rig.machine.describe("k")
    assert view.state is JobState.FORMING and view.generation == 0 and not wk1.done() and not wk2.done()
    assert view.reason.startswith("held: the server cannot write its state (disk full (simulated))")
    with pytest.raises(Unavailable):  # a Leave is not answered OK before it is durable
        await asyncio.wait_for(rig.executor.carry_out(rig.machine.leave("j", a)), 5)

    rig.store.failures = 0
    worlds = await asyncio.wait_for(asyncio.gather(wk1, wk2), 5)
    assert {(w.generation, tuple(sorted(w.plan.ranks.values()))) for w in worlds} == {(1, (0, 1))}
    assert [type(e) for e in rig.store_errors] == [StoreError, type(None)]
    assert [(j.job_id, j.state, j.generation) for j in rig.store.load()] == [
        ("j#1", "ended", 1), ("k", "formed", 1)]  # j's leave, retried: its run ended, kept apart


async def test_a_fenced_executor_stops_and_ends_every_wait():
    store = MemoryStore()
    rig = Rig(store)
    a, wa = rig.join("j", 2)
    await rig.executor.settled()
    store.take_over()  # another server takes the store over
    with pytest.raises(Unavailable, match="no longer owns its store"):
        await rig.executor.carry_out(rig.machine.leave("j", a))
    assert len(rig.fenced) == 1 and isinstance(rig.fenced[0], Fenced)
    with pytest.raises(Unavailable):
        await wa
    await rig.executor.stop()


async def test_deadlines_fire_without_anyone_asking():
    rig = Rig(MemoryStore(), lease_ttl_s=0.2)
    (a, wa) = rig.join("j", 1)
    await wa
    await eventually(lambda: any(n.event == "removed" for n in rig.notes), timeout_s=5, what="the lease expired")
    assert [n.fields["why"] for n in rig.notes if n.event == "removed"] == ["expired"]
    assert [(j.job_id, j.state, j.members) for j in rig.store.load()] == [("j#1", "failed", ())]  # its run, kept as it ended
    await rig.executor.stop()


async def test_a_stalled_loop_hears_the_renewals_that_waited_before_it_expires_anyone():
    """The event loop is blocked for 2.5 s (a long GC, a starved process) while a lease of 1 s runs out.
    Waking, the executor finds its deadline timer 1.5 s late and waits that long again before expiring:
    the member whose renewal is read just after the stall keeps its seat; the silent one is removed."""
    rig = Rig(MemoryStore(), lease_ttl_s=1.0)
    (a, wa), (b, wb) = rig.join("a", 1), rig.join("b", 1, node="m")
    await asyncio.gather(wa, wb)
    loop = asyncio.get_running_loop()

    def stall() -> None:
        time.sleep(2.5)  # the scenario: the whole loop is blocked
        loop.call_later(0.1, lambda: rig.machine.renew("a", a, 1))  # its renewal, read from the socket after the stall

    loop.call_soon(stall)
    await eventually(lambda: any(n.event == "removed" for n in rig.notes), timeout_s=10, what="the silent lease expired")
    assert [n.fields["member"] for n in rig.notes if n.event == "removed"] == [b]
    assert rig.machine.describe("a").state is JobState.FORMED
    await rig.executor.stop()


async def test_a_slow_store_does_not_cost_a_new_world_its_first_leases():
    """Found by benchmarks/chaos.py: etcd took longer than a lease TTL to commit a world, so its members'
    first leases, counted from the forming, ran out before their Join answers could leave, and they were
    removed as they heard they were seated. A commit that takes longer than STALL_S holds expiry as a
    stall does (and so does a deadline that comes while it is under way)."""
    rig = Rig(GatedStore(), lease_ttl_s=1.0)
    rig.store.gate.clear()  # the store stalls: the world's commit waits
    (a, wa), (b, wb) = rig.join("j", 2), rig.join("j", 2, node="m")
    await asyncio.sleep(2.0)  # twice the TTL: the first leases, counted from the forming, have run out
    rig.store.gate.set()
    await asyncio.gather(wa, wb)  # both answered their world
    rig.machine.answered("j", a)
    rig.machine.answered("j", b)
    await consistently(lambda: not [n for n in rig.notes if n.event == "removed"], 0.5,
                       "nobody removed within a TTL of the answers")
    assert rig.machine.describe("j").state is JobState.FORMED
    await rig.executor.stop()


async def test_a_failing_store_does_not_cost_a_new_world_its_first_leases():
    """Found by benchmarks/chaos.py (seed 6): etcd refused a new leader's writes for a while; the worlds it
    had formed could not be announced, their members' first leases ran out meanwhile, and they were removed
    the moment the store came back, as their Join answers left. Time spent retrying a commit counts as a
    slow commit's does: no first lease runs out while its answer waits on the store."""
    rig = Rig(GatedStore(), lease_ttl_s=1.5)
    rig.store.failing_until = time.monotonic() + 3.0  # two TTLs of refused writes
    (_, wa), (_, wb) = rig.join("j", 2), rig.join("j", 2, node="m")
    for waiter in (wa, wb):  # told at once that nothing can be written; their clients retry
        with pytest.raises(Unavailable, match="cannot write its state"):
            await waiter
    await eventually(lambda: rig.store.commits, 10, "the store never came back")
    await consistently(lambda: not [n for n in rig.notes if n.event == "removed"], 1.0,
                       "nobody removed within a TTL of the store's return")
    await eventually(lambda: [n for n in rig.notes if n.event == "removed"], 5,
                           "silent members must still go, a TTL later")
    await rig.executor.stop()


async def test_waiters_share_one_timer_and_time_out():
    loop = asyncio.get_running_loop()
    waiters = Waiters()
    before = len(loop._scheduled)  # noqa: SLF001 - the timer count is the point
    futures = [waiters.add("j", f"m{i}", 30.0 + i / 100) for i in range(100)]
    assert len(loop._scheduled) - before == 1  # noqa: SLF001
    short = waiters.add("j", "short", 0.05)
    with pytest.raises(TimeoutError):
        await short
    assert not any(f.done() for f in futures)
    await waiters.wake("j", MemberGone("m3"))
    with pytest.raises(NotFound, match="member m3 left job 'j' while waiting"):
        await futures[3]
