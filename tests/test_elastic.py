"""Elastic sizes, re-rendezvous, the rank rule, sessions and restarts: the state
machine with an injected clock and a shared store."""

from __future__ import annotations

import asyncio

import pytest

from commctx.server.errors import Conflict
from commctx.server.spec import spec_from_proto
from commctx.server.state import Assignment, Gone, JobState, JoinParams, Rendezvous, WorldChange
from commctx.server.store import MemoryStore
from commctx.v1 import rendezvous_pb2 as pb


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elastic(max_size: int, min_size: int, last_call_ms: int = 1000, **kw):
    return spec_from_proto(pb.JobSpec(world_size=max_size, elastic=pb.Elastic(min_size=min_size, last_call_ms=last_call_ms), **kw))


def fixed(size: int):
    return spec_from_proto(pb.JobSpec(world_size=size))


def params(spec, node: str, member_id: str = "", port: int = 30000) -> JoinParams:
    return JoinParams("job", spec, node, "10.0.0.1", port, None, None, False, "", member_id)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def store():
    return MemoryStore()


@pytest.fixture
def rdzv(clock, store):
    return Rendezvous(lease_ttl_s=10.0, clock=clock, store=store)


def ranks(rdzv, job="job") -> dict[str, int]:
    plan = rdzv._jobs[job].plan  # noqa: SLF001 - reading the plan is the point
    return dict(plan.ranks)


def drain(q: asyncio.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def sessions(rdzv, members, generation=1):
    return {m: rdzv.open_session("job", m, generation)[0] for m in members}


async def test_elastic_forms_at_max_at_once_and_at_min_after_the_last_call(rdzv, clock):
    spec = elastic(4, 2, last_call_ms=1000)
    a = rdzv.join(params(spec, "n0")).member_id
    b = rdzv.join(params(spec, "n0")).member_id
    assert rdzv.describe("job").state is JobState.FORMING
    clock.now += 0.5
    rdzv.tick()
    assert rdzv.describe("job").state is JobState.FORMING  # the last call is still open
    clock.now += 0.6
    rdzv.tick()
    view = rdzv.describe("job")
    assert (view.state, view.generation, view.joined) == (JobState.FORMED, 1, 2)
    assert sorted(ranks(rdzv).values()) == [0, 1] and set(ranks(rdzv)) == {a, b}

    spec4 = elastic(4, 2, last_call_ms=60_000)
    for _ in range(4):
        rdzv.join(JoinParams("big", spec4, "n", "10.0.0.1", 1))
    assert rdzv.describe("big").state is JobState.FORMED  # max reached: no last call


async def test_a_late_joiner_waits_then_grows_the_world(rdzv, clock):
    spec = elastic(3, 2, last_call_ms=0)
    a = rdzv.join(params(spec, "n0")).member_id
    b = rdzv.join(params(spec, "n1")).member_id
    assert rdzv.describe("job").generation == 1
    outboxes = sessions(rdzv, [a, b])
    c = rdzv.join(params(spec, "n0")).member_id
    view = rdzv.describe("job")
    assert (view.state, view.not_ready) == (JobState.FORMING, 2)
    changes = [drain(outboxes[m]) for m in (a, b)]
    assert all(len(x) == 1 and isinstance(x[0], WorldChange) and "1 worker waiting to join" in x[0].reason for x in changes)
    waiter = asyncio.ensure_future(rdzv.wait_assignment("job", c, 5))
    await asyncio.sleep(0)
    assert rdzv.renew("job", a, 1, ready_port=40001) == 1
    assert rdzv.describe("job").state is JobState.FORMING  # b has not re-armed
    rdzv.renew("job", b, 1, ready_port=40002)
    view = rdzv.describe("job")
    assert (view.state, view.generation, view.joined) == (JobState.FORMED, 2, 3)
    assert ranks(rdzv) == {a: 0, c: 1, b: 2}  # node n0 (a, c), then n1 (b): b's node rank 1 is kept
    pushed_a, pushed_b = drain(outboxes[a])[0], drain(outboxes[b])[0]
    assert isinstance(pushed_a, Assignment) and pushed_a.generation == 2 and pushed_a.previous_rank == 0
    assert pushed_b.previous_rank == 1 and pushed_b.placement.rank == 2
    assert set(pushed_a.changed_groups) == {"GLOBAL", "INTRA_NODE", "INTER_NODE"}  # INTER [0, 1] became [0, 2]
    assert pushed_a.plan.master_port == 40001  # rank 0 serves the new store on its ready port
    assert (await waiter).placement.rank == 1


async def test_survivors_keep_their_node_and_local_ranks(rdzv, clock):
    spec = elastic(4, 3, last_call_ms=60_000)
    ids = [rdzv.join(params(spec, n)).member_id for n in ("a", "a", "b", "b")]
    assert [ranks(rdzv)[m] for m in ids] == [0, 1, 2, 3]
    outboxes = sessions(rdzv, ids)
    clock.now += 5
    for m in (ids[0], ids[2], ids[3]):
        rdzv.renew("job", m, 1)
    clock.now += 6  # ids[1] (node a, rank 1) has not renewed for 11 s
    assert rdzv.expire() == [("job", ids[1])]
    told = drain(outboxes[ids[0]])
    assert isinstance(told[0], WorldChange) and f"member {ids[1]} (node 'a', rank 1) expired" in told[0].reason
    for i, m in enumerate((ids[0], ids[2], ids[3])):
        rdzv.renew("job", m, 1, ready_port=41000 + i)
    assert rdzv.describe("job").generation == 2
    # node a keeps node rank 0 and local rank 0; node b keeps node rank 1 and local ranks 0, 1
    assert {m: ranks(rdzv)[m] for m in (ids[0], ids[2], ids[3])} == {ids[0]: 0, ids[2]: 1, ids[3]: 2}
    plan = rdzv._jobs["job"].plan  # noqa: SLF001
    assert [(p.node_rank, p.local_rank) for p in (plan.placement(m) for m in (ids[0], ids[2], ids[3]))] == [(0, 0), (1, 0), (1, 1)]


async def test_only_groups_that_changed_are_marked(rdzv, clock):
    spec = elastic(4, 3, last_call_ms=5000)
    ids = [rdzv.join(params(spec, n)).member_id for n in ("a", "a", "b", "b")]
    outboxes = sessions(rdzv, ids)
    rdzv.leave("job", ids[3])  # rank 3: node b, local rank 1
    for i, m in enumerate(ids[:3]):
        rdzv.renew("job", m, 1, ready_port=42000 + i)
    # survivors alone have nobody to wait for: no last call
    assert rdzv.describe("job").generation == 2
    pushed = {m: [e for e in drain(outboxes[m]) if isinstance(e, Assignment)][0] for m in ids[:3]}
    assert [pushed[m].placement.rank for m in ids[:3]] == [0, 1, 2]  # nobody moves
    assert set(pushed[ids[0]].changed_groups) == {"GLOBAL"}  # INTRA [0, 1] and INTER [0, 2] stand
    assert set(pushed[ids[1]].changed_groups) == {"GLOBAL", "INTER_NODE"}  # INTER [1, 3] became [1]
    assert set(pushed[ids[2]].changed_groups) == {"GLOBAL", "INTRA_NODE"}


async def test_below_the_minimum_survivors_are_told_the_job_cannot_continue(rdzv, clock):
    spec = fixed(2)
    a, b = (rdzv.join(params(spec, "n")).member_id for _ in range(2))
    outbox = sessions(rdzv, [a])[a]
    clock.now += 11
    rdzv.renew("job", a, 1)
    rdzv.expire()
    (gone,) = drain(outbox)
    assert isinstance(gone, Gone) and "cannot continue" in gone.reason and "fewer than the minimum of 2" in gone.reason
    assert rdzv.describe("job").state is JobState.FAILED
    with pytest.raises(Conflict, match="cannot form"):
        rdzv.join(params(spec, "n"))


async def test_a_graceful_leave_ends_a_fixed_job_without_failing_it(rdzv):
    spec = fixed(2)
    a, b = (rdzv.join(params(spec, "n")).member_id for _ in range(2))
    outbox = sessions(rdzv, [b])[b]
    rdzv.leave("job", a)
    assert rdzv.describe("job").state is JobState.ENDED
    assert "cannot continue" in drain(outbox)[0].reason
    rdzv.leave("job", b)
    assert rdzv.job_ids() == []  # no tombstone: nothing failed


async def test_a_retried_join_reattaches(rdzv):
    spec = fixed(2)
    first = rdzv.join(params(spec, "n", member_id="aa" * 8, port=1))
    again = rdzv.join(params(spec, "n", member_id="aa" * 8, port=2))
    assert again.member_id == first.member_id and again.joined == 1
    with pytest.raises(Conflict, match="joined before with other parameters"):
        rdzv.join(params(spec, "other-node", member_id="aa" * 8))


async def test_elastic_layout_forms_at_a_multiple_of_its_step(rdzv, clock):
    spec = elastic(6, 2, last_call_ms=5000, layout=pb.ParallelLayout(tp=2))
    ids = [rdzv.join(params(spec, "n")).member_id for _ in range(3)]
    clock.now += 5.1
    rdzv.tick()
    view = rdzv.describe("job")
    assert (view.state, view.generation, view.waiting) == (JobState.FORMED, 1, 1)
    assert sorted(ranks(rdzv).values()) == [0, 1] and ids[2] not in ranks(rdzv)  # 3 present, tp=2: a world of 2


async def test_restart_restores_worlds_and_forming_jobs(clock, store):
    first = Rendezvous(lease_ttl_s=10.0, clock=clock, store=store)
    spec = fixed(3)
    formed = [first.join(JoinParams("formed", spec, n, "10.0.0.1", 5000 + i)).member_id for i, n in enumerate("aab")]
    before = dict(first._jobs["formed"].plan.ranks)  # noqa: SLF001
    forming = first.join(JoinParams("forming", fixed(2), "x", "10.0.0.2", 6000, member_id="bb" * 8)).member_id

    clock.now += 8  # the server is down for a while: leases must not lapse for it
    second = Rendezvous(lease_ttl_s=10.0, clock=clock, store=store)
    assert second.restore(grace_s=10.0) == 2
    view = second.describe("formed")
    assert (view.state, view.generation, view.joined) == (JobState.FORMED, 1, 3)
    assert dict(second._jobs["formed"].plan.ranks) == before  # noqa: SLF001 - same ranks, same generation
    # the forming worker retries its Join with the same id (within the grace) ...
    again = second.join(JoinParams("forming", fixed(2), "x", "10.0.0.2", 6001, member_id=forming))
    assert again.member_id == forming
    clock.now += 15
    assert second.expire() == []  # members of worlds: TTL + grace after the restart; the re-attached one: its call
    for m in formed:
        assert second.renew("formed", m, 1) == 1
    # ... and a second worker completes its world
    other = second.join(JoinParams("forming", fixed(2), "y", "10.0.0.3", 6002)).member_id
    a = await second.wait_assignment("forming", forming, 1)
    b = await second.wait_assignment("forming", other, 1)
    assert sorted([a.placement.rank, b.placement.rank]) == [0, 1] and a.generation == 1
    assert a.plan.master_port == 6001  # the re-attached worker's new port


async def test_a_forming_member_that_never_comes_back_after_a_restart_expires(clock, store):
    first = Rendezvous(lease_ttl_s=10.0, clock=clock, store=store)
    first.join(JoinParams("f", fixed(2), "x", "10.0.0.2", 6000))
    second = Rendezvous(lease_ttl_s=10.0, clock=clock, store=store)
    second.restore(grace_s=10.0)
    clock.now += 11
    assert [j for j, _ in second.expire()] == ["f"]
    assert second.job_ids() == []
