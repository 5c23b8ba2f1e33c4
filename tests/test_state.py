"""The membership state machine with an injected clock: leases, expiry, leaving."""

from __future__ import annotations

import asyncio

import pytest

from commctx.server.errors import Conflict, JobFull, NotFound, StaleGeneration, WaitTimeout
from commctx.server.spec import JobSpec
from commctx.server.state import JobState, JoinParams, Rendezvous


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def params(job: str, world: int, node: str = "n", local_rank: int | None = None) -> JoinParams:
    return JoinParams(job, JobSpec(world), node, "127.0.0.1", 30000, local_rank, None, True)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def rdzv(clock):
    ids = iter(f"{i:04x}" for i in range(1, 10_000))
    return Rendezvous(lease_ttl_s=10.0, clock=clock, new_member_id=lambda: next(ids))


async def form(rdzv: Rendezvous, job: str, world: int) -> list[str]:
    members = [rdzv.join(params(job, world)).member_id for _ in range(world)]
    for m in members:
        await rdzv.wait_assignment(job, m, 1.0)
    return members


async def test_leases_start_when_the_world_forms_and_expire_after_ttl(rdzv, clock):
    waiting = rdzv.join(params("j", 2)).member_id
    clock.now += 3600  # a forming member holds no lease: its open call binds it
    assert rdzv.expire() == []
    other = rdzv.join(params("j", 2)).member_id
    assert rdzv.describe("j").state is JobState.FORMED
    clock.now += 9.0
    assert rdzv.keep_alive("j", waiting, 1) == (10.0, 1)
    clock.now += 2.0  # `other` is now 11 s without renewal, `waiting` 2 s
    assert rdzv.expire() == [("j", other)]
    with pytest.raises(NotFound, match=f"member '{other}' is not in job 'j'"):
        rdzv.keep_alive("j", other, 1)
    # a fixed-size world cannot go on with one of two
    view = rdzv.describe("j")
    assert view.state is JobState.FAILED and "fewer than the minimum of 2" in view.reason
    clock.now += 11.0
    assert rdzv.expire() == [("j", waiting)]
    assert rdzv.describe("j").state is JobState.FAILED  # kept a while to say why


async def test_keepalive_with_another_generation_is_stale(rdzv):
    (m,) = await form(rdzv, "g", 1)
    with pytest.raises(StaleGeneration, match="holds generation 2 but the current generation is 1"):
        rdzv.keep_alive("g", m, 2)
    assert rdzv.keep_alive("g", m, 0) == (10.0, 1)  # 0: "I hold no assignment yet"


async def test_withdraw_before_forming_removes_after_forming_does_not(rdzv):
    a = rdzv.join(params("w", 3)).member_id
    rdzv.withdraw("w", a)
    assert "w" not in rdzv.job_ids()
    members = await form(rdzv, "w", 3)
    rdzv.withdraw("w", members[0])
    assert rdzv.describe("w").joined == 3


async def test_formed_job_refuses_newcomers_and_is_deleted_with_its_last_member(rdzv):
    members = await form(rdzv, "f", 2)
    with pytest.raises(JobFull, match="already has all 2 workers"):
        rdzv.join(params("f", 2))
    for m in members:
        rdzv.leave("f", m)
    assert rdzv.job_ids() == []
    # the id is free again
    assert rdzv.join(params("f", 5)).joined == 1


async def test_expired_waiter_wakes_with_not_found(rdzv):
    a = rdzv.join(params("e", 2)).member_id
    task = asyncio.ensure_future(rdzv.wait_assignment("e", a, None))
    await asyncio.sleep(0)
    rdzv.leave("e", a)
    with pytest.raises(NotFound, match="left job 'e' while waiting"):
        await task


async def test_wait_timeout_and_failed_world(rdzv):
    a = rdzv.join(params("t", 2, "x")).member_id
    with pytest.raises(WaitTimeout, match=r"did not form within 0.05 s: waiting: 1 of 2 workers joined \(nodes present: x×1\); 1 missing"):
        await rdzv.wait_assignment("t", a, 0.05)
    b = rdzv.join(params("bad", 2, "x", local_rank=1)).member_id
    c = rdzv.join(params("bad", 2, "y")).member_id
    for m in (b, c):
        with pytest.raises(Conflict, match="node 'x' has 1 workers but one asked for local_rank 1"):
            await rdzv.wait_assignment("bad", m, 1.0)
    assert rdzv.describe("bad").state is JobState.FAILED
    with pytest.raises(Conflict, match="cannot form"):
        rdzv.join(params("bad", 2))


async def test_many_waiters_share_one_timer(rdzv):
    members = [rdzv.join(params("many", 101)).member_id for _ in range(100)]
    loop = asyncio.get_running_loop()
    tasks = [asyncio.ensure_future(rdzv.wait_assignment("many", m, 30.0)) for m in members]
    await asyncio.sleep(0)
    scheduled = len(loop._scheduled)  # noqa: SLF001 - checking the timer count is the point
    assert scheduled <= 3
    rdzv.join(params("many", 101))
    assignments = await asyncio.gather(*tasks)
    # one node, local ranks in join order: the 100 waiters hold ranks 0..99
    assert [a.placement.rank for a in assignments] == list(range(100))
