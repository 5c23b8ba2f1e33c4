"""The rendezvous protocol against a real in-process grpc.aio server on port 0."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from commctx.server import start_server
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .conftest import consistently, eventually, join_request

Code = grpc.StatusCode


def ranks_of(group: pb.Group) -> list[int]:
    return [r for run in group.ranks.runs for r in range(run.start, run.start + run.count * (run.stride or 1), run.stride or 1)]


def error_info(err: grpc.aio.AioRpcError) -> tuple[str, str]:
    """(reason, domain) of the google.rpc.ErrorInfo in a failed call's rich status."""
    (detail,) = rpc_status.from_call(err).details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    return info.reason, info.domain


REASON = {
    Code.INVALID_ARGUMENT: "INVALID_REQUEST", Code.FAILED_PRECONDITION: "JOB_CONFLICT", Code.ALREADY_EXISTS: "RANK_TAKEN",
    Code.RESOURCE_EXHAUSTED: "JOB_FULL", Code.NOT_FOUND: "MEMBER_NOT_FOUND", Code.DEADLINE_EXCEEDED: "RENDEZVOUS_TIMEOUT",
    Code.UNAVAILABLE: "SERVER_UNAVAILABLE",
}
ALSO = {(Code.FAILED_PRECONDITION, "STALE_GENERATION"), (Code.RESOURCE_EXHAUSTED, "SERVER_FULL")}


async def expect_error(call, code: grpc.StatusCode, *fragments: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    err = info.value
    assert err.code() == code, err.details()
    for fragment in fragments:
        assert fragment in err.details(), err.details()
    reason, domain = error_info(err)
    assert domain == "commctx" and (reason == REASON[code] or (code, reason) in ALSO)
    return err


async def test_many_concurrent_workers_in_several_jobs(stub):
    # 72 workers in three jobs, joining interleaved from one event loop.
    jobs = {"ppo-7": (32, 4), "sft-1": (24, 3), "eval": (16, 16)}  # job: (world size, workers per node)
    requests = []
    for job_id, (world, per_node) in jobs.items():
        for i in range(world):
            node = f"host{(world - 1 - i) // per_node}"  # reverse join order vs node order
            requests.append((job_id, node, join_request(job_id, world, node, i, address=f"10.1.{i // per_node}.{i % per_node + 1}")))
    responses = await asyncio.gather(*(stub.Join(r) for _, _, r in requests))
    by_job = defaultdict(list)
    for (job_id, node, request), r in zip(requests, responses):
        by_job[job_id].append((node, r))
        if r.assignment.rank == 0:  # rank 0's own address and held port are the master endpoint
            assert (r.assignment.master_addr, r.assignment.master_port) == (request.address, request.master_port)

    for job_id, (world, per_node) in jobs.items():
        got = by_job[job_id]
        a0 = [r.assignment for _, r in got if r.assignment.rank == 0][0]
        assert sorted(r.assignment.rank for _, r in got) == list(range(world))
        assert len({r.member_id for _, r in got}) == world
        nodes = {node for node, _ in got}
        for node, r in got:
            a = r.assignment
            assert (a.job_id, a.generation, a.world_size) == (job_id, 1, world)
            assert (a.num_nodes, a.local_world_size) == (len(nodes), per_node)
            # numeric-aware node order: host0 is node rank 0
            assert a.node_rank == int(node.removeprefix("host"))
            assert a.rank == a.node_rank * per_node + a.local_rank
            assert (a.master_addr, a.master_port, a.dist_url) == (a0.master_addr, a0.master_port, f"tcp://{a0.master_addr}:{a0.master_port}")
            modes = [g.mode for g in a.groups]
            assert modes == ["GLOBAL", "INTRA_NODE", "INTER_NODE"]
            glob, intra, inter = (ranks_of(g) for g in a.groups)
            assert glob == list(range(world))
            assert intra == list(range(a.node_rank * per_node, (a.node_rank + 1) * per_node))
            assert inter == [n * per_node + a.local_rank for n in range(len(nodes))]
            assert r.lease_ttl_ms == 5000


async def test_messages_do_not_grow_with_world_size(stub):
    # A worker's assignment in a 1,024-worker world is as small as in a 16-worker one
    # (expanded rank lists would add kilobytes).
    sizes = {}
    for world in (16, 1024):
        responses = await asyncio.gather(
            *(stub.Join(join_request(f"size-{world}", world, f"node{i // 8}", i)) for i in range(world))
        )
        sizes[world] = max(r.ByteSize() for r in responses)
    assert sizes[1024] <= sizes[16] + 16, sizes


async def test_heterogeneous_nodes_over_the_wire(stub):
    layout = ["b", "a", "a", "a"]  # node a has 3 workers, node b one
    responses = await asyncio.gather(*(stub.Join(join_request("het", 4, n, i)) for i, n in enumerate(layout)))
    got = {(n, r.assignment.local_rank): r.assignment for n, r in zip(layout, responses)}
    assert got[("b", 0)].rank == 3 and got[("b", 0)].local_world_size == 1
    assert ranks_of(got[("b", 0)].groups[2]) == [0, 3]
    assert ranks_of(got[("a", 2)].groups[2]) == [2]
    assert ranks_of(got[("a", 1)].groups[1]) == [0, 1, 2]


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("job_id", "", "job_id is empty"),
        ("job_id", "x" * 200, "200 characters; at most 128"),
        ("job_id", "bad id!", "job_id 'bad id!' is malformed"),
        ("node_key", "", "node_key is empty"),
        ("node_key", "n" * 300, "300 characters; at most 253"),
        ("node_key", "-node", "node_key '-node' is malformed"),
        ("address", "not-an-ip", "address 'not-an-ip' is not an IP address"),
        ("address", "0.0.0.0", "address 0.0.0.0 is unspecified"),
        ("master_port", 0, "master_port 0 is out of range"),
        ("world_size", 0, "spec.world_size 0 is out of range"),
        ("local_rank", 9, "local_rank 9 is not below world_size 2"),
        ("node_rank", 2, "node_rank 2 is not below world_size 2"),
    ],
)
async def test_invalid_join_fields(stub, field, value, fragment):
    request = join_request("job", 2)
    if field == "world_size":
        request.spec.world_size = value
    else:
        setattr(request, field, value)
    await expect_error(stub.Join(request), Code.INVALID_ARGUMENT, fragment)


async def test_invalid_ids_in_other_calls(stub):
    await expect_error(stub.KeepAlive(pb.KeepAliveRequest(job_id="", member_id="ab")), Code.INVALID_ARGUMENT, "job_id is empty")
    await expect_error(stub.Leave(pb.LeaveRequest(job_id="j", member_id="zz!")), Code.INVALID_ARGUMENT, "member_id 'zz!' is malformed")
    await expect_error(stub.DescribeJob(pb.DescribeJobRequest(job_id="a b")), Code.INVALID_ARGUMENT, "job_id 'a b'")


async def test_conflicts_leave_healthy_members_untouched(stub):
    first = asyncio.ensure_future(stub.Join(join_request("train", 3, "a", 0, local_rank=0)))
    await eventually(lambda: _joined(stub, "train", 1), what="first worker joined")

    await expect_error(
        stub.Join(join_request("train", 4, "a", 1)),
        Code.FAILED_PRECONDITION, "job 'train' has world_size=3", "asked for world_size=4",
    )
    await expect_error(stub.Join(join_request("train", 3, "a", 2, local_rank=0)), Code.ALREADY_EXISTS, "local_rank 0 on node 'a'")
    await expect_error(
        stub.Join(join_request("train", 3, "b", 3, address="10.0.0.9")),
        Code.FAILED_PRECONDITION, "advertises 127.0.0.1", "advertises 10.0.0.9", "loopback",
    )
    # The first worker is still there and the job still forms.
    description = await stub.DescribeJob(pb.DescribeJobRequest(job_id="train"))
    assert (description.joined, description.missing) == (1, 2)
    rest = await asyncio.gather(stub.Join(join_request("train", 3, "a", 4)), stub.Join(join_request("train", 3, "b", 5)))
    a = (await first).assignment
    assert (a.rank, a.local_rank, a.generation) == (0, 0, 1)
    assert sorted(r.assignment.rank for r in rest) == [1, 2]

    await expect_error(stub.Join(join_request("train", 3, "c", 6)), Code.RESOURCE_EXHAUSTED, "already has all 3 workers")


async def test_node_rank_conflicts(stub):
    first = asyncio.ensure_future(stub.Join(join_request("nr", 3, "a", 0, node_rank=1)))
    await eventually(lambda: _joined(stub, "nr", 1))
    await expect_error(stub.Join(join_request("nr", 3, "a", 1, node_rank=0)), Code.FAILED_PRECONDITION, "node 'a' of job 'nr' has node_rank 1")
    await expect_error(stub.Join(join_request("nr", 3, "b", 2, node_rank=1)), Code.ALREADY_EXISTS, "node_rank 1 is already held by node 'a'")
    rest = await asyncio.gather(stub.Join(join_request("nr", 3, "b", 3, node_rank=0)), stub.Join(join_request("nr", 3, "a", 4)))
    assert (await first).assignment.node_rank == 1
    assert [r.assignment.node_rank for r in rest] == [0, 1]


async def test_a_world_that_cannot_form_fails_every_waiter_with_the_reason(stub):
    waiting = [asyncio.ensure_future(stub.Join(join_request("bad", 3, "a", 0, local_rank=2)))]
    await eventually(lambda: _joined(stub, "bad", 1))
    waiting.append(asyncio.ensure_future(stub.Join(join_request("bad", 3, "a", 1))))
    waiting.append(asyncio.ensure_future(stub.Join(join_request("bad", 3, "b", 2))))
    for call in waiting:
        await expect_error(call, Code.FAILED_PRECONDITION, "node 'a' has 2 workers but one asked for local_rank 2")
    # Everyone left; describe still says why it failed ...
    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="bad"))
    assert (d.state, d.joined) == (pb.JobDescription.FAILED, 0)
    assert "asked for local_rank 2" in d.reason
    # ... and the id can be used again.
    again = await stub.Join(join_request("bad", 1, "a", 3))
    assert again.assignment.generation == 1


async def test_wait_timeout_says_who_is_missing(stub):
    other = asyncio.ensure_future(stub.Join(join_request("slow", 3, "node-a", 0, wait_timeout_ms=30_000)))
    await eventually(lambda: _joined(stub, "slow", 1))
    await expect_error(
        stub.Join(join_request("slow", 3, "node-b", 1, wait_timeout_ms=300)),
        Code.DEADLINE_EXCEEDED,
        "job 'slow' did not form within 0.3 s", "2 of 3 workers joined", "node-a×1", "node-b×1", "1 missing",
    )
    # The timed-out worker was withdrawn; the other still waits.
    description = await stub.DescribeJob(pb.DescribeJobRequest(job_id="slow"))
    assert description.joined == 1 and [n.node_key for n in description.nodes] == ["node-a"]
    other.cancel()


async def test_the_callers_own_deadline_also_gets_the_details(stub):
    await expect_error(
        stub.Join(join_request("short", 2, "n", 0, wait_timeout_ms=0), timeout=2.0),
        Code.DEADLINE_EXCEEDED, "1 of 2 workers joined",
    )


async def test_cancelled_waiter_is_withdrawn_and_nothing_leaks(stub, server):
    calls = [stub.Join(join_request("gone", 4, "n", i)) for i in range(3)]
    pending = [asyncio.ensure_future(c) for c in calls]
    await eventually(lambda: _joined(stub, "gone", 3))
    for c in calls:
        c.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await eventually(lambda: _gone(stub, "gone"), what="job removed once every waiter left")
    assert "gone" not in server.machine.job_ids()


async def test_keepalive_leave_and_unknown_members(stub):
    responses = await asyncio.gather(*(stub.Join(join_request("ka", 2, "n", i)) for i in range(2)))
    (m0, s0), (m1, s1) = ((r.member_id, r.member_secret) for r in responses)
    assert len(s0) == 32 and s0 != s1  # picked by the server: these requests carried none
    ok = await stub.KeepAlive(pb.KeepAliveRequest(job_id="ka", member_id=m0, member_secret=s0, generation=1))
    assert (ok.lease_ttl_ms, ok.generation) == (5000, 1)

    err = await expect_error(
        stub.KeepAlive(pb.KeepAliveRequest(job_id="ka", member_id=m0, member_secret=s0, generation=7)),
        Code.FAILED_PRECONDITION, "holds generation 7 but the current generation is 1",
    )
    assert error_info(err) == ("STALE_GENERATION", "commctx")
    unknown = "member 'abcdef' is not in job 'ka' (it left, its lease expired, or it never joined); join again"
    await expect_error(stub.KeepAlive(pb.KeepAliveRequest(job_id="ka", member_id="abcdef", generation=1)), Code.NOT_FOUND, unknown)
    await expect_error(stub.KeepAlive(pb.KeepAliveRequest(job_id="nope", member_id=m0)), Code.NOT_FOUND, "no job 'nope'")
    # A member id without its secret is worth nothing: the answer is the one an unknown member gets.
    for secret in ("", s1, "x" * 40):
        for call in (stub.KeepAlive(pb.KeepAliveRequest(job_id="ka", member_id=m0, member_secret=secret, generation=1)),
                     stub.Leave(pb.LeaveRequest(job_id="ka", member_id=m0, member_secret=secret))):
            err = await expect_error(call, Code.NOT_FOUND, unknown.replace("abcdef", m0))
            assert secret not in err.details() or not secret
    session = stub.Session()
    await session.write(pb.SessionRequest(job_id="ka", member_id=m0, member_secret=s1, generation=1))
    assert (await session.read()).gone == unknown.replace("abcdef", m0)
    assert (await stub.DescribeJob(pb.DescribeJobRequest(job_id="ka"))).joined == 2  # nobody left

    await stub.Leave(pb.LeaveRequest(job_id="ka", member_id=m0, member_secret=s0))
    await expect_error(stub.Leave(pb.LeaveRequest(job_id="ka", member_id=m0, member_secret=s0)), Code.NOT_FOUND, m0)
    # the other member is still in the run (until it leaves, below), which ended with its first leaver:
    # its KeepAlive is told so
    await expect_error(stub.KeepAlive(pb.KeepAliveRequest(job_id="ka", member_id=m1, member_secret=s1, generation=1)),
                       Code.FAILED_PRECONDITION, f"job 'ka' finished: member {m0} (node 'n', rank ", ") left")
    await stub.Leave(pb.LeaveRequest(job_id="ka", member_id=m1, member_secret=s1))
    await expect_error(stub.KeepAlive(pb.KeepAliveRequest(job_id="ka", member_id=m1, member_secret=s1, generation=1)),
                       Code.NOT_FOUND, "job 'ka' has no run under way: run 1 ended")  # kept to describe, nobody in it
    assert (await stub.DescribeJob(pb.DescribeJobRequest(job_id="ka"))).state == pb.JobDescription.ENDED


async def test_a_client_secret_binds_its_member_id(stub):
    mid, secret = "ab" * 16, "5e" * 16
    first = join_request("bind", 2, "n", 0, member_id=mid, member_secret=secret)
    call = stub.Join(first)
    await eventually(lambda: _joined(stub, "bind", 1), what="the first worker is waiting")
    # Someone who learned the member id cannot re-attach to it without the secret...
    err = await expect_error(stub.Join(join_request("bind", 2, "n", 0, member_id=mid, member_secret="77" * 16)),
                             Code.FAILED_PRECONDITION, "joined before with another member_secret")
    assert secret not in err.details()
    await expect_error(stub.Join(join_request("bind", 2, "n", 0, member_id=mid, member_secret="short")),
                       Code.INVALID_ARGUMENT, "member_secret is malformed (5 characters)")
    # The worker itself is undisturbed, and its answer returns its own secret.
    other = await stub.Join(join_request("bind", 2, "m", 1))
    a = await call
    assert (a.member_id, a.member_secret) == (mid, secret) and other.member_secret != secret


async def test_describe_a_forming_and_a_formed_job(stub):
    first = []
    for i, n in enumerate(["node10", "node9"]):
        first.append(asyncio.ensure_future(stub.Join(join_request("d", 4, n, i))))
        await eventually(lambda: _joined(stub, "d", i + 1))
    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="d"))
    assert d.state == pb.JobDescription.FORMING
    assert (d.generation, d.spec.world_size, d.joined, d.missing, d.num_nodes) == (0, 4, 2, 2, 2)
    assert [(n.node_key, n.workers) for n in d.nodes] == [("node10", 1), ("node9", 1)]  # forming: in the order they came
    assert "2 of 4 workers joined" in d.reason and d.forming_for_s >= 0
    await asyncio.gather(*first, stub.Join(join_request("d", 4, "node9", 2)), stub.Join(join_request("d", 4, "node10", 3)))
    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="d"))
    assert (d.state, d.generation, d.joined, d.missing, d.reason) == (pb.JobDescription.FORMED, 1, 4, 0, "")
    assert [(n.node_key, n.node_rank, n.workers) for n in d.nodes] == [("node9", 0, 2), ("node10", 1, 2)]


async def test_a_weight_transfer_sending_to_its_own_role_is_refused_and_leaves_nobody_behind(stub):
    # Found by tests/test_fuzz.py: the sender was planned twice in its own group (INTERNAL, a member left for good).
    request = join_request("self-sender", 1, role="trainer", wait_timeout_ms=2_000)
    request.spec.groups.append(pb.GroupRule(mode="WEIGHT_SYNC", weight_transfer=pb.WeightTransfer(
        sender_role="trainer", receiver_roles=["rollout", "trainer"])))
    await expect_error(stub.Join(request), Code.INVALID_ARGUMENT,
                       "group 'WEIGHT_SYNC' lists its sender role 'trainer' among its receiver roles")
    await expect_error(stub.DescribeJob(pb.DescribeJobRequest(job_id="self-sender")), Code.NOT_FOUND)


async def test_draining_server_refuses_joins(stub, server):
    server.machine.draining = True
    await expect_error(stub.Join(join_request("late", 1)), Code.UNAVAILABLE, "shutting down")


async def test_server_survives_bad_input_and_keeps_serving(stub):
    held = await asyncio.gather(*(stub.Join(join_request("keep", 2, "n", i)) for i in range(2)))
    bad = [join_request("", 2), join_request("keep", 3), join_request("keep", 2), join_request("x" * 999, 1)]
    results = await asyncio.gather(*(stub.Join(r) for r in bad), return_exceptions=True)
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() != Code.UNKNOWN for r in results)
    for r in held:
        assert (await stub.KeepAlive(pb.KeepAliveRequest(job_id="keep", member_id=r.member_id, member_secret=r.member_secret, generation=1))).generation == 1
    ok = await stub.Join(join_request("after", 1))
    assert ok.assignment.world_size == 1 and ok.assignment.rank == 0


async def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "commctx.v1.Rendezvous"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    async for reply in replies:
        names = {s.name for s in reply.list_services_response.service}
        assert {"commctx.v1.Rendezvous", "grpc.health.v1.Health"} <= names
        break


async def _joined(stub, job_id: str, n: int) -> bool:
    try:
        return (await stub.DescribeJob(pb.DescribeJobRequest(job_id=job_id))).joined == n
    except grpc.aio.AioRpcError:
        return False


async def _gone(stub, job_id: str) -> bool:
    try:
        await stub.DescribeJob(pb.DescribeJobRequest(job_id=job_id))
    except grpc.aio.AioRpcError as err:
        return err.code() == Code.NOT_FOUND
    return False


def rl_spec() -> pb.JobSpec:
    return pb.JobSpec(
        world_size=3,
        roles=[pb.RoleCount(role="trainer", count=1), pb.RoleCount(role="rollout", count=2)],
        groups=[pb.GroupRule(mode="WEIGHT_TRANSFER", weight_transfer=pb.WeightTransfer(sender_role="trainer", receiver_roles=["rollout"]))],
    )


async def test_roles_are_counted_like_world_size(stub):
    def req(i, role, **kw):
        r = join_request("rl", 3, "n", i, role=role, **kw)
        r.spec.CopyFrom(rl_spec())
        return r

    first = asyncio.ensure_future(stub.Join(req(0, "trainer")))
    await eventually(lambda: _joined(stub, "rl", 1))
    await expect_error(stub.Join(req(1, "trainer")), Code.RESOURCE_EXHAUSTED, "already has all 1 workers of role 'trainer'")
    await expect_error(stub.Join(req(2, "critic")), Code.FAILED_PRECONDITION, "declares roles trainer:1, rollout:2", "role 'critic'")
    await expect_error(stub.Join(req(3, "bad role!")), Code.INVALID_ARGUMENT, "role 'bad role!' is malformed")
    other = join_request("rl", 3, "n", 4, role="rollout")  # same world size, no roles: a different spec
    await expect_error(stub.Join(other), Code.FAILED_PRECONDITION, "roles=trainer:1,rollout:2 but this worker asked for roles=none")
    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="rl"))
    assert [(r.role, r.count) for r in d.nodes[0].roles] == [("trainer", 1)]
    assert d.spec == rl_spec()
    rest = await asyncio.gather(stub.Join(req(5, "rollout")), stub.Join(req(6, "rollout")))
    a = (await first).assignment
    assert a.role == "trainer" and [r.assignment.role for r in rest] == ["rollout", "rollout"]
    assert [g.mode for g in a.groups][-1] == "WEIGHT_TRANSFER" and ranks_of(a.groups[-1]) == [0, 1, 2]


async def test_unsatisfiable_layout_fails_everyone_and_describe_says_why(stub):
    layout = pb.JobSpec(world_size=4, layout=pb.ParallelLayout(tp=2, within_node=["tp"]))

    def req(i, node):
        r = join_request("tp", 4, node, i)
        r.spec.CopyFrom(layout)
        return r

    calls = [asyncio.ensure_future(stub.Join(req(i, n))) for i, n in enumerate(["a", "b", "c", "c"])]
    for call in calls:
        await expect_error(call, Code.FAILED_PRECONDITION, "TENSOR_PARALLEL group [0, 1] spans nodes 'a' and 'b'")
    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="tp"))
    assert d.state == pb.JobDescription.FAILED and "tp=2 must stay within a node" in d.reason
    # a spec no world can satisfy is refused at the first join
    bad = req(9, "a")
    bad.spec.layout.tp = 3
    await expect_error(stub.Join(bad), Code.FAILED_PRECONDITION, "world_size 4 is not divisible by tp×cp×ep×pp = 3×1×1×1 = 3")


async def next_event(call) -> pb.SessionEvent:
    return await asyncio.wait_for(call.read(), 10)


async def test_session_for_an_unknown_member_says_gone_without_an_error(stub):
    call = stub.Session()
    await call.write(pb.SessionRequest(job_id="nope", member_id="abcd"))
    event = await next_event(call)
    assert event.WhichOneof("event") == "gone" and "no job 'nope'" in event.gone
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == Code.OK


def grow_request(job: str, node: str, port: int) -> pb.JoinRequest:
    r = join_request(job, 2, node, port, master_port=port)
    r.spec.CopyFrom(pb.JobSpec(world_size=2, elastic=pb.Elastic(min_size=1, last_call_ms=0)))
    return r


async def test_a_joiner_grows_the_world_with_one_message_per_survivor(stub):
    a = await stub.Join(grow_request("grow", "n0", 1111))
    assert (a.assignment.generation, a.assignment.world_size, a.assignment.master_port) == (1, 1, 1111)  # formed alone
    session = stub.Session()
    # Rank 0's first spare (1111) now serves its store: it offers another.
    await session.write(pb.SessionRequest(job_id="grow", member_id=a.member_id, member_secret=a.member_secret, generation=1, spare_port=3333))
    assert (await next_event(session)).lease_ttl_ms == 5000
    b_call = asyncio.ensure_future(stub.Join(grow_request("grow", "n1", 2222)))
    pushed = (await next_event(session)).assignment  # the news and the new world in one message
    b = (await b_call).assignment
    assert (pushed.generation, pushed.rank, pushed.previous_rank, pushed.world_size) == (2, 0, 0, 2)
    assert "1 worker waiting to join can grow the world" in pushed.reason
    assert pushed.master_port == 3333 == b.master_port  # rank 0 serves the new store on its spare
    assert (b.generation, b.rank) == (2, 1) and not b.HasField("previous_rank")
    assert set(pushed.changed_groups) == {"GLOBAL", "INTER_NODE"}
    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="grow"))
    assert (d.state, d.generation, d.not_ready, d.joined) == (pb.JobDescription.FORMED, 2, 0, 2)
    await session.done_writing()
    assert await session.read() == grpc.aio.EOF


async def test_a_rank_0_without_a_spare_port_is_told_and_awaited(stub):
    a = await stub.Join(grow_request("await", "n0", 1111))
    session = stub.Session()
    await session.write(pb.SessionRequest(job_id="await", member_id=a.member_id, member_secret=a.member_secret, generation=1))  # offers no spare
    await next_event(session)
    b_call = asyncio.ensure_future(stub.Join(grow_request("await", "n1", 2222)))
    change = (await next_event(session)).world_changed
    assert change.generation == 1 and "1 worker waiting to join" in change.reason
    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="await"))
    assert (d.state, d.not_ready, d.joined) == (pb.JobDescription.FORMING, 1, 2)
    assert "1 survivors not heard from since the change are awaited" in d.reason
    await session.write(pb.SessionRequest(job_id="await", member_id=a.member_id, member_secret=a.member_secret, generation=1, spare_port=4444))
    pushed = (await next_event(session)).assignment
    assert (pushed.generation, pushed.master_port) == (2, 4444) and (await b_call).assignment.master_port == 4444
    session.cancel()


async def test_a_restart_asked_in_a_sessions_first_message_re_forms_the_world(stub):
    """A launcher may ask for a restart before its session stream is open (the
    request then rides the stream's first message): the world re-forms as when
    it is asked on an open stream, and the other member hears of it."""
    a, b = await asyncio.gather(*(stub.Join(join_request("restart", 2, "n", i)) for i in range(2)))
    ranks = {a.assignment.rank: a, b.assignment.rank: b}
    rank0, rank1 = ranks[0], ranks[1]
    watching = stub.Session()
    await watching.write(pb.SessionRequest(job_id="restart", member_id=rank0.member_id, member_secret=rank0.member_secret,
                                           generation=1, spare_port=3333))
    assert (await next_event(watching)).lease_ttl_ms == 5000
    restarting = stub.Session()
    await restarting.write(pb.SessionRequest(job_id="restart", member_id=rank1.member_id, member_secret=rank1.member_secret,
                                             generation=1, restart_generation=1))
    assert (await next_event(restarting)).lease_ttl_ms == 5000
    event = await next_event(watching)  # the change, or at once the next world
    if event.WhichOneof("event") == "world_changed":
        assert event.world_changed.generation == 1 and "restarts its workers" in event.world_changed.reason
        await watching.write(pb.SessionRequest(job_id="restart", member_id=rank0.member_id, member_secret=rank0.member_secret,
                                               generation=1, spare_port=3333))
        event = await next_event(watching)
    assert event.assignment.generation == 2
    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="restart"))
    assert (d.state, d.generation) == (pb.JobDescription.FORMED, 2)
    watching.cancel()
    restarting.cancel()


async def test_a_failed_collective_drops_members_whose_sessions_closed_without_their_grace(stub):
    """The server's reconnect grace here is the lease (5 s). A member reports
    that its collectives failed: a member whose session closed is gone at once
    ("broke off"), on an open stream and in a new stream's first message alike."""
    def request(i: int) -> pb.JoinRequest:
        r = join_request("broken", 3, f"n{i}", i, master_port=1000 + i)
        r.spec.CopyFrom(pb.JobSpec(world_size=3, elastic=pb.Elastic(min_size=1, last_call_ms=5000)))
        return r

    joined = sorted(await asyncio.gather(*(stub.Join(request(i)) for i in range(3))), key=lambda r: r.assignment.rank)
    sessions = []
    for i, r in enumerate(joined):
        call = stub.Session()
        await call.write(pb.SessionRequest(job_id="broken", member_id=r.member_id, member_secret=r.member_secret,
                                           generation=1, spare_port=3000 + i))
        assert (await next_event(call)).lease_ttl_ms == 5000
        sessions.append(call)
    sessions[2].cancel()  # killed: its connection reset
    first = joined[0]
    await sessions[0].write(pb.SessionRequest(job_id="broken", member_id=first.member_id, member_secret=first.member_secret,
                                              generation=1, failed_generation=1))
    pushed = (await next_event(sessions[0])).assignment
    assert (pushed.generation, pushed.world_size) == (2, 2)
    sessions[1].cancel()
    await sessions[0].done_writing()  # (its session ends; the member keeps its seat for the grace)
    again = stub.Session()
    await again.write(pb.SessionRequest(job_id="broken", member_id=first.member_id, member_secret=first.member_secret,
                                        generation=2, spare_port=4000, failed_generation=2))
    assert (await next_event(again)).lease_ttl_ms == 5000
    assert (await next_event(again)).assignment.generation == 3
    lost = (await stub.ListEvents(pb.ListEventsRequest(job_id="broken"))).events
    assert [(e.fields["rank"], e.fields["why"]) for e in lost if e.kind == "lost"] == [(2, "broke off"), (1, "broke off")]
    again.cancel()


async def test_a_reconnecting_session_catches_up(stub):
    a = await stub.Join(grow_request("catch", "n0", 1111))
    first = stub.Session()
    await first.write(pb.SessionRequest(job_id="catch", member_id=a.member_id, member_secret=a.member_secret, generation=1, spare_port=4444))
    await next_event(first)
    first.cancel()
    await eventually(lambda: _joined(stub, "catch", 1))
    b = await stub.Join(grow_request("catch", "n1", 2222))  # the world grows while a has no session
    assert (b.assignment.generation, b.assignment.master_port) == (2, 4444)
    session = stub.Session()
    await session.write(pb.SessionRequest(job_id="catch", member_id=a.member_id, member_secret=a.member_secret, generation=1))
    assert (await next_event(session)).HasField("lease_ttl_ms")
    missed = (await next_event(session)).assignment  # replayed on connect
    assert (missed.generation, missed.rank, missed.world_size, missed.previous_rank) == (2, 0, 2, 0)
    session.cancel()


async def test_a_member_that_stops_renewing_expires_and_survivors_are_told():
    from commctx.server import start_server

    server = await start_server("127.0.0.1", 0, lease_ttl_s=2.0)  # time for the survivor to open its session under load
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.RendezvousStub(channel)
            spec = pb.JobSpec(world_size=2, elastic=pb.Elastic(min_size=1, last_call_ms=10_000))  # forms at 2 at once
            reqs = [join_request("exp", 2, "n", i) for i in range(2)]
            for r in reqs:
                r.spec.CopyFrom(spec)
            a, b = await asyncio.gather(*(stub.Join(r) for r in reqs))
            if a.assignment.rank != 0:
                a, b = b, a
            session = stub.Session()
            await session.write(pb.SessionRequest(job_id="exp", member_id=a.member_id, member_secret=a.member_secret, generation=1, spare_port=5555))
            await next_event(session)

            async def renew():
                while True:
                    await asyncio.sleep(0.1)  # the scenario, not a wait for something: a renewal every 0.1 s
                    await session.write(pb.SessionRequest(job_id="exp", member_id=a.member_id, member_secret=a.member_secret, generation=1))

            renewer = asyncio.ensure_future(renew())
            alone = (await next_event(session)).assignment  # b never renews; a alone is fresh: one message
            renewer.cancel()
            assert f"member {b.member_id}" in alone.reason and "expired" in alone.reason
            assert (alone.generation, alone.world_size, alone.rank, alone.master_port) == (2, 1, 0, 5555)
            session.cancel()
    finally:
        await server.stop(0)


async def test_a_session_that_never_names_its_member_is_closed_after_one_ttl():
    s = await start_server("127.0.0.1", 0, lease_ttl_s=0.5)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.RendezvousStub(ch)
            call = stub.Session()
            err = await expect_error(call.read(), Code.DEADLINE_EXCEEDED, "no SessionRequest within 0.501 s (the lease TTL, "
                                     "and 1 ms for each open stream or for each worker of the widest world",
                                     "a session starts by naming its member")
            assert err is not None
            assert (await stub.ListJobs(pb.ListJobsRequest())).jobs == []  # still serving
            # A world of 700 workers formed: their first leases last 0.5 s + 0.7 s, and so may an unnamed stream.
            await stub.Join(join_request("wide", 700, workers=700))
            call = stub.Session()
            started = time.monotonic()
            await expect_error(call.read(), Code.DEADLINE_EXCEEDED, "no SessionRequest within 1.2 s")
            assert time.monotonic() - started >= 1.1
    finally:
        await s.stop(0)


async def test_old_connections_are_closed_and_their_members_carry_on():
    from commctx.server.rendezvous.model import Limits

    s = await start_server("127.0.0.1", 0, lease_ttl_s=30, limits=Limits(max_connection_age_s=0.5, max_join_wait_s=0.5))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.RendezvousStub(ch)
            joined = await stub.Join(join_request("aged", 1))
            call = stub.Session()
            await call.write(pb.SessionRequest(job_id="aged", member_id=joined.member_id, generation=1,
                                               member_secret=joined.member_secret))
            assert (await call.read()).lease_ttl_ms == 30_000
            # Age 0.5 s, then 1.5 s of grace (the longest Join wait + 1 s): the stream is cut, not held for ever.
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await asyncio.wait_for(call.read(), 10)
            assert cut.value.code() is Code.UNAVAILABLE
            renewed = await stub.KeepAlive(pb.KeepAliveRequest(job_id="aged", member_id=joined.member_id, generation=1,
                                                               member_secret=joined.member_secret))
            assert renewed.generation == 1  # the channel reconnected; the member and its world are untouched
    finally:
        await s.stop(0)


async def test_undecodable_requests_are_invalid_arguments_logged_once(stub, channel, caplog):
    held = await stub.Join(join_request("beside", 1))
    garbage = b"\xff\xff\xff\x07garbage"
    for method in ("Join", "KeepAlive", "Leave", "DescribeJob", "ListJobs"):
        for _ in range(20):
            err = await expect_error(channel.unary_unary(f"/commctx.v1.Rendezvous/{method}")(garbage, timeout=5),
                                     Code.INVALID_ARGUMENT, f"the request is not a valid commctx.v1.{method}Request message")
            assert error_info(err) == ("INVALID_REQUEST", "commctx")
    session = channel.stream_stream("/commctx.v1.Rendezvous/Session")()
    await session.write(garbage)
    await expect_error(session.read(), Code.INVALID_ARGUMENT, "not a valid commctx.v1.SessionRequest message")
    lines = [r for r in caplog.records if r.name == "commctx.server" and r.levelname in ("WARNING", "ERROR")]
    assert [r.getMessage() for r in lines] == ["undecodable_requests"]  # one line for 101 bad requests
    ok = await stub.KeepAlive(pb.KeepAliveRequest(job_id="beside", member_id=held.member_id, member_secret=held.member_secret))
    assert ok.generation == 1  # the healthy job beside them is undisturbed


async def test_limits_name_themselves():
    from commctx.server.rendezvous.model import Limits

    s = await start_server("127.0.0.1", 0, limits=Limits(max_jobs=1, max_spec_bytes=200, max_spec_rules=3, max_join_wait_s=0.3,
                                                          max_streams=1))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.RendezvousStub(ch)
            many = join_request("rules", 2)
            many.spec.expected_nodes.extend(f"node{i}" for i in range(10))
            await expect_error(stub.Join(many), Code.INVALID_ARGUMENT,
                               "spec has 10 roles, group rules, cpu twins and expected nodes; at most 3 allowed (--max-spec-rules)")
            big = join_request("bytes", 2)
            big.spec.expected_nodes.extend(["a" * 150, "b" * 150])
            await expect_error(stub.Join(big), Code.INVALID_ARGUMENT, f"spec is {big.spec.ByteSize()} bytes; at most 200 allowed (--max-spec-bytes)")
            started = asyncio.get_running_loop().time()
            await expect_error(stub.Join(join_request("waits", 2, wait_timeout_ms=600_000)), Code.DEADLINE_EXCEEDED,
                               "did not form within 0.3 s")  # capped by --max-join-wait-s
            assert asyncio.get_running_loop().time() - started < 5
            held = await stub.Join(join_request("held", 1))
            err = await expect_error(stub.Join(join_request("another", 1)), Code.RESOURCE_EXHAUSTED,
                                     "maximum of 1 jobs (--max-jobs); job 'another' cannot be created now")
            assert error_info(err) == ("SERVER_FULL", "commctx")
            assert held.assignment.world_size == 1
            first = stub.Session()
            await first.write(pb.SessionRequest(job_id="held", member_id=held.member_id, member_secret=held.member_secret))
            assert (await first.read()).lease_ttl_ms > 0
            await expect_error(stub.Session().read(), Code.RESOURCE_EXHAUSTED,
                               "maximum of 1 session streams (--max-streams); retry later")
            first.cancel()
            await eventually(lambda: s.servicer.open_sessions == 0, what="the stream is closed")
            again = stub.Session()
            await again.write(pb.SessionRequest(job_id="held", member_id=held.member_id, member_secret=held.member_secret))
            assert (await again.read()).lease_ttl_ms > 0
            again.cancel()
    finally:
        await s.stop(0)


async def test_list_jobs_is_paged(stub):
    names = [f"job{i:03d}" for i in range(250)]
    await asyncio.gather(*(stub.Join(join_request(n, 1)) for n in names))
    seen, token, pages = [], "", 0
    while True:
        page = await stub.ListJobs(pb.ListJobsRequest(page_size=100, page_token=token))
        seen += [j.job_id for j in page.jobs]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert (seen, pages) == (names, 3)
    assert len((await stub.ListJobs(pb.ListJobsRequest())).jobs) == 100  # the default page
    await expect_error(stub.ListJobs(pb.ListJobsRequest(page_size=5000)), Code.INVALID_ARGUMENT,
                       "page_size 5000 is above the most a page holds, 1000")


async def test_a_retried_join_takes_over_from_the_call_it_retries(stub):
    mid, secret = "cd" * 16, "9a" * 16
    request = join_request("retry", 2, "n", 0, member_id=mid, member_secret=secret)
    first = asyncio.ensure_future(stub.Join(request))
    await eventually(lambda: _joined(stub, "retry", 1), what="the first call waits")
    second = asyncio.ensure_future(stub.Join(request))  # the same worker, retrying (its first call looked lost)
    await expect_error(first, Code.FAILED_PRECONDITION, f"a later Join call for member {mid} of job 'retry' took over this one")
    assert (await stub.DescribeJob(pb.DescribeJobRequest(job_id="retry"))).joined == 1  # not withdrawn with the old call
    other = await stub.Join(join_request("retry", 2, "m", 1))
    placed = await second
    assert (placed.member_id, placed.member_secret) == (mid, secret)
    assert {placed.assignment.rank, other.assignment.rank} == {0, 1}


async def test_the_spec_cache_keeps_valid_specs_only_and_parses_big_ones_off_the_loop(monkeypatch):
    import threading

    from commctx.server.errors import BadRequest
    from commctx.server.rendezvous.model import Limits
    from commctx.server.rpc import specs

    threads = []
    parse = specs._parse_spec
    monkeypatch.setattr(specs, "_parse_spec", lambda wire: threads.append(threading.current_thread()) or parse(wire))
    cache, limits = specs.SpecCache(), Limits()
    small = pb.JoinRequest(spec=pb.JobSpec(world_size=2))
    big = pb.JoinRequest(spec=pb.JobSpec(world_size=1024))
    big.spec.groups.extend(pb.GroupRule(mode=f"G{i}", named=pb.NamedGroups(groups=[pb.RankList(ranks=[i])])) for i in range(300))
    assert big.spec.ByteSize() > specs.SpecCache.INLINE_BYTES
    assert (await cache.spec_of(small, limits)).world_size == 2
    assert len((await cache.spec_of(big, limits)).rules) == 300
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()  # the big one in a worker
    await cache.spec_of(big, limits)
    assert len(threads) == 2  # the second time from the cache
    bad = pb.JoinRequest(spec=pb.JobSpec(world_size=2, cpu_twins=["NOPE"]))
    for _ in range(2):
        with pytest.raises(BadRequest):
            await cache.spec_of(bad, limits)
    assert len(threads) == 4 and len(cache._specs) == 2  # a rejected spec is parsed each time, never kept
    for n in range(3, 3 + specs.SpecCache.SIZE):
        await cache.spec_of(pb.JoinRequest(spec=pb.JobSpec(world_size=n)), limits)
    assert len(cache._specs) == specs.SpecCache.SIZE
    threads.clear()
    big.spec.world_size = 2048  # a new big spec, sent by a burst of workers at once: parsed once
    fresh = specs.SpecCache()
    specs = await asyncio.gather(fresh.spec_of(big, limits), *(cache.spec_of(big, limits) for _ in range(20)))
    assert len(threads) == 2 and all(s == specs[0] for s in specs) and specs[1] is specs[-1]
    parsers = set(threads)
    cache.close(), fresh.close()  # as a server's stop does: its parsing thread ends
    for thread in parsers:
        thread.join(timeout=10)
        assert not thread.is_alive()


async def test_a_session_catching_up_hears_only_of_a_world_that_is_durable():
    """Found by benchmarks/chaos.py: a session opening late was told the world the leader had formed in
    memory, before its writes were durable; when the leader then lost its term, that world never was, and
    its generation later named another one. What a session missed comes after what is queued is written."""
    from .test_executor import GatedStore

    store = GatedStore()
    server = await start_server("127.0.0.1", 0, store=store)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.RendezvousStub(channel)
    try:
        a = await stub.Join(grow_request("late", "n0", 1111))
        first = stub.Session()
        await first.write(pb.SessionRequest(job_id="late", member_id=a.member_id, member_secret=a.member_secret,
                                            generation=1, spare_port=4444))
        await next_event(first)
        first.cancel()
        await eventually(lambda: _joined(stub, "late", 1))
        store.gate.clear()  # the store is slow: the next world is formed in memory, not yet written
        b = asyncio.ensure_future(stub.Join(grow_request("late", "n1", 2222)))
        await eventually(lambda: store.at_gate, what="generation 2's commit waits at the gate")
        session = stub.Session()
        await session.write(pb.SessionRequest(job_id="late", member_id=a.member_id, member_secret=a.member_secret,
                                              generation=1))
        assert (await next_event(session)).HasField("lease_ttl_ms")
        early = asyncio.ensure_future(session.read())
        await consistently(lambda: not early.done() and not b.done(), 1.0, "nothing told while the world is unwritten")
        store.gate.set()
        told = [await asyncio.wait_for(early, 10)]
        while not told[-1].HasField("assignment"):  # the re-form's news, then its world
            told.append(await next_event(session))
        assert [e.WhichOneof("event") for e in told][-1] == "assignment" and len(told) <= 2
        assert (told[-1].assignment.generation, told[-1].assignment.world_size) == (2, 2)
        assert (await b).assignment.generation == 2
        session.cancel()
    finally:
        store.gate.set()
        await channel.close()
        await server.stop()


async def test_a_replica_deposed_while_it_answers_says_not_leader_not_what_its_old_state_says():
    """Found by benchmarks/chaos.py: a leader paused past its lease woke, fired its lease timers (every
    renewal it had missed), and told the callers queued meanwhile that their members were gone, while
    another replica led and held them. An answer leaves only while its replica leads; "gone" on a
    session too."""
    server = await start_server("127.0.0.1", 0)
    machine = server.term.machine
    keep_alive, open_session = machine.keep_alive, machine.open_session

    def deposed_meanwhile(call):
        def calling(*args, **kwargs):
            server.leading = lambda: False  # its lease ran out while it worked on this call
            return call(*args, **kwargs)
        return calling

    machine.keep_alive, machine.open_session = deposed_meanwhile(keep_alive), deposed_meanwhile(open_session)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.RendezvousStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.KeepAlive(pb.KeepAliveRequest(job_id="j", member_id="0" * 16))
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE and "NOT_LEADER" in str(
                rpc_status.from_call(caught.value))
            server.leading = lambda: True
            session = stub.Session()
            await session.write(pb.SessionRequest(job_id="j", member_id="0" * 16))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                event = await asyncio.wait_for(session.read(), 10)
                assert not event.HasField("gone"), event  # not the word of a replica that no longer leads
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop()


async def test_a_keepalive_names_only_a_generation_that_is_durable():
    """Found by benchmarks/chaos.py: a KeepAlive answered the generation its leader had formed in memory; the
    leader lost its term before writing it, and the member's next KeepAlive, from the new leader, named
    the one before. The answer waits until what is queued is written."""
    from .test_executor import GatedStore

    store = GatedStore()
    server = await start_server("127.0.0.1", 0, store=store)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.RendezvousStub(channel)
            a = await stub.Join(grow_request("kept", "n0", 1111))
            await stub.KeepAlive(pb.KeepAliveRequest(job_id="kept", member_id=a.member_id, member_secret=a.member_secret,
                                                     generation=1))
            session = stub.Session()  # offers rank 0's spare, so that the next world can form at once
            await session.write(pb.SessionRequest(job_id="kept", member_id=a.member_id, member_secret=a.member_secret,
                                                  generation=1, spare_port=4444))
            await next_event(session)
            store.gate.clear()  # the next world is formed in memory, not yet written
            b = asyncio.ensure_future(stub.Join(grow_request("kept", "n1", 2222)))
            await eventually(lambda: store.at_gate, what="generation 2's commit waits at the gate")
            renewal = asyncio.ensure_future(stub.KeepAlive(pb.KeepAliveRequest(  # no generation claimed: told the current
                job_id="kept", member_id=a.member_id, member_secret=a.member_secret)))
            await consistently(lambda: not renewal.done(), 1.0, "no answer while generation 2 is unwritten")
            store.gate.set()
            assert (await asyncio.wait_for(renewal, 10)).generation == 2  # once it is written
            assert (await b).assignment.generation == 2
            session.cancel()
    finally:
        store.gate.set()
        await server.stop()
