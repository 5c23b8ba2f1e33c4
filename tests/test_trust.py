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
