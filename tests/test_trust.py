"""Trust, round 3 (issue 37): what one caller can no longer do to another's
job. State-machine tests with an injected clock; the attacks against a real
server are in test_hostile.py and test_tenants.py."""

from __future__ import annotations

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
