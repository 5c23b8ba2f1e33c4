"""Trust, round 3 (issue 37): what one caller can no longer do to another's
job. State-machine tests with an injected clock; the attacks against a real
server are in test_hostile.py and test_tenants.py."""

from __future__ import annotations

import pytest

from commctx.server.rendezvous.machine import Rendezvous
from commctx.server.rendezvous.model import JobState
from commctx.server.rendezvous.shares import Caller

from .test_machine import TTL, FakeClock, join, node_params, node_spec, sessions

STRANGER = Caller("peer:10.9.9.9", "peer 10.9.9.9")
TEAM = Caller("peer:10.0.0.1", "peer 10.0.0.1")


def test_a_standby_cannot_close_a_run_a_seated_member_can():
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=FakeClock())
    spec = node_spec(2, 2)
    a, _ = join(rdzv, node_params(spec, "a", 2))
    b, _ = join(rdzv, node_params(spec, "b", 2))
    sinks = sessions(rdzv, [a, b], job="run")
    standby, _ = join(rdzv, node_params(spec, "s", 2))  # waits in line: not seated
    actions = rdzv.leave("run", standby, caller=STRANGER, close=True)
    assert rdzv.describe("run").state is JobState.FORMED and not [e for s, e in actions.pushes if s in sinks.values()]
    assert [e.kind for e in rdzv.events("run")][-1] == "left"  # it left, as a plain leave
    rdzv.leave("run", a, caller=TEAM, close=True)  # a seated node's launcher shut the run down
    assert rdzv.describe("run").state is JobState.CLOSED


def test_no_storm_of_refusals_evicts_a_jobs_life():
    """Joins refused with ten thousand distinct node keys (distinct reasons) are
    sampled apart: the job's joined and formed events stay; the refusals are
    counted, and the last Refusals.KEPT of them listed, in seq order."""
    from commctx.common.planning import JobSpec
    from commctx.server.errors import Full
    from commctx.server.rendezvous.model import Limits, Refusals
    from commctx.server.rendezvous.store import PutEvent

    from .test_machine import params

    rdzv = Rendezvous(lease_ttl_s=TTL, clock=FakeClock(), limits=Limits(max_events_per_job=100))
    spec = JobSpec.build(2)
    for n in ("a", "b"):
        join(rdzv, params(spec, n))
    writes = []
    for i in range(10_000):
        try:
            rdzv.join(params(spec, f"x{i}"))  # the world is full: "... node 'x17' cannot join it"
        except Full:
            pass
        writes += rdzv.take_outbox().writes
    events = rdzv.events("job")
    assert [e.kind for e in events[:2]] == ["joined", "formed"] and len(events) == 2 + Refusals.KEPT
    assert [e.seq for e in events] == sorted(e.seq for e in events) and events[-1].kind == "refused"
    assert rdzv.describe("job").refused == 10_000
    assert not [w for w in writes if isinstance(w, PutEvent)]  # a sample in memory: the store keeps the job's life
    assert rdzv.last_event("job").kind == "refused"


def test_strangers_standbys_are_capped_and_a_teams_replacement_is_seated_first():
    """The audit's run: two seated nodes of a team, strangers parking standbys.
    A stranger parks at most half as many standbys as there are seats, and
    none once the job holds as many standbys as seats; the team's own
    replacement is admitted all the same, and takes the lost node's place
    ahead of the strangers' earlier standby."""
    from commctx.server.errors import Full

    clock = FakeClock()
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock)
    spec = node_spec(4, 4)
    team = [join_as(rdzv, node_params(spec, n, 2), TEAM) for n in "abcd"]
    sinks = sessions(rdzv, team, job="run")
    join_as(rdzv, node_params(spec, "s1", 2), STRANGER)
    join_as(rdzv, node_params(spec, "s2", 2), STRANGER)
    with pytest.raises(Full, match=r"2 of them peer 10\.9\.9\.9's, which holds no seat in it: at most 2"):
        rdzv.join(node_params(spec, "s3", 2), STRANGER)
    other = Caller("peer:10.8.8.8", "peer 10.8.8.8")
    join_as(rdzv, node_params(spec, "o1", 2), other)
    join_as(rdzv, node_params(spec, "o2", 2), other)  # now as many standbys as seats: no more strangers
    with pytest.raises(Full, match="holds no seat in it"):
        rdzv.join(node_params(spec, "x1", 2), Caller("peer:10.7.7.7", "peer 10.7.7.7"))
    spare = join_as(rdzv, node_params(spec, "t1", 2), TEAM)  # the team's own replacement still gets in
    clock.now += TTL / 2
    for m in team[:3]:
        rdzv.renew("run", m, 1)
    rdzv.close_session("run", team[3], sinks[team[3]], departed=True)  # the team's node d dies
    clock.now += 1.0
    actions, _ = rdzv.expire_due()
    (world,) = [o for _, o in actions.wakes if type(o).__name__ == "NewWorld"]
    assert sorted(n.node_key for n in world.plan.nodes) == ["a", "b", "c", "t1"] and spare in dict(world.plan.ranks)


def join_as(rdzv: Rendezvous, p, caller: Caller) -> str:
    joined, _, _ = rdzv.join(p, caller)
    return joined.member_id


def test_a_callers_placed_workers_count_against_its_share_until_they_go():
    """--max-workers-per-caller counts what a caller holds, not only its Joins
    waiting: a formed world's workers stay counted until they leave."""
    from commctx.common.planning import JobSpec
    from commctx.server.errors import LimitExceeded
    from commctx.server.rendezvous.model import Limits
    from commctx.server.rendezvous.shares import WORKERS

    from .test_machine import params

    rdzv = Rendezvous(lease_ttl_s=TTL, clock=FakeClock(), limits=Limits(max_workers_per_caller=4))
    formed = [join_as(rdzv, params(JobSpec.build(2), f"n{i}", job="a"), TEAM) for i in range(2)]
    assert rdzv.describe("a").state is JobState.FORMED and rdzv.shares.held(WORKERS, TEAM) == 2
    join_as(rdzv, params(JobSpec.build(3), "m0", job="b"), TEAM)
    join_as(rdzv, params(JobSpec.build(3), "m1", job="b"), TEAM)
    with pytest.raises(LimitExceeded, match="holds 4 workers \\(waiting or placed, all its jobs\\)"):
        rdzv.join(params(JobSpec.build(3), "m2", job="b"), TEAM)
    join_as(rdzv, params(JobSpec.build(3), "m2", job="b"), STRANGER)  # another caller's own count
    rdzv.leave("a", formed[0], caller=TEAM)
    assert rdzv.shares.held(WORKERS, TEAM) == 3  # given back as its workers go
