"""The state machine's transitions, tested as data: each call returns the
actions it implies (writes, pushes to session sinks, waiter wakes, notes),
with an injected clock and no event loop. Elastic sizes, re-forming, the rank
rule, leases and restarts."""

from __future__ import annotations

import pytest

from commctx.common.planning import JobSpec, PlanError, plan_world
from commctx.server.errors import AlreadyExists, BadRequest, Closed, Conflict, Full, NotFound, Stale
from commctx.server.rendezvous.leases import Lessor
from commctx.server.rendezvous.machine import Actions, Rendezvous
from commctx.server.rendezvous.model import Gone, JobState, JobStopped, Limits, MemberGone, NewWorld, Reforming, Replaced
from commctx.server.rendezvous.params import JoinParams
from commctx.server.rendezvous.store import DeleteJob, DeleteMember, PutEvent, PutJob, PutMember

from .stores import DictStore as MemoryStore  # the contract tests' reference store, keeping records

TTL = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Sink:
    """A session sink: what the executor would put in it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Sink({self.name})"


def elastic(max_size: int, min_size: int, last_call_ms: int = 1000, **kw) -> JobSpec:
    return JobSpec.from_json({"world_size": max_size, "elastic": {"min_size": min_size, "last_call_ms": last_call_ms}, **kw})


def params(spec: JobSpec, node: str = "n", *, job: str = "job", port: int = 30000, local_rank: int | None = None,
           member_id: str = "", address: str = "10.0.0.1", role: str = "") -> JoinParams:
    return JoinParams.build(job_id=job, spec=spec, node_key=node, address=address, port=port, local_rank=local_rank,
                            role=role, member_id=member_id)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def rdzv(clock):
    ids = iter(f"{i:04x}" for i in range(1, 10_000))
    return Rendezvous(lease_ttl_s=TTL, clock=clock, new_member_id=lambda: next(ids))


def join(rdzv: Rendezvous, p: JoinParams) -> tuple[str, Actions]:
    joined, actions, placed = rdzv.join(p)
    assert placed is None
    return joined.member_id, actions


def worlds(actions: Actions) -> list[NewWorld]:
    return [o for _, o in actions.wakes if isinstance(o, NewWorld)]


def pushed(actions: Actions, sink: Sink) -> list:
    return [event for s, event in actions.pushes if s is sink]


def ranks(rdzv: Rendezvous, job: str = "job") -> dict[str, int]:
    return dict(rdzv._jobs[job].plan.ranks)


def sessions(rdzv: Rendezvous, members, generation: int = 1, job: str = "job") -> dict[str, Sink]:
    out = {}
    for m in members:
        out[m] = Sink(m)
        rdzv.open_session(job, m, generation, out[m], spare_port=40000 + len(out))
    return out


# -- forming ---------------------------------------------------------------------------------


def test_a_fixed_world_forms_when_the_last_worker_joins(rdzv):
    spec = JobSpec.build(3)
    first, actions = join(rdzv, params(spec, "b"))
    assert [type(w) for w in actions.writes] == [PutJob, PutMember, PutEvent] and not actions.wakes
    assert actions.notes[0].event == "join" and actions.notes[0].fields["joined"] == 1
    join(rdzv, params(spec, "a"))
    last, actions = join(rdzv, params(spec, "a"))
    (world,) = worlds(actions)
    assert (world.generation, world.plan.world_size, world.reason) == (1, 3, "")
    assert ranks(rdzv) == {"0002": 0, last: 1, first: 2}  # node a before node b; join order within a
    # the world is written (job record with its seats; rank 0's spare now serves the store) ...
    job_record = next(w.record for w in actions.writes if isinstance(w, PutJob))
    assert (job_record.state, job_record.generation) == ("formed", 1)
    assert [list(n.members) for n in job_record.world.nodes] == [["0002", last], [first]]
    rank0 = next(w.record for w in actions.writes if isinstance(w, PutMember) and w.record.member_id == "0002")
    assert rank0.port == 0
    # ... the waiters woken with it, and operators told
    assert [n.event for n in actions.notes][-1] == "formed"
    a = world.seat_of(first)
    assert (a.seat.rank, a.seat.node_rank, a.seat.local_rank, a.changed_groups) == (
        2, 1, 0, ("GLOBAL", "INTRA_NODE", "INTER_NODE"))


def test_conflicts_are_refused_and_change_nothing(rdzv):
    spec = JobSpec.build(3)
    first, _ = join(rdzv, params(spec, "a", local_rank=0))
    with pytest.raises(Conflict, match="job 'job' has world_size=3 but this worker asked for world_size=4"):
        rdzv.join(params(JobSpec.build(4), "a"))
    with pytest.raises(AlreadyExists, match="local_rank 0 on node 'a' of job 'job' is already held by another worker"):
        rdzv.join(params(spec, "a", local_rank=0))
    with pytest.raises(Conflict, match="cannot mix loopback and routable addresses"):
        rdzv.join(params(spec, "b", address="127.0.0.1"))
    assert rdzv.describe("job").joined == 1


def test_roles_are_counted_and_checked(rdzv):
    spec = JobSpec.from_json({"world_size": 2, "roles": [{"role": "trainer", "count": 1}, {"role": "rollout", "count": 1}]})
    with pytest.raises(Conflict, match="declares roles trainer:1, rollout:1 but this worker joined as role 'critic'"):
        rdzv.join(params(spec, role="critic"))
    join(rdzv, params(spec, role="trainer"))
    with pytest.raises(Full, match="already has all 1 workers of role 'trainer'"):
        rdzv.join(params(spec, role="trainer"))
    with pytest.raises(Conflict, match="declares roles trainer:1, rollout:1 but this worker joined as role 'critic'"):
        rdzv.join(params(spec, role="critic"))


def test_elastic_forms_at_max_at_once_and_at_min_after_the_last_call(rdzv, clock):
    spec = elastic(4, 2, last_call_ms=1000)
    a, _ = join(rdzv, params(spec))
    b, _ = join(rdzv, params(spec))
    assert rdzv.next_deadline() == clock.now + 1.0  # the last call, in the deadline heap
    clock.now += 0.5
    actions, more = rdzv.expire_due()
    assert not actions and not more and rdzv.describe("job").state is JobState.FORMING
    clock.now += 0.6
    actions, _ = rdzv.expire_due()
    (world,) = worlds(actions)
    assert (world.generation, world.plan.world_size) == (1, 2) and set(world.plan.ranks) == {a, b}

    spec4 = elastic(4, 2, last_call_ms=60_000)
    for _ in range(3):
        join(rdzv, params(spec4, job="big"))
    _, actions = join(rdzv, params(spec4, job="big"))
    assert worlds(actions)[0].plan.world_size == 4  # max reached: no last call


def test_elastic_layout_forms_at_a_multiple_of_its_step(rdzv, clock):
    spec = elastic(6, 2, last_call_ms=5000, layout={"tp": 2})
    ids = [join(rdzv, params(spec))[0] for _ in range(3)]
    clock.now += 5.1
    rdzv.expire_due()
    view = rdzv.describe("job")
    assert (view.state, view.generation, view.waiting) == (JobState.FORMED, 1, 1)
    assert sorted(ranks(rdzv).values()) == [0, 1] and ids[2] not in ranks(rdzv)  # 3 present, tp=2: a world of 2


def test_a_world_that_cannot_form_fails_every_waiter(rdzv):
    spec = JobSpec.build(2)
    join(rdzv, params(spec, "x", local_rank=1))
    _, actions = join(rdzv, params(spec, "y"))
    (stopped,) = [o for _, o in actions.wakes]
    assert isinstance(stopped, JobStopped) and stopped.reason == "job 'job' cannot form: node 'x' has 1 workers but one asked for local_rank 1"
    assert rdzv.describe("job").state is JobState.FAILED
    with pytest.raises(Conflict, match="cannot form"):
        rdzv.join(params(spec, "z"))


def test_a_retried_join_reattaches(rdzv, clock):
    spec = JobSpec.build(2)
    first, _ = join(rdzv, params(spec, member_id="aa" * 8, port=1))
    joined, actions, placed = rdzv.join(params(spec, member_id="aa" * 8, port=2))
    assert (joined.member_id, joined.joined, placed) == (first, 1, None)
    assert [w.record.port for w in actions.writes] == [2]  # its new spare
    with pytest.raises(Conflict, match="joined before with other parameters"):
        rdzv.join(params(spec, "other-node", member_id="aa" * 8))
    join(rdzv, params(spec))
    _, _, placed = rdzv.join(params(spec, member_id="aa" * 8, port=2))  # placed already: answered at once
    assert placed.generation == 1 and placed.seat_of(first).seat.rank == 0


def test_a_survivor_re_attaching_to_a_later_world_is_told_it_as_its_peers_were(rdzv, clock):
    """Found by the suite under load: a host's Join retried after the world it waited for formed was
    answered that world without the one before, so its survivors were told no previous rank and every
    group changed, as newcomers are."""
    ids = world_of_given_ids(rdzv)
    (second,) = worlds(rdzv.leave("job", ids[3]))
    _, _, placed = rdzv.join(params(elastic(4, 1), "n2", member_id=ids[2]))  # its Join, retried
    told, pushed_world = placed.seat_of(ids[2]), second.seat_of(ids[2])
    assert (told.previous_rank, told.changed_groups, told.reason) == (2, pushed_world.changed_groups, second.reason)
    assert "INTRA_NODE" not in told.changed_groups  # its node's group is unchanged


def test_withdraw_before_forming_removes_after_forming_does_not(rdzv):
    spec = JobSpec.build(3)
    a, _ = join(rdzv, params(spec))
    actions = rdzv.withdraw("job", a)
    assert [w for w in actions.writes if not isinstance(w, PutEvent)] == [DeleteMember("job", a), DeleteJob("job")]
    assert not actions.wakes
    assert rdzv.job_ids() == []
    members = [join(rdzv, params(spec))[0] for _ in range(3)]
    assert not rdzv.withdraw("job", members[0])
    assert rdzv.describe("job").joined == 3


def test_a_big_world_is_planned_off_the_loop(clock):
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock, plan_inline_max=2)
    spec = JobSpec.build(3)
    ids = [join(rdzv, params(spec, "n"))[0] for _ in range(2)]
    last, actions = join(rdzv, params(spec, "n"))
    (request,) = actions.plans  # too big to plan inside the transition
    assert not actions.wakes and rdzv.describe("job").state is JobState.FORMING
    assert [c.member_id for c in request.candidates] == [*ids, last] and request.spec.world_size == 3
    actions = rdzv.planned(request, plan_world(request.candidates, request.spec))
    (world,) = worlds(actions)
    assert world.generation == 1 and rdzv.describe("job").state is JobState.FORMED


def test_a_plan_for_a_job_that_changed_meanwhile_is_dropped(clock):
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock, plan_inline_max=2)
    spec = elastic(4, 3, last_call_ms=0)
    for _ in range(3):
        _, actions = join(rdzv, params(spec, "n"))
    (first,) = actions.plans
    _, actions = join(rdzv, params(spec, "n"))  # a fourth arrives while the first plan is computed
    (second,) = actions.plans
    assert second.spec.world_size == 4 and second.version > first.version
    assert not rdzv.planned(first, plan_world(first.candidates, first.spec))  # superseded: dropped
    (world,) = worlds(rdzv.planned(second, plan_world(second.candidates, second.spec)))
    assert world.plan.world_size == 4
    # a plan that cannot be made fails the job like one made inline
    rdzv2 = Rendezvous(lease_ttl_s=TTL, clock=clock, plan_inline_max=0)
    _, actions = join(rdzv2, params(JobSpec.build(1), "n", local_rank=0))
    (request,) = actions.plans
    actions = rdzv2.planned(request, PlanError("no seat"))
    assert [o for _, o in actions.wakes] == [JobStopped("job 'job' cannot form: no seat")]


def test_a_planner_bug_fails_the_one_job_it_meets_and_leaves_nobody_half_joined(rdzv, monkeypatch, caplog):
    from commctx.server.rendezvous import forming

    def broken(candidates, spec):
        raise ValueError("slice step cannot be zero")

    monkeypatch.setattr(forming, "plan_world", broken)
    _, actions = join(rdzv, params(JobSpec.build(1), "n"))  # the transition completes: no exception escapes
    (stopped,) = [o for _, o in actions.wakes]
    assert isinstance(stopped, JobStopped) and "the planner failed on this spec (ValueError: 'slice step" in stopped.reason
    view = rdzv.describe("job")
    assert view.state is JobState.FAILED and "commctx bug" in view.reason
    assert "planner_failed" in caplog.text and "Traceback" in caplog.text  # the operator gets the traceback to report


def plan_now(rdzv: Rendezvous, request) -> Actions:
    """What the executor does for a plan request: plan in full, hand the plan back."""
    return rdzv.planned(request, plan_world(request.candidates, request.spec))


def renew_only(rdzv: Rendezvous, clock: FakeClock, alive, generation: int = 1) -> Actions:
    """0.7 TTL on, `alive` renew; 0.4 TTL more: every other placed member's lease has run out."""
    clock.now += TTL * 0.7
    for mid in alive:
        rdzv.renew("job", mid, generation)
    clock.now += TTL * 0.4
    return rdzv.expire_due()[0]


def test_a_big_world_re_forms_with_one_message_per_survivor(clock):
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock, plan_inline_max=2)
    spec = elastic(4, 2, last_call_ms=5000)
    ids = []
    for n in range(4):
        mid, actions = join(rdzv, params(spec, f"n{n}"))
        ids.append(mid)
    (request,) = actions.plans
    plan_now(rdzv, request)
    sinks = sessions(rdzv, ids)
    actions = renew_only(rdzv, clock, ids[:3])  # ids[3] falls silent
    (request,) = actions.plans  # three survivors: planned off the loop ...
    assert [s for s, _ in actions.pushes] == [sinks[ids[3]]]  # its own Gone; survivors hear nothing yet: the assignment is the news
    actions = plan_now(rdzv, request)
    (world,) = worlds(actions)
    assert world.generation == 2 and all(pushed(actions, sinks[m]) == [world] for m in ids[:3])


def test_survivors_hear_of_a_wait_that_began_while_their_world_was_planned(clock):
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock, plan_inline_max=1)
    spec = elastic(4, 2, last_call_ms=5000)
    ids = []
    for n in range(3):
        mid, actions = join(rdzv, params(spec, f"n{n}"))
        ids.append(mid)
    clock.now += 5.0  # the last call closes: a world of 3
    actions, _ = rdzv.expire_due()
    (request,) = actions.plans
    plan_now(rdzv, request)
    sinks = sessions(rdzv, ids)
    actions = renew_only(rdzv, clock, ids[:2])  # ids[2] expires
    (request,) = actions.plans
    assert [s for s, _ in actions.pushes] == [sinks[ids[2]]]
    _, actions = join(rdzv, params(spec, "n3"))  # a newcomer opens a last call: the plan in flight is stale
    assert not actions.pushes and not actions.plans
    actions = plan_now(rdzv, request)
    change = Reforming(1, f"member {ids[2]} (node 'n2', rank 2) expired", True)
    assert not worlds(actions) and all(pushed(actions, sinks[m]) == [change] for m in ids[:2])
    assert rdzv.describe("job").state is JobState.FORMING


# -- leases ----------------------------------------------------------------------------------


def test_leases_start_when_the_world_forms_and_expire_after_ttl(rdzv, clock):
    spec = JobSpec.build(2)
    waiting, _ = join(rdzv, params(spec))
    clock.now += 3600  # a forming member holds no lease: its open call binds it
    assert rdzv.next_deadline() is None
    assert not rdzv.expire_due()[0]
    other, _ = join(rdzv, params(spec))
    # The first lease is the TTL plus the time to open the world's sessions (1 ms per member).
    assert rdzv.next_deadline() == clock.now + TTL + 2 * Lessor.SESSION_OPEN_S
    clock.now += 9.0
    assert rdzv.keep_alive("job", waiting, 1)[:2] == (TTL, 1)
    clock.now += 2.0  # `other` is now 11 s without renewal, `waiting` 2 s
    actions, _ = rdzv.expire_due()
    assert DeleteMember("job", other) in actions.writes
    assert [n.fields for n in actions.notes if n.event == "removed"] == [{"job": "job", "member": other, "why": "expired"}]
    with pytest.raises(NotFound, match=f"member '{other}' is not in job 'job'"):
        rdzv.keep_alive("job", other, 1)
    view = rdzv.describe("job")  # a fixed-size world cannot go on with one of two
    assert view.state is JobState.FAILED and "fewer than the minimum of 2" in view.reason
    clock.now += 11.0
    rdzv.expire_due()
    assert rdzv.describe("job").state is JobState.FAILED  # kept a while to say why
    clock.now += rdzv.limits.retain_ended_s
    rdzv.expire_due()
    assert rdzv.job_ids() == []


def test_time_the_server_could_not_hear_does_not_count_against_leases(rdzv, clock):
    """Found by benchmarks/chaos.py: a leader's event loop stalled for 4 s (a starved process); waking, it
    expired every lease that ran out meanwhile before reading the renewals waiting in its sockets. After
    a stall, no lease ends before the stall's length has passed again (at most a TTL)."""
    spec = JobSpec.build(2)
    a, _ = join(rdzv, params(spec))
    b, _ = join(rdzv, params(spec))
    clock.now += TTL + 4  # both leases ran out while the server heard nothing
    rdzv.stalled(4.0)
    assert rdzv.next_deadline() == clock.now + 4.0
    assert not rdzv.expire_due()[0].notes  # nobody is lost for a silence the server could not hear
    clock.now += 1.0
    rdzv.keep_alive("job", a, 1)  # a's renewal, read once the loop runs again
    clock.now += 3.0
    actions, _ = rdzv.expire_due()
    assert [n.fields["member"] for n in actions.notes if n.event == "removed"] == [b]  # b stayed silent
    rdzv.stalled(60.0)  # a longer stall holds expiry for one TTL at most
    assert rdzv.next_deadline() == clock.now + TTL


def test_renewals_do_not_touch_the_deadline_heap(rdzv, clock):
    spec = JobSpec.build(100)
    members = [join(rdzv, params(spec, f"n{i % 10}"))[0] for i in range(100)]
    heap = rdzv.lessor
    assert len(heap) == 100
    for _ in range(30):  # 30 renewals of every member within one TTL
        clock.now += TTL / 40
        for m in members:
            rdzv.renew("job", m, 1)
    assert len(heap) == 100
    clock.now += 0.1
    actions, _ = rdzv.expire_due()  # the first entries come due: renewed, so pushed again
    assert not actions and len(heap) == 100


# -- sessions that end: a crash seen at the reconnect grace, a hang at its lease ----------------

GRACE = 1.0


def elastic_world(rdzv: Rendezvous, n: int = 3) -> tuple[list[str], dict[str, Sink]]:
    """A formed elastic world of n (min 1) with every member's session open."""
    spec = elastic(n, 1)
    ids = [join(rdzv, params(spec, f"n{i}"))[0] for i in range(n)]
    assert rdzv.describe("job").state is JobState.FORMED
    return ids, sessions(rdzv, ids)


def test_a_session_closed_without_leave_is_a_departure_after_the_grace(rdzv, clock):
    ids, sinks = elastic_world(rdzv)
    assert not rdzv.close_session("job", ids[2], sinks[ids[2]], departed=True)  # killed: its connection reset
    assert rdzv.next_deadline() == clock.now + GRACE  # not its lease, 10 s away
    clock.now += GRACE - 0.01
    assert not rdzv.expire_due()[0]
    clock.now += 0.01
    actions, _ = rdzv.expire_due()
    assert [n.fields for n in actions.notes if n.event == "removed"] == [
        {"job": "job", "member": ids[2], "why": "disconnected"}]
    (world,) = worlds(actions)  # the survivors renewed lately: the next world forms at once
    assert world.generation == 2 and world.reason == (
        f"member {ids[2]} (node 'n2', rank 2) disconnected: session closed without leave")
    assert all(pushed(actions, sinks[m]) == [world] for m in ids[:2])


def test_a_member_that_missed_a_world_hears_it_when_its_session_returns_during_the_next_re_form(rdzv, clock):
    """Found by benchmarks/chaos.py (seeds 5 and 6): rank 0's connection was cut as generation 2 formed, so it
    never heard of it, and generation 2 then re-formed. Rank 0's spare port had become generation 2's store,
    so generation 3 waited for a new one; but a member's spare port counts only while it names the current
    generation, and it named 1 for ever: the job waited for good. A session that returns now hears the world
    it missed before the re-form, as the others did, and offers its next spare from there."""
    ids, sinks = elastic_world(rdzv, 4)
    zero = next(m for m, r in ranks(rdzv).items() if r == 0)
    others = [m for m in ids if m != zero]
    actions = rdzv.leave("job", others[2])
    (second,) = worlds(actions)
    assert second.generation == 2 and second.plan.master_port == 40000 + ids.index(zero) + 1  # zero's spare
    for m in others[:2]:  # they heard of it, and renew naming it; zero's push was lost with its connection
        rdzv.renew("job", m, 2, spare_port=41000 + ids.index(m))
    clock.now += 1
    actions = rdzv.leave("job", others[1])
    assert not worlds(actions)  # zero's spare serves generation 2's store: the next world awaits another
    rdzv.renew("job", zero, 1, spare_port=45555)  # naming the generation it holds: this port does not count
    assert rdzv.describe("job").state is JobState.FORMING
    _, missed, actions = rdzv.open_session("job", zero, 1, Sink("again"), spare_port=45555)
    assert [type(e) for e in missed] == [NewWorld, Reforming]
    assert (missed[0].generation, missed[0].plan.master_port, missed[1].generation) == (2, second.plan.master_port, 2)
    _, actions = rdzv.renew("job", zero, 2, spare_port=45556)  # it set up generation 2's store, and offers a new spare
    (third,) = worlds(actions)
    assert (third.generation, third.plan.master_port, set(third.plan.ranks)) == (3, 45556, {zero, others[0]})


def test_a_session_reopened_within_the_grace_keeps_its_seat_and_nobody_hears(rdzv, clock):
    ids, sinks = elastic_world(rdzv)
    rdzv.close_session("job", ids[0], sinks[ids[0]], departed=True)
    clock.now += 0.2
    _, missed, actions = rdzv.open_session("job", ids[0], 1, Sink("again"))
    assert not missed and not actions.pushes and not actions.wakes and not actions.writes
    reattached = clock.now
    clock.now += GRACE + 0.1
    assert not rdzv.expire_due()[0]
    clock.now = reattached + TTL - 0.5
    for m in ids[1:]:
        rdzv.renew("job", m, 1)
    clock.now = reattached + TTL - 0.01  # the new session renewed: its lease runs from there
    assert not rdzv.expire_due()[0]
    clock.now = reattached + TTL
    actions, _ = rdzv.expire_due()
    assert [(n.fields["member"], n.fields["why"]) for n in actions.notes if n.event == "removed"] == [(ids[0], "expired")]


def test_a_failure_report_ends_the_grace_of_members_already_disconnected(rdzv, clock):
    """A killed worker's stream closes; a survivor's collective fails at the same
    moment and says so: the dead member goes at once, not at the grace's end."""
    ids, sinks = elastic_world(rdzv)
    rdzv.close_session("job", ids[2], sinks[ids[2]], departed=True)
    actions = rdzv.report_failure("job", ids[0], 1)
    assert [(n.fields["member"], n.fields["why"]) for n in actions.notes if n.event == "removed"] == [(ids[2], "broke off")]
    (world,) = worlds(actions)  # at the report's clock reading: no grace waited out
    assert world.generation == 2 and world.plan.world_size == 2 and world.lost  # survivors end the old world's collectives
    assert world.reason == (f"member {ids[2]} (node 'n2', rank 2) disconnected: session closed without leave after its "
                            f"world's collectives failed")
    assert all(pushed(actions, sinks[m]) == [world] for m in ids[:2])
    assert not rdzv.report_failure("job", ids[1], 1)  # a report of the generation replaced: nothing to do


def test_after_a_failure_report_a_session_that_closes_is_gone_at_once(rdzv, clock):
    """The report may come first (the survivor's gloo error beats the server's
    view of the dead one's connection): the close that follows skips the grace."""
    ids, sinks = elastic_world(rdzv)
    assert not rdzv.report_failure("job", ids[0], 1)  # nobody has disconnected yet: nothing to remove
    assert not rdzv.report_failure("job", ids[1], 1)  # later reports of the generation: no second pass
    actions = rdzv.close_session("job", ids[2], sinks[ids[2]], departed=True)
    assert [n.fields["why"] for n in actions.notes if n.event == "removed"] == ["broke off"]
    assert worlds(actions)[0].plan.world_size == 2
    # in the next generation the grace is back: a blip costs nothing again
    sinks = sessions(rdzv, ids[:2], generation=2)
    assert not rdzv.close_session("job", ids[1], sinks[ids[1]], departed=True)
    assert rdzv.next_deadline() == clock.now + GRACE


def test_a_failure_report_counts_only_from_a_member_of_the_current_world(rdzv, clock):
    ids, sinks = elastic_world(rdzv)
    rdzv.close_session("job", ids[2], sinks[ids[2]], departed=True)
    assert not rdzv.report_failure("job", ids[0], 7)  # a generation the job never had
    assert not rdzv.report_failure("job", ids[0], 0)
    with pytest.raises(NotFound):
        rdzv.report_failure("job", "ffff", 1)
    with pytest.raises(NotFound):
        rdzv.report_failure("other", ids[0], 1)
    clock.now += GRACE  # the grace ran as it would have
    actions, _ = rdzv.expire_due()
    assert [n.fields["why"] for n in actions.notes if n.event == "removed"] == ["disconnected"]


def test_the_world_changed_event_says_whether_members_of_the_old_world_are_gone(rdzv, clock):
    """A world that only grows may run on until its assignment comes; one that
    lost a member cannot: its survivors abort their process groups at once."""
    spec = elastic(4, 1)
    grown = [join(rdzv, params(spec, f"n{i}"))[0] for i in range(2)]
    clock.now += 1.0
    rdzv.expire_due()  # the last call passes: a world of 2 forms
    sinks = sessions(rdzv, grown)
    _, actions = join(rdzv, params(spec, "n9"))  # can grow the world: its last call runs first
    assert [pushed(actions, sinks[m]) for m in grown] == [[Reforming(1, "1 worker waiting to join can grow the world", False)]] * 2



def test_a_new_world_says_whether_its_predecessor_lost_members_without_a_leave(rdzv, clock):
    """A member that left finished its collectives; one that expired may hold
    its peers in theirs, which they end on this news."""
    ids, sinks = elastic_world(rdzv, 3)
    (left,) = worlds(rdzv.leave("job", ids[2]))
    assert (left.generation, left.lost) == (2, False)
    sinks = sessions(rdzv, ids[:2], generation=2)
    clock.now += TTL
    rdzv.renew("job", ids[0], 2, spare_port=40100)  # rank 0: a new spare, its last one serves the store
    actions, _ = rdzv.expire_due()
    (expired,) = worlds(actions)
    assert (expired.generation, expired.lost) == (3, True) and pushed(actions, sinks[ids[0]]) == [expired]
    assert expired.seat_of(ids[0]).previous_lost


def test_the_world_changed_event_of_a_loss_says_so(rdzv, clock):
    ids, sinks = elastic_world(rdzv)
    clock.now += TTL / 2 + 0.1
    rdzv.renew("job", ids[0], 1)  # ids[1] not heard from for half a TTL: awaited when a member goes
    rdzv.close_session("job", ids[2], sinks[ids[2]], departed=True)
    clock.now += GRACE
    actions, _ = rdzv.expire_due()
    assert not worlds(actions)
    reason = f"member {ids[2]} (node 'n2', rank 2) disconnected: session closed without leave"
    assert [pushed(actions, sinks[m]) for m in ids[:2]] == [[Reforming(1, reason, True)]] * 2


def test_a_reattach_with_a_wrong_secret_or_an_older_generation_does_not_keep_the_seat(clock):
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock)
    spec = elastic(3, 1)
    secrets = [f"{i:032x}" for i in range(1, 4)]
    ids = [rdzv.join(JoinParams.build(job_id="job", spec=spec, node_key=f"n{i}", address="10.0.0.1", port=30000 + i,
                                      member_id=f"{i:016x}", member_secret=secrets[i]))[0].member_id for i in range(3)]
    sinks = {m: Sink(m) for m in ids}
    for i, (m, secret) in enumerate(zip(ids, secrets)):
        rdzv.open_session("job", m, 1, sinks[m], spare_port=40000 + i, secret=secret)
    rdzv.close_session("job", ids[2], sinks[ids[2]], departed=True)
    with pytest.raises(NotFound):
        rdzv.open_session("job", ids[2], 1, Sink("stranger"), secret=secrets[0])
    with pytest.raises(Stale, match="holds generation 1; a session naming generation 0"):
        rdzv.open_session("job", ids[2], 0, Sink("stale"), secret=secrets[2])
    clock.now += GRACE
    actions, _ = rdzv.expire_due()
    assert [n.fields["why"] for n in actions.notes if n.event == "removed"] == ["disconnected"]
    assert worlds(actions)[0].plan.world_size == 2


def test_a_keepalive_within_the_grace_also_keeps_the_seat(rdzv, clock):
    ids, sinks = elastic_world(rdzv)
    for m in ids[:2]:
        rdzv.close_session("job", m, sinks[m], departed=True)  # e.g. its connection reached its age (GOAWAY)
    rdzv.keep_alive("job", ids[0], 1)  # heard from within the grace
    rdzv.keep_alive("job", ids[1], 0)  # generation 0 is older than the 1 it held: the grace runs on
    clock.now += GRACE
    actions, _ = rdzv.expire_due()
    assert [n.fields["member"] for n in actions.notes if n.event == "removed"] == [ids[1]]


def test_a_newer_session_replaces_the_older_whose_end_is_no_departure(rdzv, clock):
    ids, sinks = elastic_world(rdzv)
    newer = Sink("newer")
    _, _, actions = rdzv.open_session("job", ids[1], 1, newer)
    (replaced,) = pushed(actions, sinks[ids[1]])
    assert isinstance(replaced, Replaced) and "newer session" in replaced.reason
    rdzv.close_session("job", ids[1], sinks[ids[1]], departed=True)  # the older stream ends: not this member's session
    clock.now += GRACE
    assert not rdzv.expire_due()[0]
    rdzv.close_session("job", ids[1], newer, departed=False)  # the server ended it (draining, handing over)
    clock.now += GRACE
    assert not rdzv.expire_due()[0]  # the lease runs on


def test_a_hung_member_is_found_at_its_lease_not_before(rdzv, clock):
    ids, sinks = elastic_world(rdzv)
    start = clock.now
    for _ in range(4):  # the others renew every TTL/3; ids[2] is paused: its connection stays open
        clock.now += TTL / 3
        for m in ids[:2]:
            rdzv.renew("job", m, 1)
        actions, _ = rdzv.expire_due()
        if actions:
            break
    assert clock.now - start > TTL  # its last renewal (the session's opening) + TTL
    assert [n.fields for n in actions.notes if n.event == "removed"] == [{"job": "job", "member": ids[2], "why": "expired"}]


def test_once_renewed_a_member_is_bound_by_its_lease_not_its_stretched_first_one(rdzv, clock, monkeypatch):
    monkeypatch.setattr(Lessor, "SESSION_OPEN_S", 5.0)  # 3 workers: a first lease TTL + 15 s, as 15,000 would have
    spec = JobSpec.build(3)
    ids = [join(rdzv, params(spec, f"n{i}"))[0] for i in range(3)]
    formed = clock.now
    assert rdzv.next_deadline() == formed + TTL + 15
    heap = rdzv.lessor
    before = len(heap)
    clock.now += 1
    for m in ids:  # the sessions open and renew: each leaves its first lease with one push
        rdzv.renew("job", m, 1)
    assert len(heap) == before + 3
    for _ in range(3):
        rdzv.renew("job", ids[0], 1)  # further renewals push nothing
    assert len(heap) == before + 3
    paused_at = clock.now  # ids[1] pauses now; the others keep renewing
    while not (actions := rdzv.expire_due()[0]):
        clock.now += 0.05
        if round((clock.now - paused_at) / 0.05) % 60 == 0:
            rdzv.renew("job", ids[0], 1)
            rdzv.renew("job", ids[2], 1)
    assert paused_at + TTL <= clock.now <= paused_at + TTL + 0.06  # found at its lease, not at formed + TTL + 15
    assert [n.fields["member"] for n in actions.notes if n.event == "removed"] == [ids[1]]


def test_a_flapping_member_costs_constant_heap_and_never_re_forms_the_world(rdzv, clock):
    ids, sinks = elastic_world(rdzv)
    heap = rdzv.lessor
    sink = sinks[ids[0]]
    for i in range(1000):
        rdzv.close_session("job", ids[0], sink, departed=True)
        clock.now += 0.001
        sink = Sink(f"again{i}")
        _, _, actions = rdzv.open_session("job", ids[0], 1, sink)
        assert not actions.pushes and not actions.wakes
        if i % 100 == 0:
            clock.now += 0.3
            assert not rdzv.expire_due()[0]
    # At most one entry per grace that came due within a lease: bounded, whatever the flap rate
    assert len(heap) <= len(ids) + TTL / GRACE + 1
    assert rdzv.describe("job").generation == 1 and rdzv.describe("job").state is JobState.FORMED


def test_a_member_not_yet_placed_is_bound_to_its_join_not_a_session(rdzv, clock):
    spec = JobSpec.build(2)
    a, _ = join(rdzv, params(spec))
    assert not rdzv.close_session("job", a, None, departed=True)  # no session: nothing to detach
    clock.now += 3600
    assert rdzv.next_deadline() is None and rdzv.describe("job").joined == 1


def test_an_expiry_storm_is_served_in_slices(rdzv, clock):
    spec = JobSpec.build(50)
    for i in range(50):
        join(rdzv, params(spec, f"n{i}"))
    clock.now += TTL + 1
    actions, more = rdzv.expire_due(limit=20)
    assert sum(1 for w in actions.writes if isinstance(w, DeleteMember)) == 20 and more
    rdzv.expire_due(limit=20)
    actions, more = rdzv.expire_due(limit=20)
    assert not more and rdzv.job_ids(ended=True) == ["job"]  # failed: kept to say why


def test_keepalive_with_another_generation_is_stale(rdzv):
    (m, _) = join(rdzv, params(JobSpec.build(1)))
    with pytest.raises(Stale, match="holds generation 2 but the current generation is 1"):
        rdzv.keep_alive("job", m, 2)
    assert rdzv.keep_alive("job", m, 0)[:2] == (TTL, 1)  # 0: "I hold no assignment yet"


def test_a_waiting_member_that_leaves_wakes_its_own_waiter(rdzv):
    a, _ = join(rdzv, params(JobSpec.build(2)))
    actions = rdzv.leave("job", a)
    assert ("job", MemberGone(a)) in actions.wakes


# -- re-forming ------------------------------------------------------------------------------


def test_a_late_joiner_grows_the_world_and_survivors_get_one_message(rdzv, clock):
    spec = elastic(3, 2, last_call_ms=0)
    a, _ = join(rdzv, params(spec, "n0"))
    b, _ = join(rdzv, params(spec, "n1"))
    sinks = sessions(rdzv, [a, b])
    c, actions = join(rdzv, params(spec, "n0"))
    (world,) = worlds(actions)
    assert world.generation == 2 and ranks(rdzv) == {a: 0, c: 1, b: 2}  # n0 (a, c), then n1 (b): b keeps node rank 1
    assert pushed(actions, sinks[a]) == [world] and pushed(actions, sinks[b]) == [world]  # no Reforming first
    pa, pb_ = world.seat_of(a), world.seat_of(b)
    assert (pa.previous_rank, pb_.previous_rank, pb_.seat.rank) == (0, 1, 2)
    assert "1 worker waiting to join can grow the world" in pa.reason
    assert set(pa.changed_groups) == {"GLOBAL", "INTRA_NODE", "INTER_NODE"}  # INTER [0, 1] became [0, 2]
    assert world.plan.master_port == 40001  # a's spare, offered when its session opened
    assert world.seat_of(c).previous_rank is None


def test_survivors_keep_their_node_and_local_ranks(rdzv, clock):
    spec = elastic(4, 3, last_call_ms=60_000)
    ids = [join(rdzv, params(spec, n))[0] for n in ("a", "a", "b", "b")]
    assert [ranks(rdzv)[m] for m in ids] == [0, 1, 2, 3]
    sinks = sessions(rdzv, ids)
    clock.now += 9
    for m in (ids[0], ids[2], ids[3]):
        rdzv.renew("job", m, 1)
    clock.now += 2  # ids[1] (node a, rank 1) has not renewed for 11 s; the others for 2 s
    actions, _ = rdzv.expire_due()
    (world,) = [e for e in pushed(actions, sinks[ids[0]])]
    assert isinstance(world, NewWorld)
    assert f"member {ids[1]} (node 'a', rank 1) expired" in world.reason
    assert pushed(actions, sinks[ids[1]]) == [Gone(f"member {ids[1]} expired")]
    assert {m: ranks(rdzv)[m] for m in (ids[0], ids[2], ids[3])} == {ids[0]: 0, ids[2]: 1, ids[3]: 2}
    placed = [world.seat_of(m).seat for m in (ids[0], ids[2], ids[3])]
    assert [(p.node_rank, p.local_rank) for p in placed] == [(0, 0), (1, 0), (1, 1)]


def test_only_groups_that_changed_are_marked(rdzv):
    spec = elastic(4, 3, last_call_ms=5000)
    ids = [join(rdzv, params(spec, n))[0] for n in ("a", "a", "b", "b")]
    sessions(rdzv, ids)
    (world,) = worlds(rdzv.leave("job", ids[3]))  # rank 3: node b, local rank 1; survivors alone: no last call
    assert [world.seat_of(m).seat.rank for m in ids[:3]] == [0, 1, 2]  # nobody moves
    assert set(world.seat_of(ids[0]).changed_groups) == {"GLOBAL"}  # INTRA [0, 1] and INTER [0, 2] stand
    assert set(world.seat_of(ids[1]).changed_groups) == {"GLOBAL", "INTER_NODE"}  # INTER [1, 3] became [1]
    assert set(world.seat_of(ids[2]).changed_groups) == {"GLOBAL", "INTRA_NODE"}


def test_a_dead_hosts_other_workers_are_awaited_not_seated(rdzv, clock):
    """A host's workers die together; their leases run out one by one. The
    first expiry finds the others stale (not renewed for over half a TTL), so
    the next world waits for them to renew or expire instead of seating them."""
    spec = elastic(4, 2, last_call_ms=60_000)
    ids = [join(rdzv, params(spec, n))[0] for n in ("a", "a", "b", "b")]
    sinks = sessions(rdzv, ids)  # everyone renews at t=0
    clock.now += 3
    rdzv.renew("job", ids[3], 1)  # b1 renews at t=3, then host b dies

    def a_renews_until(t: float) -> None:
        while clock.now + TTL / 3 <= 1000 + t:  # a's workers renew every TTL/3
            clock.now += TTL / 3
            for m in ids[:2]:
                rdzv.renew("job", m, 1)

    a_renews_until(10.01)
    clock.now = 1000 + 10.01
    actions, _ = rdzv.expire_due()  # b0 runs out; b1 (renewed 7 s ago) is stale: awaited, not seated
    assert DeleteMember("job", ids[2]) in actions.writes and not worlds(actions)
    (change,) = pushed(actions, sinks[ids[0]])
    assert isinstance(change, Reforming) and "expired" in change.reason
    view = rdzv.describe("job")
    assert (view.state, view.not_ready) == (JobState.FORMING, 1)
    a_renews_until(13.01)
    clock.now = 1000 + 13.01
    actions, _ = rdzv.expire_due()  # b1 runs out
    (world,) = pushed(actions, sinks[ids[0]])
    assert isinstance(world, NewWorld) and set(world.plan.ranks) == {ids[0], ids[1]}


def test_a_survivor_that_renews_is_no_longer_awaited(rdzv, clock):
    spec = elastic(3, 2, last_call_ms=60_000)
    ids = [join(rdzv, params(spec, n))[0] for n in ("a", "b", "c")]
    sessions(rdzv, ids)
    clock.now += TTL * 0.6  # nobody renewed for 0.6 TTL: everyone is stale
    actions = rdzv.leave("job", ids[2])
    assert not worlds(actions) and rdzv.describe("job").not_ready == 2
    _, actions = rdzv.renew("job", ids[0], 1)
    assert not worlds(actions)
    _, actions = rdzv.renew("job", ids[1], 1)
    (world,) = worlds(actions)
    assert world.generation == 2 and set(world.plan.ranks) == set(ids[:2])


def test_rank_0s_spare_is_given_once(rdzv):
    spec = elastic(3, 1, last_call_ms=0)
    a, actions = join(rdzv, params(spec, "n0", port=1111))
    assert worlds(actions)[0].plan.master_port == 1111
    sink = Sink("a")
    # Its session opens offering the port its Join offered, which now serves the store
    # (the client offers its new spare a moment later): not a spare.
    rdzv.open_session("job", a, 1, sink, spare_port=1111)
    _, actions = join(rdzv, params(spec, "n1", port=2222))
    assert not worlds(actions)  # rank 0 would be a again, whose port serves the old store
    assert pushed(actions, sink) == [Reforming(1, "1 worker waiting to join can grow the world")]
    _, actions = rdzv.renew("job", a, 1, spare_port=1111)  # a renewal sent before the new spare was offered
    assert not worlds(actions)
    _, actions = rdzv.renew("job", a, 0, spare_port=3333)  # an old generation's message: its port does not count
    assert not worlds(actions)
    _, actions = rdzv.renew("job", a, 1, spare_port=3333)
    assert worlds(actions)[0].plan.master_port == 3333


def test_below_the_minimum_survivors_are_told_the_job_cannot_continue(rdzv, clock):
    spec = JobSpec.build(2)
    a, _ = join(rdzv, params(spec))
    join(rdzv, params(spec))
    sink = sessions(rdzv, [a])[a]
    clock.now += 11
    rdzv.renew("job", a, 1)
    actions, _ = rdzv.expire_due()
    (gone,) = pushed(actions, sink)
    assert isinstance(gone, Gone) and "cannot continue" in gone.reason and "fewer than the minimum of 2" in gone.reason
    assert not gone.ended  # a failure
    assert rdzv.describe("job").state is JobState.FAILED
    with pytest.raises(Conflict, match="cannot form"):
        rdzv.join(params(spec))


def test_a_survivor_renewing_by_keepalive_is_told_its_run_stopped_and_does_not_hold_the_job_id(rdzv, clock):
    """Found by benchmarks/chaos.py (seed 19): a fixed world failed when a member cut off by a partition
    expired; its survivor, renewing only by KeepAlive, was renewed for ever, and every later Join of the
    job id was refused 'cannot form'. Its KeepAlive is now told what a session is, and renews nothing."""
    spec = JobSpec.build(2)
    a, _ = join(rdzv, params(spec))
    join(rdzv, params(spec))
    clock.now += 11
    rdzv.keep_alive("job", a, 1)
    rdzv.expire_due()
    assert rdzv.describe("job").state is JobState.FAILED
    for _ in range(2):
        clock.now += TTL / 2
        with pytest.raises(Conflict, match=r"^job 'job' cannot continue: member \w+ \(node 'n', rank 1\) expired") as told:
            rdzv.keep_alive("job", a, 1)
        assert not isinstance(told.value, Closed)
        rdzv.expire_due()  # at the second: a TTL after its last renewal, so it was not renewed since
    with pytest.raises(NotFound, match="has no run under way: run 1 failed"):
        rdzv.keep_alive("job", a, 1)
    assert rdzv.describe("job").run == 1 and rdzv.describe("job").state is JobState.FAILED  # kept, as failed
    b, _ = join(rdzv, params(spec))  # the id takes its next run
    c, _ = join(rdzv, params(spec))
    assert (rdzv.describe("job").run, rdzv.describe("job").state, set(ranks(rdzv))) == (2, JobState.FORMED, {b, c})


def test_a_closed_run_tells_a_keepalive_it_was_closed(rdzv):
    spec = JobSpec.build(2)
    a, _ = join(rdzv, params(spec))
    b, _ = join(rdzv, params(spec))
    rdzv.leave("job", a, close=True)
    with pytest.raises(Closed, match=r"^job 'job' was closed: "):
        rdzv.keep_alive("job", b, 1)


def test_a_graceful_leave_ends_a_fixed_job_without_failing_it(rdzv):
    spec = JobSpec.build(2)
    a, _ = join(rdzv, params(spec))
    b, _ = join(rdzv, params(spec))
    sink = sessions(rdzv, [b])[b]
    actions = rdzv.leave("job", a)
    assert rdzv.describe("job").state is JobState.ENDED
    (gone,) = pushed(actions, sink)
    assert "finished" in gone.reason and "fewer than" not in gone.reason and gone.ended  # the client logs it at INFO
    assert [n.event for n in actions.notes] == ["removed", "ended"]
    rdzv.leave("job", b)
    ended = rdzv.describe("job")  # the run is kept, as ended, and the id is free for the next
    assert (ended.state, ended.run, ended.joined, [n.workers for n in ended.nodes]) == (JobState.ENDED, 1, 2, [2])
    _, actions = join(rdzv, params(spec))
    assert rdzv.describe("job").run == 2 and rdzv.describe("job").other_runs == (1,)


def test_a_late_session_catches_up(rdzv):
    spec = elastic(2, 1, last_call_ms=0)
    a, _ = join(rdzv, params(spec, "n0"))
    rdzv.open_session("job", a, 1, Sink("first"), spare_port=5555)
    rdzv.close_session("job", a, object())  # someone else's sink: ignored
    join(rdzv, params(spec, "n1"))  # grows while a's session is the first one
    _, missed, _ = rdzv.open_session("job", a, 1, Sink("second"))
    (world,) = missed
    assert isinstance(world, NewWorld) and world.generation == 2 and world.plan.master_port == 5555


# -- restart ---------------------------------------------------------------------------------


def commit(store: MemoryStore, epoch: int, *actions: Actions) -> None:
    for a in actions:
        store.commit(a.writes, epoch)


def test_restart_restores_worlds_and_forming_jobs(clock):
    store = MemoryStore()
    epoch = store.take_over()
    first = Rendezvous(lease_ttl_s=TTL, clock=clock)
    spec = JobSpec.build(3)
    formed = []
    for i, n in enumerate("aab"):
        m, actions = join(first, params(spec, n, job="formed", port=5000 + i))
        formed.append(m)
        commit(store, epoch, actions)
    before = ranks(first, "formed")
    forming, actions = join(first, params(JobSpec.build(2), "x", job="forming", port=6000, member_id="bb" * 8))
    commit(store, epoch, actions)

    clock.now += 8  # the server is down for a while: leases must not lapse for it
    second = Rendezvous(lease_ttl_s=TTL, clock=clock)
    restored, actions = second.restore(store.load(), grace_s=TTL)
    assert restored == 2 and not actions
    view = second.describe("formed")
    assert (view.state, view.generation, view.joined) == (JobState.FORMED, 1, 3)
    assert ranks(second, "formed") == before  # same ranks, same generation
    # the forming worker retries its Join with the same id (within the grace) ...
    joined, _, placed = second.join(params(JobSpec.build(2), "x", job="forming", port=6001, member_id=forming))
    assert joined.member_id == forming and placed is None
    clock.now += TTL - 1
    assert not second.expire_due()[0]  # members of worlds: one TTL after the restart; the re-attached one: its call
    for m in formed:
        assert second.renew("formed", m, 1)[0] == 1
    # ... and a second worker completes its world
    _, actions = join(second, params(JobSpec.build(2), "y", job="forming", port=6002))
    (world,) = worlds(actions)
    assert world.plan.master_port == 6001 and set(world.plan.ranks) == {forming, next(iter(set(world.plan.ranks) - {forming}))}


def test_a_joiner_restored_beside_a_formed_world_grows_it_when_it_re_attaches(clock):
    """Found by benchmarks/chaos.py: after failovers, a leader held an elastic world of 2, FORMED, and a
    joiner waiting in its Join, and never grew the world: only a first Join asked whether the world could
    grow, not a Join re-attaching. (Here the store holds the joiner beside the formed world, the state
    that leader was found in; how it came to be there was not recovered from the logs.)"""
    store = MemoryStore()
    epoch = store.take_over()
    first = Rendezvous(lease_ttl_s=TTL, clock=clock)
    spec = elastic(4, 2, last_call_ms=500)
    ids = []
    for i in range(2):
        member, actions = join(first, params(spec, f"n{i}", port=5000 + i))
        ids.append(member)
        commit(store, epoch, actions)
    clock.now += 1
    commit(store, epoch, first.expire_due()[0])  # the last call: a world of 2
    assert first.describe("job").state is JobState.FORMED
    joiner = params(spec, "n2", port=5002, member_id="cc" * 8)
    _, actions = join(first, joiner)
    store.commit([w for w in actions.writes if isinstance(w, PutMember)], epoch)  # only the joiner's record
    second = Rendezvous(lease_ttl_s=TTL, clock=clock)
    second.restore(store.load(), grace_s=TTL)
    assert (second.describe("job").state, second.describe("job").joined) == (JobState.FORMED, 3)
    _, actions, placed = second.join(joiner)  # it re-attaches, its call open
    assert placed is None and second.describe("job").state is JobState.FORMING
    for i, m in enumerate(ids):  # the survivors renew, offering spare ports (rank 0's served the first store)
        second.renew("job", m, 1, spare_port=6000 + i)
    clock.now += 1
    actions, _ = second.expire_due()  # the last call
    (world,) = worlds(actions)
    assert (world.generation, world.plan.world_size) == (2, 3) and "cc" * 8 in world.plan.ranks


def test_a_forming_member_that_never_comes_back_after_a_restart_expires(clock):
    store = MemoryStore()
    epoch = store.take_over()
    first = Rendezvous(lease_ttl_s=TTL, clock=clock)
    commit(store, epoch, join(first, params(JobSpec.build(2), "x", job="f"))[1])
    second = Rendezvous(lease_ttl_s=TTL, clock=clock)
    second.restore(store.load(), grace_s=TTL)
    clock.now += 11
    actions, _ = second.expire_due()
    assert DeleteJob("f") in actions.writes and second.job_ids() == []


def test_a_world_restored_while_re_forming_awaits_its_survivors(clock):
    store = MemoryStore()
    epoch = store.take_over()
    first = Rendezvous(lease_ttl_s=TTL, clock=clock)
    spec = elastic(3, 2, last_call_ms=60_000)
    ids = []
    for n in "abc":
        m, actions = join(first, params(spec, n))
        ids.append(m)
        commit(store, epoch, actions)
    clock.now += TTL * 0.6  # all stale: a leave cannot re-form at once
    commit(store, epoch, first.leave("job", ids[2]))
    assert first.describe("job").state is JobState.FORMING
    second = Rendezvous(lease_ttl_s=TTL, clock=clock)
    second.restore(store.load(), grace_s=TTL)
    sink = Sink("a")
    _, missed, actions = second.open_session("job", ids[0], 1, sink, spare_port=7777)  # rank 0 offers its spare again
    assert [type(e) for e in missed] == [Reforming] and not worlds(actions)
    _, actions = second.renew("job", ids[1], 1)
    (world,) = worlds(actions)
    assert world.generation == 2 and set(world.plan.ranks) == set(ids[:2]) and pushed(actions, sink) == [world]
    assert world.plan.master_port == 7777


def test_the_server_holds_at_most_its_limits_of_jobs_and_members(clock):
    from commctx.server.errors import LimitExceeded
    from commctx.server.rendezvous.model import Limits

    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock, limits=Limits(max_jobs=2, max_members=3))
    a, _ = join(rdzv, params(JobSpec.build(2), job="one"))
    join(rdzv, params(JobSpec.build(2), job="two"))
    with pytest.raises(LimitExceeded, match=r"maximum of 2 jobs \(--max-jobs\); job 'three' cannot be created now"):
        rdzv.join(params(JobSpec.build(1), job="three"))
    join(rdzv, params(JobSpec.build(2), "n2", job="two"))  # joining a job it holds is fine ...
    with pytest.raises(LimitExceeded, match=r"maximum of 3 members \(--max-members\)"):
        rdzv.join(params(JobSpec.build(2), "n3", job="one"))  # ... until the members run out
    rdzv.leave("one", a)  # "one" is gone with its only member: a job and a member are free again
    assert rdzv.job_ids() == ["two"]
    join(rdzv, params(JobSpec.build(1), job="three"))
    assert rdzv.stats().members == 3


def test_failed_jobs_are_kept_within_their_count_the_oldest_dropped_first(clock):
    from commctx.server.rendezvous.model import Limits

    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock, limits=Limits(retain_ended_jobs=2, retain_ended_s=60))
    for name in ("j1", "j2", "j3"):
        a, _ = join(rdzv, params(JobSpec.build(2), "n0", job=name))
        join(rdzv, params(JobSpec.build(2), "n1", job=name))
        clock.now += 1
        rdzv.keep_alive(name, a, 1)
    clock.now += TTL  # every job loses a member: fewer than the minimum, FAILED; then the other expires too
    rdzv.expire_due()
    clock.now += TTL
    rdzv.expire_due()
    assert rdzv.job_ids(ended=True) == ["j2", "j3"]  # j1, the oldest, was dropped to keep two
    assert rdzv.describe("j3").state is JobState.FAILED
    clock.now += 60
    rdzv.expire_due()
    assert rdzv.job_ids() == []


def test_failed_jobs_kept_and_the_age_of_a_job_survive_a_restart(clock):
    from commctx.server.rendezvous.model import Limits

    wall = FakeClock()
    wall.now = 1_800_000_000.0
    limits = Limits(retain_ended_jobs=2, retain_ended_s=60)
    store = MemoryStore()
    epoch = store.take_over()
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock, wall=wall, limits=limits)

    def tick(s: float) -> None:
        clock.now += s
        wall.now += s

    def persist(actions: Actions) -> Actions:
        store.commit(actions.writes, epoch)
        return actions

    persist(rdzv.join(params(JobSpec.build(2), "n9", job="forming"))[1])
    for name in ("j1", "j2", "j3"):
        a, actions = join(rdzv, params(JobSpec.build(2), "n0", job=name))
        persist(actions)
        persist(join(rdzv, params(JobSpec.build(2), "n1", job=name))[1])
        tick(1)
        persist(rdzv.keep_alive(name, a, 1)[2])
    tick(TTL)
    writes = persist(rdzv.expire_due()[0]).writes
    tick(TTL)
    writes += persist(rdzv.expire_due()[0]).writes
    assert DeleteJob("j1#1") in writes  # the oldest, dropped from the store too (its key: job id and run)
    tick(20)
    later = FakeClock()  # a restart: the monotonic clock starts anew
    again = Rendezvous(lease_ttl_s=TTL, clock=later, wall=wall, limits=limits)
    again.restore(store.load(), grace_s=5)
    assert again.job_ids(ended=True) == ["forming", "j2", "j3"]
    view = again.describe("j3")
    assert view.state is JobState.FAILED and "fewer than the minimum of 2" in view.reason
    assert again.describe("forming").forming_for_s == pytest.approx(3 + 2 * TTL + 20)  # AGE goes on
    later.now += 60 - TTL - 20 - 1  # their workers were gone TTL + 20 s before the restart; 60 s are kept
    again.expire_due()
    assert again.job_ids(ended=True) == ["j2", "j3"]  # (the forming job's worker did not re-attach within the grace)
    later.now += 2
    actions, _ = again.expire_due()
    assert again.job_ids(ended=True) == [] and {DeleteJob("j2#1"), DeleteJob("j3#1")} <= set(actions.writes)


def test_a_formed_jobs_age_counts_from_its_world_across_a_restart(clock):
    wall = FakeClock()
    wall.now = 1_800_000_000.0
    store = MemoryStore()
    epoch = store.take_over()
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock, wall=wall)
    store.commit(rdzv.join(params(JobSpec.build(2), "n0", job="j"))[1].writes, epoch)
    clock.now += 5  # forming takes 5 s
    wall.now += 5
    store.commit(rdzv.join(params(JobSpec.build(2), "n1", job="j"))[1].writes, epoch)
    clock.now += 2
    wall.now += 2
    assert rdzv.describe("j").state is JobState.FORMED and rdzv.describe("j").forming_for_s == pytest.approx(2)
    again = Rendezvous(lease_ttl_s=TTL, clock=FakeClock(), wall=wall)  # a restart: a new monotonic clock
    again.restore(store.load(), grace_s=5)
    assert again.describe("j").forming_for_s == pytest.approx(2)  # AGE from the world's forming, as before


# -- node memberships (a launcher's agent joins its node's workers in one call) ----------


def node(spec: JobSpec, key: str, workers: int, **kw) -> JoinParams:
    return JoinParams.build(job_id="job", spec=spec, node_key=key, address="10.0.0.1", port=30000, workers=workers, **kw)


def test_a_node_membership_is_seated_whole_as_local_ranks_0_to_n(rdzv):
    spec = JobSpec.from_json({"world_size": 6, "layout": {"tp": 3, "within_node": ["tp"]}})
    b, _ = join(rdzv, node(spec, "node-b", 3))
    assert rdzv.describe("job").joined == 3 and rdzv.describe("job").nodes[0].workers == 3
    a, actions = join(rdzv, node(spec, "node-a", 3))
    (world,) = worlds(actions)
    # nodes in key order; each node membership's workers are its node's local ranks 0..2
    assert [world.seat_of(m).seat[1:] for m in (a, f"{a}/1", f"{a}/2", b, f"{b}/1", f"{b}/2")] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2)]
    groups = {g.mode: list(g.ranks[0].ranks()) for g in world.plan.groups_of(world.seat_of(f"{b}/2").seat)}
    assert groups == {"GLOBAL": [0, 1, 2, 3, 4, 5], "INTRA_NODE": [3, 4, 5], "INTER_NODE": [2, 5],
                      "TENSOR_PARALLEL": [3, 4, 5], "DATA_PARALLEL": [2, 5], "SEQUENCE_PARALLEL": [5], "EXPERT": [5],
                      "PIPELINE_PARALLEL": [5]}
    assert sorted(world.plan.ranks) == sorted([a, f"{a}/1", f"{a}/2", b, f"{b}/1", f"{b}/2"])


def test_a_node_membership_takes_its_node_alone_and_counts_its_workers(rdzv):
    spec = JobSpec.from_json({"world_size": 5, "roles": [{"role": "t", "count": 2}, {"role": "r", "count": 3}]})
    join(rdzv, node(spec, "a", 2, role="t"))
    with pytest.raises(AlreadyExists, match="node 'a' of job 'job' is already joined as a whole node by its launcher"):
        rdzv.join(params(spec, "a", role="r"))
    with pytest.raises(Full, match="already has all 2 workers of role 't'"):
        rdzv.join(node(spec, "b", 2, role="t"))
    join(rdzv, params(spec, "b", role="r"))
    with pytest.raises(AlreadyExists, match="node 'b' of job 'job' is already joined; a node membership"):
        rdzv.join(node(spec, "b", 2, role="r"))
    join(rdzv, params(spec, "c", role="r"))
    with pytest.raises(Full, match="has 4 of 5 workers; node 'd' cannot add 2 more"):
        rdzv.join(node(spec, "d", 2, role="r"))
    assert (rdzv.stats().members, rdzv.stats().waiting) == (4, 4)  # the metrics count workers, both of them


def test_node_membership_parameters_are_checked():
    spec = JobSpec.build(4)
    with pytest.raises(BadRequest, match=r"workers 5 is out of range 1..4 \(world_size 4; "):
        node(spec, "a", 5)
    with pytest.raises(BadRequest, match="workers 1025 is out of range 1..1024 .* holds at most 1024"):
        node(JobSpec.build(1 << 20), "a", 1025)  # one Join's answer carries each worker's assignment
    with pytest.raises(BadRequest, match="local_rank 1 cannot be given with workers 2"):
        node(spec, "a", 2, local_rank=1)


def test_an_elastic_job_of_node_memberships_loses_and_gains_whole_nodes(rdzv, clock):
    spec = elastic(6, 2, last_call_ms=0)  # torchrun --nnodes=1:3 --nproc-per-node=2
    a, actions = join(rdzv, node(spec, "a", 2))
    assert worlds(actions)[0].plan.world_size == 2  # one node is the minimum
    sink = Sink("a")
    rdzv.open_session("job", a, 1, sink, spare_port=30002)
    b, actions = join(rdzv, node(spec, "b", 2))
    (event,) = pushed(actions, sink)
    assert isinstance(event, NewWorld) and event.plan.world_size == 4 and event.generation == 2
    rdzv.open_session("job", b, 2, Sink("b"))
    clock.now += TTL * 0.6
    rdzv.renew("job", a, 2, spare_port=30003)  # rank 0 offers a spare for the next world's store
    clock.now += TTL * 0.45  # b's one lease covers both its workers: it expires, whole
    actions, _ = rdzv.expire_due()
    (event,) = pushed(actions, sink)
    assert isinstance(event, NewWorld) and event.plan.world_size == 2 and event.generation == 3
    assert event.seat_of(f"{a}/1").seat[1:] == (1, 0, 1)
    assert rdzv.describe("job").joined == 2
    rdzv.renew("job", a, 3, spare_port=30004)
    c, actions = join(rdzv, node(spec, "c", 2))  # a newcomer grows the world by its whole node
    (event,) = pushed(actions, sink)
    assert event.plan.world_size == 4 and [n.node_key for n in event.plan.nodes] == ["a", "c"]


def test_node_memberships_form_whole_even_when_the_maximum_would_split_one(rdzv):
    spec = elastic(9, 3, last_call_ms=0, layout={"tp": 3})  # worlds of 3, 6 or 9; nodes of 2 workers
    join(rdzv, node(spec, "a", 2))
    _, actions = join(rdzv, node(spec, "b", 2))  # 4 present: a world of 3 would split b
    assert not worlds(actions) and rdzv.describe("job").state is JobState.FORMING
    _, actions = join(rdzv, node(spec, "c", 2))
    assert worlds(actions)[0].plan.world_size == 6
    _, actions = join(rdzv, node(spec, "d", 2))  # 8 present: 6 is still the largest whole world
    assert not actions.pushes and not worlds(actions)
    view = rdzv.describe("job")
    assert (view.state, view.generation, view.waiting) == (JobState.FORMED, 1, 2)


def test_a_node_membership_survives_a_restart(rdzv, clock):
    store = MemoryStore()
    epoch = store.take_over()
    spec = JobSpec.build(4)
    a, actions = join(rdzv, node(spec, "a", 2))
    store.commit(actions.writes, epoch)
    b, actions = join(rdzv, node(spec, "b", 2))
    store.commit(actions.writes, epoch)
    again = Rendezvous(lease_ttl_s=TTL, clock=clock)
    assert again.restore(store.load(), grace_s=5)[0] == 1
    world = again.world_of("job")
    assert world.seat_of(f"{b}/1").seat[1:] == (3, 1, 1)
    assert again.describe("job").joined == 4
    again.leave("job", b)
    assert again.describe("job").joined == 2


def test_a_launcher_restarting_its_workers_re_forms_the_world_once(rdzv, clock):
    spec = JobSpec.build(4)
    a, _ = join(rdzv, node(spec, "a", 2))
    b, _ = join(rdzv, node(spec, "b", 2))
    sink_a, sink_b = Sink("a"), Sink("b")
    rdzv.open_session("job", a, 1, sink_a, spare_port=30002)
    rdzv.open_session("job", b, 1, sink_b)
    actions = rdzv.restart("job", b, 1)  # b's worker failed; its agent restarts
    # a may be dead (a failed peer is the usual cause): it is awaited until it renews
    assert pushed(actions, sink_a) == [Reforming(1, "node 'b' restarts its workers")]
    _, actions = rdzv.renew("job", a, 1)
    (event,) = pushed(actions, sink_a)
    assert isinstance(event, NewWorld) and event.generation == 2 and event.reason == "node 'b' restarts its workers"
    assert event.seat_of(f"{b}/1").seat[1:] == (3, 1, 1)  # same seats, a fresh world
    assert not rdzv.restart("job", a, 1)  # a asks for generation 1 too, late: nothing more
    assert rdzv.describe("job").generation == 2


def test_a_restart_leaves_out_a_node_that_does_not_renew(rdzv, clock):
    spec = elastic(4, 2, last_call_ms=0)
    a, _ = join(rdzv, node(spec, "a", 2))  # one node is the minimum: generation 1
    sink_a = Sink("a")
    rdzv.open_session("job", a, 1, sink_a, spare_port=30002)
    b, _ = join(rdzv, node(spec, "b", 2))  # generation 2
    rdzv.open_session("job", b, 2, Sink("b"))
    rdzv.renew("job", a, 2, spare_port=30003)
    rdzv.restart("job", a, 2)  # b's node just died; its lease looks fresh
    assert rdzv.describe("job").state is JobState.FORMING
    clock.now += TTL + 0.1
    rdzv.renew("job", a, 2)
    actions, _ = rdzv.expire_due()
    (event,) = pushed(actions, sink_a)
    assert isinstance(event, NewWorld) and event.generation == 3 and event.plan.world_size == 2


def test_describe_pages_the_world_then_the_waiting_nodes(rdzv):
    spec = elastic(9, 3, last_call_ms=0, layout={"tp": 3})  # nodes of 2 workers: 6 form, the fourth node waits
    for key in ("c", "a", "d", "b"):
        join(rdzv, node(spec, key, 2))
    assert rdzv.describe("job").state is JobState.FORMED
    pages = [[(n.node_key, n.node_rank) for n in rdzv.describe("job", first_node=i, max_nodes=2).nodes] for i in (0, 2, 4)]
    assert pages == [[("a", 0), ("c", 1)], [("d", 2), ("b", None)], []]
    assert [n.node_key for n in rdzv.describe("job", first_node=3, max_nodes=5).nodes] == ["b"]
    assert [n.node_key for n in rdzv.describe("job").nodes] == ["a", "c", "d", "b"]


# -- a job's history ----------------------------------------------------------------------------


def kinds(rdzv: Rendezvous, job: str = "job") -> list[str]:
    return [e.kind for e in rdzv.events(job)]


def test_a_jobs_life_is_in_its_events(rdzv, clock):
    ids, sinks = elastic_world(rdzv)
    assert kinds(rdzv) == ["joined", "formed"]  # three joins within a second: one event, counted
    joined, formed = rdzv.events("job")
    assert joined.fields["workers"] == 3 and "3 workers joined" in joined.message and "3 of 3 workers" in joined.message
    assert (formed.generation, formed.fields["world_size"], formed.fields["nodes"]) == (1, 3, 3)
    rdzv.close_session("job", ids[2], sinks[ids[2]], departed=True)
    clock.now += GRACE
    rdzv.expire_due()
    lost, reforming, formed2 = rdzv.events("job")[2:]
    assert (lost.kind, lost.fields["member"], lost.fields["rank"], lost.fields["why"]) == ("lost", ids[2], 2, "disconnected")
    assert lost.message == f"member {ids[2]} (node 'n2', rank 2) disconnected: session closed without leave"
    assert (reforming.kind, reforming.generation) == ("reforming", 1) and lost.message in reforming.message
    assert (formed2.kind, formed2.generation) == ("formed", 2) and "disconnected" in formed2.message
    rdzv.leave("job", ids[1])
    assert kinds(rdzv)[5:] == ["left", "reforming"]  # rank 0 has not offered a new spare yet: awaited
    assert [e.seq for e in rdzv.events("job")] == list(range(1, len(rdzv.events("job")) + 1))
    assert rdzv.events("job", after=4) == rdzv.events("job")[4:] and len(rdzv.events("job", after=1, limit=2)) == 2


def test_a_refusal_is_recorded_and_a_storm_of_it_counted(rdzv, clock):
    spec = JobSpec.build(3)
    join(rdzv, params(spec))
    for _ in range(500):
        with pytest.raises(Conflict):
            rdzv.join(params(JobSpec.build(4), "other"))
    actions = rdzv.take_outbox()
    assert actions.writes == [] and len(actions.events) == 1  # published, not stored: a sample apart (test_trust.py)
    refused = rdzv.events("job")[-1]
    assert refused.kind == "refused" and "world_size=3 but this worker asked for world_size=4" in refused.message
    view = rdzv.describe("job")
    assert view.refused == 500 and "world_size=4" in view.last_refused
    clock.now += 10  # the same reason again after the quiet time: one more event, saying how many it stood for
    with pytest.raises(Conflict):
        rdzv.join(params(JobSpec.build(4), "other"))
    assert "(499 more like it since the last)" in rdzv.events("job")[-1].message
    assert kinds(rdzv) == ["joined", "refused", "refused"] and len(rdzv.take_outbox().events) == 1


def test_the_history_keeps_its_last_events_and_survives_a_restart(clock):
    store = MemoryStore()
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock, wall=clock, limits=Limits(max_events_per_job=5))
    spec = JobSpec.build(100)
    epoch = store.take_over()
    for i in range(12):
        _, actions = join(rdzv, params(spec, f"n{i}"))
        store.commit(actions.writes, epoch)
        clock.now += 1  # joins a second apart: separate events
    assert [e.seq for e in rdzv.events("job")] == [8, 9, 10, 11, 12]
    restored = Rendezvous(lease_ttl_s=TTL, clock=clock, wall=clock, limits=Limits(max_events_per_job=5))
    restored.restore(store.load(), grace_s=TTL)
    assert restored.events("job") == rdzv.events("job")
    assert len(store.load()[0].events) <= 5 + 64  # the store forgets the dropped ones now and then


# -- jobs of nodes (torchrun): nodes of any size, standbys, closing the run --------------------


def node_params(spec: JobSpec, node: str, workers: int, **kw) -> JoinParams:
    return JoinParams.build(job_id="run", spec=spec, node_key=node, address="10.0.0.1", port=30000 + len(node) + workers,
                            workers=workers, **kw)


def node_spec(low: int, high: int, last_call_ms: int = 30_000) -> JobSpec:
    return JobSpec.from_json({"nodes": {"min": low, "max": high, "last_call_ms": last_call_ms}})


def test_a_job_of_nodes_of_different_sizes_forms_with_torchruns_ranks(rdzv):
    spec = node_spec(2, 2)
    a, _ = join(rdzv, node_params(spec, "a", 1))
    assert "1 of 2 nodes (1 workers)" in rdzv.describe("run").reason
    b, actions = join(rdzv, node_params(spec, "b", 2))
    (world,) = worlds(actions)
    assert (world.plan.world_size, world.plan.num_nodes) == (3, 2)
    seats = {w: (p.rank, p.node_rank, p.local_rank) for w in (a, b, f"{b}/1") for p in [world.plan.seat_of(w)]}
    assert seats == {a: (0, 0, 0), b: (1, 1, 0), f"{b}/1": (2, 1, 1)}  # a node's ranks: its base + its local rank


def test_a_node_beyond_the_maximum_waits_as_a_standby_and_replaces_a_lost_node(rdzv, clock):
    spec = node_spec(2, 2)
    a, _ = join(rdzv, node_params(spec, "a", 2))
    b, _ = join(rdzv, node_params(spec, "b", 2))
    sinks = sessions(rdzv, [a, b], job="run")
    c, actions = join(rdzv, node_params(spec, "c", 2))  # at the maximum: a standby, not refused, nothing announced
    assert not actions.pushes and rdzv.describe("run").generation == 1 and rdzv.describe("run").joined == 6
    clock.now += TTL / 2
    rdzv.renew("run", a, 1)
    rdzv.close_session("run", b, sinks[b], departed=True)  # b's agent is killed
    clock.now += 1.0
    actions, _ = rdzv.expire_due()
    (world,) = worlds(actions)  # the survivor and the standby: the world stays whole, it does not fail
    assert world.generation == 2 and sorted(n.node_key for n in world.plan.nodes) == ["a", "c"]
    for n in "defg":  # the server's own joins (an admin's) are capped only by the job: twice as many standbys as seats
        join(rdzv, node_params(spec, n, 1))
    with pytest.raises(Full, match="all 2 nodes and twice as many standbys"):
        rdzv.join(node_params(spec, "h", 1))  # (callers' own caps: test_trust.py)


def test_a_job_of_nodes_below_its_minimum_waits_for_a_replacement_instead_of_failing(rdzv, clock):
    spec = node_spec(2, 2)  # torchrun --nnodes=2:2: c10d's survivors wait for a replacement until join_timeout
    a, _ = join(rdzv, node_params(spec, "a", 1))
    b, _ = join(rdzv, node_params(spec, "b", 1))
    sinks = sessions(rdzv, [a, b], job="run")
    rdzv.close_session("run", b, sinks[b], departed=True)  # b's agent is SIGKILLed
    clock.now += 1.0
    actions, _ = rdzv.expire_due()
    (change,) = pushed(actions, sinks[a])
    assert isinstance(change, Reforming) and "waiting for 1 more to reach the minimum of 2" in change.reason
    view = rdzv.describe("run")
    assert (view.state, view.generation) == (JobState.FORMING, 1)
    clock.now += 3 * TTL  # the survivor renews; no deadline of the server's fails the job
    rdzv.renew("run", a, 1)
    assert rdzv.describe("run").state is JobState.FORMING
    c, actions = join(rdzv, node_params(spec, "c", 1))  # the replacement, started by its orchestrator
    (world,) = worlds(actions)
    assert world.generation == 2 and sorted(n.node_key for n in world.plan.nodes) == ["a", "c"]
    assert world.plan.seat_of(a).rank == 0  # the survivor keeps rank 0
    rdzv.leave("run", c)
    assert rdzv.describe("run").state is JobState.ENDED  # a node that leaves (its agent finished) still ends the run

def test_an_elastic_job_of_nodes_forms_at_its_minimum_after_the_last_call_and_grows(rdzv, clock):
    spec = node_spec(1, 3, last_call_ms=30_000)
    a, _ = join(rdzv, node_params(spec, "a", 1))
    clock.now += 29
    assert not rdzv.expire_due()[0].wakes
    clock.now += 1.0
    (world,) = worlds(rdzv.expire_due()[0])
    assert world.plan.world_size == 1
    sink = sessions(rdzv, [a], job="run")[a]
    _, actions = join(rdzv, node_params(spec, "b", 4))  # below the maximum: it grows the world
    assert [type(e).__name__ for e in pushed(actions, sink)] == ["Reforming"]
    for _ in range(10):  # a keeps renewing through the last call
        clock.now += 3
        rdzv.renew("run", a, 1)
    world = worlds(rdzv.expire_due()[0])[0]
    assert (world.plan.world_size, world.generation) == (5, 2)


def test_closing_a_job_tells_everyone_refuses_its_late_joiners_and_its_id_then_takes_a_new_run(clock):
    store = MemoryStore()
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock, wall=clock)
    spec = node_spec(2, 2)
    a, _ = join(rdzv, node_params(spec, "a", 1))
    b, _ = join(rdzv, node_params(spec, "b", 1))
    sinks = sessions(rdzv, [a, b], job="run")
    waiting_standby, _ = join(rdzv, node_params(spec, "c", 1))
    actions = rdzv.leave("run", a, close=True)  # a's launcher shuts the run down
    (gone,) = pushed(actions, sinks[b])
    assert isinstance(gone, Gone) and gone.closed and gone.ended and "node 'a' closed it" in gone.reason
    (stopped,) = [o for _, o in actions.wakes if isinstance(o, JobStopped)]
    assert stopped.closed  # the standby's wait ends: closed
    assert rdzv.describe("run").state is JobState.CLOSED
    with pytest.raises(Closed, match="was closed: .*; its id takes a new run once its 2 members are gone"):
        rdzv.join(node_params(spec, "d", 1))  # a late joiner of the closed run (torch: RendezvousClosedError)
    store.commit([*actions.writes, *rdzv.leave("run", b).writes, *rdzv.withdraw("run", waiting_standby).writes], store.take_over())
    kept = rdzv.describe("run")  # kept after its last member left, with who took part
    assert (kept.state, kept.run, [n.node_key for n in kept.nodes]) == (JobState.CLOSED, 1, ["a", "b"])
    again = Rendezvous(lease_ttl_s=TTL, clock=clock, wall=clock)
    again.restore(store.load(), grace_s=TTL)  # and across a restart
    assert (again.describe("run").state, again.describe("run").run) == (JobState.CLOSED, 1)
    for machine in (rdzv, again):  # the id takes a new run, as c10d's does
        join(machine, node_params(spec, "d", 1))
        assert (machine.describe("run").run, machine.describe("run").state, machine.describe("run", run=1).state) == (
            2, JobState.FORMING, JobState.CLOSED)


def world_of_given_ids(rdzv: Rendezvous) -> list[str]:
    """A formed elastic world of 4 (min 1) whose members chose their ids (as clients that retry do), sessions open."""
    ids = [join(rdzv, params(elastic(4, 1), f"n{i}", member_id=f"{i + 1:016x}"))[0] for i in range(4)]
    sessions(rdzv, ids)
    return ids


def test_a_seated_member_re_attaching_while_its_world_re_forms_is_answered_that_world(rdzv, clock):
    """A member seated in a world that is re-forming re-attaches with its Join (its first answer was
    lost to a failover, say). It is answered the world it sits in at once, as its peers were; its Join
    is its word, so its lease runs a TTL from it, held by nothing after; its session then hears the
    re-form, and the next world seats it."""
    ids = world_of_given_ids(rdzv)
    (second,) = worlds(rdzv.leave("job", ids[3]))  # rank 0's spare serves generation 2's store
    for m in ids[:3]:
        rdzv.renew("job", m, 2)
    rdzv.leave("job", ids[2])  # generation 3 waits for rank 0 to offer a new spare
    assert rdzv.describe("job").state is JobState.FORMING
    clock.now += TTL * 0.9
    rdzv.renew("job", ids[0], 2)
    joined, actions, placed = rdzv.join(params(elastic(4, 1), "n1", member_id=ids[1]))  # a retried Join
    assert joined.member_id == ids[1] and not worlds(actions)
    assert (placed.generation, placed.plan.master_port, placed.seat_of(ids[1]).seat.rank) == (2, second.plan.master_port, 1)
    clock.now += TTL * 0.9  # a TTL after its last renewal, within one of its Join
    rdzv.renew("job", ids[0], 2)
    assert not rdzv.expire_due()[0].notes
    _, missed, _ = rdzv.open_session("job", ids[1], 2, Sink("again"), spare_port=30000)
    assert [(type(e), e.generation) for e in missed] == [(Reforming, 2)]
    _, actions = rdzv.renew("job", ids[0], 2, spare_port=40200)
    (third,) = worlds(actions)
    assert (third.generation, set(third.plan.ranks), third.plan.master_port) == (3, {ids[0], ids[1]}, 40200)


def test_a_seated_members_answered_join_holds_its_lease_for_one_ttl_only(rdzv, clock):
    """Nothing holds a seated member whose re-attaching Join was answered: silent after it, it is gone
    one TTL later, as anyone is."""
    ids = world_of_given_ids(rdzv)
    rdzv.leave("job", ids[3])
    rdzv.leave("job", ids[2])
    assert rdzv.describe("job").state is JobState.FORMING
    _, _, placed = rdzv.join(params(elastic(4, 1), "n1", member_id=ids[1]))
    assert placed.generation == 2
    joined_at = clock.now
    assert not rdzv.withdraw("job", ids[1]).writes  # its call ended, answered: seated, not withdrawn
    clock.now = joined_at + TTL - 0.01
    rdzv.renew("job", ids[0], 2)
    assert not rdzv.expire_due()[0].notes
    clock.now = joined_at + TTL
    actions, _ = rdzv.expire_due()
    assert [n.fields["member"] for n in actions.notes if n.event == "removed"] == [ids[1]]


def test_a_rank_0_that_never_heard_of_its_world_is_answered_it_when_its_join_returns_during_a_re_form(rdzv, clock):
    """Found by benchmarks/chaos.py (seed 13): rank 0's Join answer was lost to a partition, so it never
    heard of generation 1, and its Join, retried, came back while generation 1 re-formed. That Join
    carries the port generation 1's store took, which is no spare: the job held the Join for the next
    world, and the next world waited for rank 0's next spare, which a worker waiting in a Join never
    offers. The Join is answered the world it missed; from its session, rank 0 hears the re-form and
    offers a new spare, and the next world forms."""
    spec = elastic(3, 1)
    joins = [join(rdzv, params(spec, f"n{i}", member_id=f"{i + 1:016x}", port=30000 + i)) for i in range(3)]
    ids = [m for m, _ in joins]
    (first,) = worlds(joins[-1][1])
    zero, others = ids[0], ids[1:]
    assert (first.seat_of(zero).seat.rank, first.plan.master_port) == (0, 30000)
    for i, m in enumerate(others):  # they heard; rank 0's answer was lost
        rdzv.open_session("job", m, 1, Sink(m), spare_port=41000 + i)
    actions = rdzv.leave("job", others[1])
    assert not worlds(actions)  # rank 0's spare serves generation 1's store: the next world awaits another
    assert rdzv.describe("job").state is JobState.FORMING
    joined, actions, placed = rdzv.join(params(spec, "n0", member_id=zero, port=30000))  # its Join, retried as it was
    assert not worlds(actions)
    assert placed is not None, "rank 0's Join was held for a world that awaits its spare"
    assert (placed.generation, placed.plan.master_port, placed.seat_of(zero).seat.rank) == (1, 30000, 0)
    _, missed, _ = rdzv.open_session("job", zero, 1, Sink(zero), spare_port=30000)  # it serves the store on 30000
    assert [(type(e), e.generation) for e in missed] == [(Reforming, 1)]
    assert rdzv.describe("job").state is JobState.FORMING
    _, actions = rdzv.renew("job", zero, 1, spare_port=45556)  # its next spare
    (second,) = worlds(actions)
    assert (second.generation, second.plan.master_port, set(second.plan.ranks)) == (2, 45556, {zero, others[0]})


def test_a_member_that_died_before_a_restart_is_gone_one_ttl_after_it(clock):
    """Found by benchmarks/chaos.py: restored leases ran TTL + grace (two TTLs), so a member that died just
    before a failover held its world back for longer than a lease. Every restored lease is one TTL."""
    store = MemoryStore()
    epoch = store.take_over()
    first = Rendezvous(lease_ttl_s=TTL, clock=clock)
    spec = elastic(2, 1, last_call_ms=0)
    members = []
    for n in ("a", "b"):
        m, actions = join(first, params(spec, n, port=7000 + len(members)))
        commit(store, epoch, actions)
        members.append(m)
    alive, dead = members
    second = Rendezvous(lease_ttl_s=TTL, clock=clock)
    second.restore(store.load(), grace_s=TTL)
    clock.now += TTL - 0.01
    second.renew("job", alive, 1)
    assert not second.expire_due()[0].notes  # nobody is gone before one TTL
    clock.now += 0.02
    actions, _ = second.expire_due()
    assert [n.fields["member"] for n in actions.notes if n.event == "removed"] == [dead]


def test_survivors_restored_mid_re_form_that_re_attach_by_join_are_heard_from(clock):
    """Found by benchmarks/chaos.py: a job re-forming when its leader failed over is restored with its
    survivors awaited (not heard from since the change). Survivors whose Joins were cut by the failover
    re-attach with a Join, not a session: the Join is their word, and its port a spare, so the world
    forms at once instead of waiting for a renewal that a worker blocked in its Join never sends."""
    store = MemoryStore()
    epoch = store.take_over()
    first = Rendezvous(lease_ttl_s=TTL, clock=clock)
    spec = elastic(3, 2)
    ids = []
    for i in range(3):
        m, actions = join(first, params(spec, f"n{i}", port=7000 + i, member_id=f"{i + 1:016x}"))
        commit(store, epoch, actions)
        ids.append(m)
    clock.now += 1.0
    commit(store, epoch, first.expire_due()[0])  # the last call passes: a world of 3
    assert first.describe("job").state is JobState.FORMED
    commit(store, epoch, first.leave("job", ids[2]))  # generation 2 awaits rank 0's new spare
    assert first.describe("job").state is JobState.FORMING
    second = Rendezvous(lease_ttl_s=TTL, clock=clock)
    second.restore(store.load(), grace_s=TTL)
    assert second.describe("job").not_ready == 2  # both survivors awaited
    _, actions, _ = second.join(params(spec, "n1", port=7101, member_id=ids[1]))
    assert not worlds(actions) and second.describe("job").not_ready == 1
    _, actions, _ = second.join(params(spec, "n0", port=7100, member_id=ids[0]))  # rank 0, with a new spare
    (world,) = worlds(actions)
    assert world.generation == 2 and set(world.plan.ranks) == set(ids[:2]) and world.plan.master_port == 7100


def test_a_member_re_attaching_to_its_formed_world_is_heard_from(clock):
    """Found by benchmarks/chaos.py: a member whose Join was cut by a failover re-attached, was answered its
    world, and was removed milliseconds later: its restored lease ran out as the Join came. The Join is
    its word: its lease runs a TTL from then."""
    store = MemoryStore()
    epoch = store.take_over()
    first = Rendezvous(lease_ttl_s=TTL, clock=clock)
    spec = JobSpec.build(2)
    ids = []
    for i in range(2):
        m, actions = join(first, params(spec, f"n{i}", port=7000 + i, member_id=f"{i + 1:016x}"))
        commit(store, epoch, actions)
        ids.append(m)
    second = Rendezvous(lease_ttl_s=TTL, clock=clock)
    second.restore(store.load(), grace_s=TTL)
    clock.now += TTL * 0.95
    second.renew("job", ids[0], 1)
    _, _, placed = second.join(params(spec, "n1", port=7001, member_id=ids[1]))  # its retried Join, just in time
    assert placed is not None and placed.generation == 1
    clock.now += TTL * 0.5
    second.renew("job", ids[0], 1)
    assert not second.expire_due()[0].notes  # heard from at its Join: not gone half a TTL later


def test_a_first_lease_runs_a_ttl_from_the_join_answer(rdzv, clock):
    """Found by benchmarks/chaos.py: a leader busy after a failover answered a Join 3 s after its world
    formed; the member's first lease, counted from the forming, ran out before its first renewal could
    come. A first lease runs at least a TTL from the answer."""
    spec = JobSpec.build(2)
    a, _ = join(rdzv, params(spec, "n0"))
    b, actions = join(rdzv, params(spec, "n1"))
    assert worlds(actions)
    clock.now += TTL * 0.6  # the answer waits for the event loop
    rdzv.answered("job", b)
    clock.now += TTL * 0.5  # past the forming's TTL, within the answer's
    rdzv.renew("job", a, 1)
    assert not rdzv.expire_due()[0].notes
    clock.now += TTL * 0.6
    rdzv.renew("job", a, 1)
    actions, _ = rdzv.expire_due()
    assert [n.fields["member"] for n in actions.notes if n.event == "removed"] == [b]
