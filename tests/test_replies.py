"""Replies stay bounded however big a job is: DescribeJob pages a job's nodes,
ListJobs leaves them out, and `commctx status` reads a 100,000-member job.
And every assignment a reply carries, encoded once per world from shared
parts, parses to the message protobuf builds field by field from its seat.

The big job is entered through the server's own state machine (100,000 gRPC
Joins would take this test a minute); everything read back goes over gRPC."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import time

import grpc
import pytest

from commctx.common.planning import Candidate, JobSpec, plan_world
from commctx.server.rendezvous.model import Joined, NewWorld, SeatInWorld
from commctx.server.rendezvous.params import JoinParams
from commctx.server.rendezvous.waiting import JoinAnswer
from commctx.server.rpc import codec
from commctx.server.rpc.wire import pass_bytes
from commctx.v1 import rendezvous_pb2 as pb

from .conftest import eventually, join_request

BIG = 100_000


def fill(server, job_id: str, members: int, key: str = "host{}") -> None:
    """`members` workers, one per node, joined as a Join would (without waiting in one).
    Automatic collection is off from here to the end of the test (`_collecting`), as
    the server's GC pacer keeps it under load (a loop without an await gives the
    pacer no turn, and this test runs no pacer): each full collection would scan
    every object of this test process, seconds over 100,000 joins and what reads them."""
    spec = JobSpec.build(world_size=members)
    gc.disable()
    for i in range(members):
        _, actions, _ = server.machine.join(JoinParams.build(
            job_id=job_id, spec=spec, node_key=key.format(i), address=f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", port=29500))
        server.executor.submit(actions)


@pytest.fixture(autouse=True)
def _collecting():
    """Automatic collection is back on after each test (fill() turns it off)."""
    yield
    gc.enable()


async def test_describe_job_pages_nodes_in_node_rank_order(server, stub):
    fill(server, "wide", 25)
    await eventually(lambda: server.machine.describe("wide").state.name == "FORMED", what="the world forms")
    seen, token, pages = [], "", 0
    while True:
        d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="wide", node_page_size=10, node_page_token=token))
        assert (d.num_nodes, d.joined, d.generation) == (25, 25, 1) and len(d.nodes) <= 10
        seen += [(n.node_rank, n.node_key, n.workers) for n in d.nodes]
        pages, token = pages + 1, d.next_node_page_token
        if not token:
            break
    assert pages == 3 and [r for r, _, _ in seen] == list(range(25))  # every node once, in node-rank order
    assert sorted(k for _, k, _ in seen) == sorted(f"host{i}" for i in range(25)) and {w for _, _, w in seen} == {1}

    listed = (await stub.ListJobs(pb.ListJobsRequest())).jobs
    assert [(j.job_id, j.num_nodes, len(j.nodes)) for j in listed] == [("wide", 25, 0)]

    for bad, what in ((pb.DescribeJobRequest(job_id="wide", node_page_size=10_001), "node_page_size 10001"),
                      (pb.DescribeJobRequest(job_id="wide", node_page_token="-1"), "node_page_token '-1'"),
                      (pb.DescribeJobRequest(job_id="wide", node_page_token="x" * 5000), "node_page_token 'xxx")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.DescribeJob(bad)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and what in err.value.details()
        assert len(err.value.details()) < 300


async def test_a_page_of_long_node_keys_is_cut_to_a_mebibyte(server, stub):
    fill(server, "long", 5000, "n{:0>250}")  # 5,000 nodes of ~270 bytes: 1.3 MB in one page of 10,000
    await eventually(lambda: server.machine.describe("long").state.name == "FORMED", what="the world forms")
    ranks, token, sizes = [], "", []
    while True:
        d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="long", node_page_size=10_000, node_page_token=token))
        sizes.append(d.ByteSize())
        ranks += [n.node_rank for n in d.nodes]
        token = d.next_node_page_token
        if not token:
            break
    assert len(sizes) == 2 and max(sizes) <= 1 << 20 and ranks == list(range(5000))


@pytest.mark.slow(23)
async def test_status_reads_a_job_of_100k_members(server, stub):
    started = time.monotonic()
    fill(server, "huge", BIG)
    await eventually(lambda: server.machine.describe("huge", max_nodes=0).state.name == "FORMED", timeout_s=120, what="100k world")
    filled = time.monotonic() - started

    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="huge"))
    assert (d.joined, d.num_nodes, len(d.nodes), d.next_node_page_token) == (BIG, BIG, 1000, "1000")
    assert d.ByteSize() < 100_000  # a page of 1,000 nodes; gRPC refuses replies over 4 MiB

    args = ["commctx", "status", "--addr", f"127.0.0.1:{server.port}", "--job", "huge"]
    shown = await asyncio.to_thread(subprocess.run, args, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"job huge (run 1): formed, generation 1, {BIG} of {BIG} workers joined")
    assert lines[-1] == f"... {BIG - 1000} more nodes (--nodes 0 lists them all)"
    every = await asyncio.to_thread(subprocess.run, [*args, "--nodes", "0"], capture_output=True, text=True, timeout=60)
    assert every.returncode == 0, every.stderr
    rows = [line.split() for line in every.stdout.splitlines()[2:]]
    assert len(rows) == BIG and [int(r[0]) for r in rows] == list(range(BIG))
    table = await asyncio.to_thread(subprocess.run, args[:4], capture_output=True, text=True, timeout=60)
    assert table.stdout.splitlines()[1].split()[:7] == ["huge", "1", "formed", "1", f"{BIG}/{BIG}", "0", str(BIG)]

    # A healthy small job beside it is served as usual.
    small = await stub.Join(join_request("small", 1))
    assert small.assignment.world_size == 1
    print(f"100k members entered and formed in {filled:.1f} s")


def assignment_message(world: NewWorld, seat: SeatInWorld) -> pb.Assignment:
    """A seat's assignment in `world`, built field by field by protobuf: the oracle the codec's one encoder is held to."""
    plan, p = seat.plan, seat.seat
    return pb.Assignment(
        job_id=seat.job_id, run=world.run, generation=seat.generation, world_size=plan.world_size, num_nodes=plan.num_nodes,
        master_addr=plan.master_addr, master_port=plan.master_port, dist_url=plan.dist_url, reason=seat.reason,
        previous_lost=seat.previous_lost, node_rank=p.node_rank, local_world_size=plan.nodes[p.node_rank].size,
        rank=p.rank, local_rank=p.local_rank, previous_rank=seat.previous_rank,
        role=plan.roles[p.rank] if plan.roles else "", worker=seat.worker, changed_groups=seat.changed_groups,
        groups=[pb.Group(mode=g.mode, index=g.index, cpu_twin=g.cpu_twin, root=g.root, ranks=pb.RankSet(
            runs=[pb.RankRun(start=r.start, count=r.count, stride=r.stride) for r in g.ranks]))
            for g in seat.groups or plan.groups_of(p)])


def _worlds() -> list[NewWorld]:
    """A first world, and re-formed ones (m5 replaced by m6, which has no previous rank), of roles,
    groups of several modes and a CPU twin; "w" is a node membership of two workers."""
    spec = JobSpec.from_json(dict(
        world_size=7, roles=[dict(role="trainer", count=2), dict(role="rollout", count=5)],
        groups=[dict(mode="TRAIN_DATA_PARALLEL", role_group=dict(roles=["trainer"])),
                dict(mode="WEIGHT_TRANSFER", weight_transfer=dict(sender_role="trainer", receiver_roles=["rollout"],
                                                                  scope="SCOPE_NODE")),
                dict(mode="PAIRS", named=dict(groups=[dict(ranks=[4, 1]), dict(ranks=[5])]))],
        cpu_twins=["TRAIN_DATA_PARALLEL"]))
    layout = [("m0", "n1", "rollout"), ("m1", "n0", "rollout"), ("m2", "n0", "trainer"), ("m3", "n1", "trainer"),
              ("m4", "n0", "rollout"), ("w", "n0", "rollout"), ("w/1", "n0", "rollout")]
    first = [Candidate(mid, node, f"10.0.0.{node[1]}", 30000 + i, None, None, role) for i, (mid, node, role) in enumerate(layout)]
    second = [*first[:4], Candidate("m6", "n1", "10.0.0.1", 30006, None, None, "rollout"), *first[5:]]
    one, two = plan_world(first, spec), plan_world(second, spec)
    return [NewWorld("job", 1, one, None), NewWorld("job", 2, two, one, "member m4 (node 'n0', rank 4) left"),
            NewWorld("job", 2, two, one, "member m4 (node 'n0', rank 4) expired", lost=True)]


def test_every_assignment_on_the_wire_is_the_message_built_field_by_field():
    """Session events and Join answers (a worker's, a node membership's, a host
    membership's) carry assignments joined from what their world shares
    (codec.WorldEncoding): each parses to the message built from its seat."""
    worlds = codec.Worlds()
    for world in _worlds():
        seen_previous = set()
        for mid in world.plan.ranks:
            seat = world.seat_of(mid)
            for kept in (worlds, None):  # an encoding kept for the world's delivery, and one made for this answer
                event = codec.session_event(world, mid, kept)
                assert type(event) is bytes and pb.SessionEvent.FromString(event) == pb.SessionEvent(
                    assignment=assignment_message(world, seat)), mid
                if mid == "w/1":
                    continue  # a node membership's second worker: answered in w's Join
                join_answer = JoinAnswer(Joined("job", mid, 10.0, 1), world, "cd" * 16)
                workers = 2 if mid == "w" else 0
                assert codec.many_workers(join_answer, workers) == bool(workers)
                answer = pb.JoinResponse.FromString(b"".join(codec.join_slices(join_answer, workers, kept)))
                expected = pb.JoinResponse(member_id=mid, member_secret="cd" * 16, lease_ttl_ms=10_000,
                                           assignment=assignment_message(world, seat))
                if workers:
                    expected.worker_assignments.extend(assignment_message(world, world.seat_of(w)) for w in ("w", "w/1"))
                assert answer == expected, mid
            seen_previous.add(pb.SessionEvent.FromString(codec.session_event(world, mid)).assignment.HasField("previous_rank"))
        assert seen_previous == ({False} if world.previous is None else {True, False})  # m6: no previous rank
        assert codec.session_event(world, "m-unknown", worlds) is None


def test_a_host_memberships_assignments_are_its_workers_in_its_order():
    world = _worlds()[0]
    hosted = NewWorld("job", 1, world.plan, None, hosts={"w": (0, 1)})
    seats = [hosted.seat_of("w", 0), hosted.seat_of("w/1", 1)]
    expected = [assignment_message(hosted, s) for s in seats]
    assert [a.worker for a in expected] == [0, 1]
    assert codec.session_sliced(hosted, "w") and not codec.session_sliced(hosted, "m0")
    event = pb.SessionEvent.FromString(codec.session_event(hosted, "w", codec.Worlds()))
    assert event == pb.SessionEvent(assignment=expected[0], worker_assignments=expected)
    join_answer = JoinAnswer(Joined("job", "w", 10.0, 1), hosted, "cd" * 16)
    assert codec.many_workers(join_answer, 0)
    answer = pb.JoinResponse.FromString(b"".join(codec.join_slices(join_answer, 0)))
    assert list(answer.worker_assignments) == expected and answer.assignment == expected[0]


def test_bytes_encoded_ahead_leave_as_they_are():
    serialize = pass_bytes(pb.SessionEvent.SerializeToString)
    assert serialize(b"\x08\x01") == b"\x08\x01"
    assert serialize(pb.SessionEvent(lease_ttl_ms=1)) == b"\x08\x01"
