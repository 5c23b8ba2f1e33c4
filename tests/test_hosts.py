"""Host memberships: the CommContext workers of one host sharing one
membership, one lease and one session (JoinRequest.host_workers). The state
machine's transitions as data, the store's round trip, and the wire."""

from __future__ import annotations

import pytest

from commctx.common.planning import JobSpec
from commctx.server.errors import AlreadyExists, BadRequest, Conflict, Full
from commctx.server.rendezvous.machine import Rendezvous
from commctx.server.rendezvous.model import DISCONNECTED, JobState
from commctx.server.rendezvous.params import JoinParams, Slot
from commctx.server.rendezvous.waiting import JoinAnswer
from commctx.server.rpc import codec
from commctx.v1 import rendezvous_pb2 as pb

from .stores import DictStore as MemoryStore  # the contract tests' reference store, keeping records
from .test_machine import TTL, FakeClock, elastic, pushed, sessions, worlds
from .test_replies import assignment_message

HOST = "ab" * 8  # a client-chosen member id


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def rdzv(clock):
    ids = iter(f"{i:016x}" for i in range(1, 10_000))
    return Rendezvous(lease_ttl_s=TTL, clock=clock, new_member_id=lambda: next(ids))


def host(spec: JobSpec, *slots: Slot, node: str = "h1", member_id: str = HOST, job: str = "job") -> JoinParams:
    return JoinParams.build(job_id=job, spec=spec, node_key=node, address="10.0.0.1", port=31000, member_id=member_id,
                            slots=slots)


def single(spec: JobSpec, node: str, role: str = "", job: str = "job") -> JoinParams:
    return JoinParams.build(job_id=job, spec=spec, node_key=node, address="10.0.0.2", port=32000, role=role)


def seats_of(world) -> dict[str, tuple[int, int, int]]:
    """Worker id -> (rank, node rank, local rank)."""
    return {wid: (p.rank, p.node_rank, p.local_rank) for wid in world.plan.ranks if (p := world.plan.seat_of(wid))}


def test_a_host_membership_seats_each_worker_under_its_own_id_with_its_own_role(rdzv):
    spec = JobSpec.from_json({"world_size": 4, "roles": [{"role": "trainer", "count": 2}, {"role": "rollout", "count": 2}]})
    joined, actions, placed = rdzv.join(host(spec, Slot(1, "trainer"), Slot(2, "rollout"), Slot(5, "trainer", 0)))
    assert placed is None and joined.member_id == HOST and not worlds(actions)
    view = rdzv.describe("job")
    assert (view.joined, [n.workers for n in view.nodes]) == (3, [3])  # one member, three workers
    _, actions, _ = rdzv.join(single(spec, "h2", "rollout"))
    (world,) = worlds(actions)
    seats = seats_of(world)
    assert seats[f"{HOST}/5"] == (0, 0, 0)  # its launcher fixed local rank 0
    assert {wid for wid in seats if wid.startswith(HOST)} == {f"{HOST}/1", f"{HOST}/2", f"{HOST}/5"}
    assert world.hosts == {HOST: (1, 2, 5)} and world.has_seat(HOST)  # in the membership's order
    roles = {wid: world.plan.roles[rank] for wid, (rank, _, _) in seats.items()}
    assert [roles[f"{HOST}/{i}"] for i in (1, 2, 5)] == ["trainer", "rollout", "trainer"]
    assert [s.worker for s in world.host_seats(HOST)] == [1, 2, 5]
    # one lease for the three: the membership renews it
    assert rdzv.keep_alive("job", HOST, 1)[1] == 1


def test_the_wire_carries_every_host_workers_assignment_with_its_index(rdzv):
    spec = JobSpec.build(3)
    rdzv.join(host(spec, Slot(1), Slot(2)))
    _, actions, _ = rdzv.join(single(spec, "h2"))
    (world,) = worlds(actions)
    event = pb.SessionEvent.FromString(codec.session_event(world, HOST))
    expected = [assignment_message(world, s) for s in world.host_seats(HOST)]  # the message built field by field
    assert event == pb.SessionEvent(assignment=expected[0], worker_assignments=expected)
    assert [a.worker for a in event.worker_assignments] == [1, 2] and event.assignment == event.worker_assignments[0]
    assert sorted(a.rank for a in event.worker_assignments) == [0, 1]
    assert {a.local_rank for a in event.worker_assignments} == {0, 1}
    joined, _, placed = rdzv.join(host(spec, Slot(1), Slot(2)))  # re-attaching: the formed world at once
    response = pb.JoinResponse.FromString(b"".join(codec.join_slices(JoinAnswer(joined, placed, "cd" * 16), 0)))
    assert list(response.worker_assignments) == list(event.worker_assignments)


def test_a_dead_worker_leaves_its_hosts_seat_and_the_others_keep_theirs(rdzv, clock):
    spec = elastic(4, 2)
    rdzv.join(host(spec, Slot(1), Slot(2), Slot(3)))
    _, actions, _ = rdzv.join(single(spec, "h2"))
    (first,) = worlds(actions)
    before = seats_of(first)
    sinks = sessions(rdzv, [HOST, *(m for m in rdzv._jobs["job"].members if m != HOST)])
    actions = rdzv.remove_workers("job", HOST, [2], DISCONNECTED)
    (second,) = worlds(actions)
    wire = pb.SessionEvent.FromString(codec.session_event(second, HOST))
    expected = [assignment_message(second, s) for s in second.host_seats(HOST)]
    assert list(wire.worker_assignments) == expected and [a.worker for a in wire.worker_assignments] == [1, 3]
    assert all(a.HasField("previous_rank") and a.reason for a in wire.worker_assignments)
    after = seats_of(second)
    assert set(after) == set(before) - {f"{HOST}/2"} and second.lost  # survivors abort the old world's collectives
    for wid in (f"{HOST}/1", f"{HOST}/3"):
        assert after[wid][1:] == before[wid][1:] or after[wid][2] <= before[wid][2]  # the rank rule: seats kept where they can
    assert second.hosts == {HOST: (1, 3)}
    assert pushed(actions, sinks[HOST]) == [second]
    lost = [e for e in rdzv._jobs["job"].events if e.kind == "lost"]
    assert [(e.fields["worker"], e.fields["why"]) for e in lost] == [(2, "disconnected")]
    assert second.reason.startswith(f"worker 2 of host member {HOST} (node 'h1', rank ")
    assert rdzv.describe("job").joined == 3
    # its last workers leave, and the membership with them
    rdzv.remove_workers("job", HOST, [1, 3], "left")
    assert HOST not in rdzv._jobs["job"].members


def test_a_host_adds_workers_by_joining_again_and_they_grow_the_world(rdzv, clock):
    spec = elastic(4, 2, last_call_ms=0)
    rdzv.join(host(spec, Slot(1)))
    _, actions, _ = rdzv.join(single(spec, "h2"))
    (first,) = worlds(actions)
    assert first.plan.world_size == 2
    sinks = sessions(rdzv, [HOST, *(m for m in rdzv._jobs["job"].members if m != HOST)])
    _, actions, placed = rdzv.join(host(spec, Slot(1), Slot(4)))  # a replacement on the host: worker 4
    (grown,) = worlds(actions)  # no last call: the world grows at once, and the call has its answer
    assert (placed.generation, placed.hosts) == (grown.generation, grown.hosts) == (2, {HOST: (1, 4)})
    assert grown.plan.world_size == 3
    assert pushed(actions, sinks[HOST]) == [grown] and not grown.lost  # growing aborts nothing
    with pytest.raises(Conflict, match="joined before with other parameters"):
        rdzv.join(host(spec, Slot(4)))  # worker 1 is not listed: it is left through the session
    with pytest.raises(Conflict, match="joined before with other parameters"):
        rdzv.join(host(spec, Slot(1, "trainer"), Slot(4)))  # worker 1's role changed


def test_a_hosts_newcomers_are_admitted_as_joiners_are(rdzv):
    spec = JobSpec.from_json({"world_size": 3, "roles": [{"role": "trainer", "count": 1}, {"role": "rollout", "count": 2}]})
    rdzv.join(host(spec, Slot(1, "trainer")))
    with pytest.raises(Full, match="already has all 1 workers of role 'trainer'"):
        rdzv.join(host(spec, Slot(1, "trainer"), Slot(2, "trainer")))
    rdzv.join(host(spec, Slot(1, "trainer"), Slot(2, "rollout", 1)))
    assert rdzv.describe("job").joined == 2
    with pytest.raises(AlreadyExists, match="holds its node alone"):
        rdzv.join(single(spec, "h1", "rollout"))


@pytest.mark.parametrize(("slots", "fragment"), [
    ((Slot(0),), "index 0 is below 1"),
    ((Slot(1), Slot(1)), "index 1 is given twice"),
    ((Slot(1, "", 0), Slot(2, "", 0)), "local_rank 0 of worker 2 is given twice"),
    ((Slot(1, "", 9),), "local_rank 9 of worker 1 is not below world_size 4"),
    ((Slot(1, "bad role!"),), "role"),
])
def test_malformed_host_workers_are_refused_naming_the_value(slots, fragment):
    with pytest.raises(BadRequest, match=fragment):
        host(JobSpec.build(4), *slots)


def test_host_workers_exclude_the_requests_own_role_local_rank_and_workers():
    for extra, fragment in (({"role": "trainer"}, "role 'trainer'"), ({"local_rank": 1}, "local_rank 1"),
                            ({"workers": 2}, "workers 2")):
        with pytest.raises(BadRequest, match=f"{fragment} cannot be given with host_workers"):
            JoinParams.build(job_id="j", spec=JobSpec.build(4), node_key="h", address="10.0.0.1", port=1,
                             slots=(Slot(1),), **extra)
    with pytest.raises(BadRequest, match="job of nodes"):
        JoinParams.build(job_id="j", spec=JobSpec.from_json({"nodes": {"min": 1, "max": 2}}), node_key="h",
                         address="10.0.0.1", port=1, slots=(Slot(1),))


def test_a_restart_restores_a_host_membership_with_its_seats(rdzv, clock):
    spec = elastic(3, 2)
    store = MemoryStore()
    epoch = store.take_over()
    _, actions, _ = rdzv.join(host(spec, Slot(1, "trainer"), Slot(3)))
    store.commit(actions.writes, epoch)
    _, actions, _ = rdzv.join(single(spec, "h2"))
    store.commit(actions.writes, epoch)
    (world,) = worlds(actions)
    again = Rendezvous(lease_ttl_s=TTL, clock=clock)
    assert again.restore(store.load(), grace_s=TTL)[0] == 1
    restored = again.world_of("job")
    assert dict(restored.plan.ranks) == dict(world.plan.ranks) and restored.hosts == world.hosts
    assert again.describe("job").joined == 3
    again.remove_workers("job", HOST, [3], DISCONNECTED)  # its workers are known again, by index
    assert again.describe("job").joined == 2 and again._jobs["job"].state is not JobState.FAILED
    assert [e.fields["worker"] for e in again._jobs["job"].events if e.kind == "lost"] == [3]


def test_a_host_session_reports_its_dead_workers_on_the_wire_too():
    request = pb.SessionRequest(job_id="j", member_id=HOST, gone_workers=[2, 3], left_workers=[4])
    assert pb.SessionRequest.FromString(request.SerializeToString()).gone_workers == [2, 3]
    r = pb.JoinRequest(job_id="j", spec=pb.JobSpec(world_size=4), node_key="h", address="10.0.0.1", master_port=1,
                       host_workers=[pb.HostWorker(index=1, role="trainer"), pb.HostWorker(index=2, local_rank=0)])
    p = codec.join_params(r, JobSpec.build(4))
    assert p.slots == (Slot(1, "trainer", None), Slot(2, "", 0)) and p.workers == 2


async def test_a_host_membership_over_the_wire(stub):
    """One Join for two workers of a host, one session; a worker that dies is
    reported on it, and the session carries the next world's assignment of the
    worker that is left, which keeps its seat."""
    import asyncio

    spec = pb.JobSpec(world_size=3, elastic=pb.Elastic(min_size=2, last_call_ms=5000))
    host_join = pb.JoinRequest(job_id="hosted", spec=spec, node_key="h1", address="127.0.0.1", master_port=31001,
                               wait_timeout_ms=10_000, host_workers=[pb.HostWorker(index=1), pb.HostWorker(index=2)])
    other = pb.JoinRequest(job_id="hosted", spec=spec, node_key="h2", address="127.0.0.1", master_port=31002,
                           wait_timeout_ms=10_000)
    hosted, single_ = await asyncio.gather(stub.Join(host_join), stub.Join(other))
    assert [a.worker for a in hosted.worker_assignments] == [1, 2] and hosted.assignment == hosted.worker_assignments[0]
    assert sorted(a.rank for a in [*hosted.worker_assignments, single_.assignment]) == [0, 1, 2]
    kept = {a.worker: (a.node_rank, a.local_rank) for a in hosted.worker_assignments}
    session = stub.Session()
    await session.write(pb.SessionRequest(job_id="hosted", member_id=hosted.member_id, member_secret=hosted.member_secret,
                                          generation=1, spare_port=31011))
    assert (await asyncio.wait_for(session.read(), 10)).lease_ttl_ms > 0
    watcher = stub.Session()
    await watcher.write(pb.SessionRequest(job_id="hosted", member_id=single_.member_id, member_secret=single_.member_secret,
                                          generation=1, spare_port=31012))
    await asyncio.wait_for(watcher.read(), 10)
    await session.write(pb.SessionRequest(job_id="hosted", member_id=hosted.member_id, generation=1, gone_workers=[2]))
    event = await asyncio.wait_for(session.read(), 10)
    assert [a.worker for a in event.worker_assignments] == [1] and event.assignment.worker == 1
    a = event.assignment
    assert (a.generation, a.world_size, a.previous_lost) == (2, 2, True)
    assert (a.node_rank, a.local_rank) == kept[1]  # its seat, kept
    assert "worker 2 of host member" in a.reason and "its process ended without a leave" in a.reason
    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="hosted"))
    assert (d.joined, d.generation) == (2, 2)
    session.cancel()
    watcher.cancel()


@pytest.mark.parametrize("workers, removed_at_once", [(1, True), (2, False)], ids=["one worker", "two workers"])
def test_a_failed_collective_drops_a_dead_host_of_one_worker_at_once_and_leaves_others_their_takeover(
        rdzv, clock, workers, removed_at_once):
    """A host membership whose session closed without a Leave: with one worker, nobody can take its session over,
    so a peer's failed collective drops it at once, as a single member; with more, its other workers may take the
    session over within the reconnect grace, which it keeps."""
    spec = elastic(workers + 1, 1)
    rdzv.join(host(spec, *(Slot(i + 1) for i in range(workers))))
    _, actions, _ = rdzv.join(single(spec, "h2"))
    (first,) = worlds(actions)
    peer = next(m for m in rdzv._jobs["job"].members if m != HOST)
    sinks = sessions(rdzv, [HOST, peer])
    rdzv.close_session("job", HOST, sinks[HOST], departed=True)  # its hub's process died
    actions = rdzv.report_failure("job", peer, first.generation)
    assert (HOST not in rdzv._jobs["job"].members) == removed_at_once
    if removed_at_once:
        (second,) = worlds(actions)
        assert [e.fields["why"] for e in rdzv._jobs["job"].events if e.kind == "lost"] == ["broke off"] and second.lost
