"""A hostile client against a real server: every attack the trust issue lists
is tried and must fail. Attacks tried in full elsewhere are named here, so
that this list is the whole threat model's checklist:

| attack | where |
|---|---|
| a stranger takes rank 0 of another team's forming job | here; tests/test_sealed.py |
| errors name the member id of another worker | here |
| a member id alone leaves, renews or opens the session of its member | here; test_protocol.py::test_keepalive_leave_and_unknown_members |
| secrets or tokens in the logs | here; test_auth.py (tokens) |
| anyone lists or describes every job | here; test_sealed.py (admin) |
| no TLS, no authentication | test_tls.py, test_auth.py |
| a 1 MB spec (70,000 rules) freezes the server | here |
| 100,000 jobs, silent streams, failed jobs without bound | here (jobs); test_protocol.py::test_limits_name_themselves (streams); test_machine.py (failed jobs kept) |
| replies without bound | test_replies.py (a 100,000-member job), test_protocol.py::test_list_jobs_is_paged |
| undecodable bytes: UNKNOWN and a traceback per request | test_protocol.py::test_undecodable_requests_are_invalid_arguments_logged_once, test_fuzz.py |
| error texts that copy huge values (and turn into the wrong code) | here |
| an answered Leave comes back after kill -9 | here |
| a full disk: jobs formed, waiters never told, health SERVING | test_faults.py::test_a_full_disk_refuses_answers_it_cannot_make_durable |
| a garbage state database stops the server with a traceback | here |
| one node Join standing for a million workers (a reply of a million assignments) | here |
| a restart request for another job's world, or a stale generation | test_machine.py::test_a_launcher_restarting_its_workers_re_forms_the_world_once (a member restarts only its own job, once per generation) |
| one caller fills the server's jobs, waiting Joins or streams | test_tenants.py (per-caller shares) |
| one member opens thousands of sessions | test_detect.py::test_a_flood_of_sessions_for_one_member_holds_one_stream |
| a revoked token's sessions, waiting Joins and watches go on | test_tenants.py |
| TLS off by an empty flag; a bad, mismatched, expired certificate served | test_tenants.py |
| a spare port out of range handed to every worker | test_tenants.py |
| short job secrets; guessing one at 1,600 tries a second | test_tenants.py |
| a frozen leader that thaws answers from stale state | test_ha.py::test_a_deposed_leader_writes_nothing_and_answers_nothing_from_its_stale_state |
| a job's history flooded by one refusal; a slow reader of WatchEvents or the event stream | test_machine.py::test_a_refusal_is_recorded_and_a_storm_of_it_counted; test_events.py |
| one peer holds every HTTP connection (idle, or a slowloris), or opens event streams beyond its share | test_http_fair.py |
| a log flood: a POST to the HTTP port was a 500 and two tracebacks; every refused TLS handshake a line | test_http_fair.py |
| the HTTP API shows jobs where client certificates guard gRPC; a swapped client CA's old certificates | test_http_fair.py |
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commctx.server import start_server
from commctx.server.rendezvous.model import Limits
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server
from .conftest import eventually, join_request

Code = grpc.StatusCode
JOB_SECRET = "team-a-" + "5" * 24


async def rejected(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert len(info.value.details()) <= 1024
    return info.value


async def test_a_stranger_cannot_take_a_sealed_job_or_read_it(stub):
    real = asyncio.ensure_future(stub.Join(join_request("team-a", 2, "node-a", 0, job_secret=JOB_SECRET)))
    await eventually(lambda: _joined(stub, "team-a", 1, JOB_SECRET), what="the team's first worker waits")
    for secret in ("", "guessing-it-right", JOB_SECRET[:-1]):
        for node in ("0evil", "node-b"):
            err = await rejected(stub.Join(join_request("team-a", 2, node, 9, address="10.6.6.6", job_secret=secret)))
            assert err.code() is Code.PERMISSION_DENIED and "node-a" not in err.details() and "127.0.0.1" not in err.details()
        err = await rejected(stub.DescribeJob(pb.DescribeJobRequest(job_id="team-a", job_secret=secret)))
        assert err.code() is Code.PERMISSION_DENIED and "node-a" not in err.details()
    (listed,) = (await stub.ListJobs(pb.ListJobsRequest())).jobs
    assert listed == pb.JobDescription(job_id="team-a", state=pb.JobDescription.FORMING, run=1)  # id and state, nothing else
    second = await stub.Join(join_request("team-a", 2, "node-b", 1, job_secret=JOB_SECRET))
    first = await real
    assert (first.assignment.rank, second.assignment.rank) == (0, 1) and first.assignment.master_addr == "127.0.0.1"


async def _joined(stub, job: str, n: int, secret: str = "") -> bool:
    try:
        return (await stub.DescribeJob(pb.DescribeJobRequest(job_id=job, job_secret=secret))).joined == n
    except grpc.aio.AioRpcError:
        return False


async def test_no_error_names_another_members_id(stub):
    mid = "c0ffee" * 5
    victim = asyncio.ensure_future(stub.Join(join_request("ranks", 3, "n", 0, local_rank=0, node_rank=0, member_id=mid,
                                                          member_secret="ab" * 16)))
    await eventually(lambda: _joined(stub, "ranks", 1))
    attempts = [
        join_request("ranks", 3, "n", 1, local_rank=0),  # the victim's local rank
        join_request("ranks", 3, "other", 1, node_rank=0),  # the victim's node rank
        join_request("ranks", 4, "n", 1),  # another spec
        join_request("ranks", 3, "n", 1, address="10.0.0.9"),  # another address for the victim's node
    ]
    for request in attempts:
        err = await rejected(stub.Join(request))
        assert err.code() in (Code.ALREADY_EXISTS, Code.FAILED_PRECONDITION), err.details()
        assert mid not in err.details()
    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="ranks"))
    assert d.joined == 1  # the victim is still there, waiting
    victim.cancel()


async def test_secrets_and_tokens_never_reach_the_log(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-user-1234567890\ntok-admin-0987654321 admin\n")
    from commctx.server.rpc.auth import Callers

    s = await start_server("127.0.0.1", 0, callers=Callers(tokens))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.RendezvousStub(ch)
            auth = (("authorization", "Bearer tok-user-1234567890"),)
            joined = await stub.Join(join_request("logged", 1, job_secret=JOB_SECRET), metadata=auth)
            await stub.KeepAlive(pb.KeepAliveRequest(job_id="logged", member_id=joined.member_id, generation=1,
                                                     member_secret=joined.member_secret), metadata=auth)
            await rejected(stub.KeepAlive(pb.KeepAliveRequest(job_id="logged", member_id=joined.member_id,
                                                              member_secret="f" * 32), metadata=auth))
            await rejected(stub.ListJobs(pb.ListJobsRequest(), metadata=(("authorization", "Bearer tok-wrong-555"),)))
            await stub.Leave(pb.LeaveRequest(job_id="logged", member_id=joined.member_id, member_secret=joined.member_secret,
                                             job_secret=JOB_SECRET), metadata=auth)
    finally:
        await s.stop(0)
    text = caplog.text + "".join(str(getattr(r, "fields", "")) for r in caplog.records)
    assert "join" in text and joined.member_id in text  # the log is there, ids and all...
    for secret in (JOB_SECRET, joined.member_secret, "f" * 32, "tok-user-1234567890", "tok-admin-0987654321", "tok-wrong-555"):
        assert secret not in text  # ...and holds no secret or token


async def test_a_huge_spec_is_refused_unread_while_health_answers():
    s = await start_server("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch, \
                grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as probe_ch:
            stub, health = pb_grpc.RendezvousStub(ch), health_pb2_grpc.HealthStub(probe_ch)
            huge = join_request("huge", 2)
            huge.spec.groups.extend(pb.GroupRule(mode=f"G{i}", named=pb.NamedGroups(groups=[pb.RankList(ranks=[0, 1])]))
                                    for i in range(70_000))
            assert huge.ByteSize() > 1_000_000
            joins = [asyncio.ensure_future(stub.Join(huge)) for _ in range(20)]

            async def answered_while_health_answers() -> bool:  # probes answer while the specs are read (spec_lag.py times them)
                assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == health_pb2.HealthCheckResponse.SERVING
                return all(j.done() for j in joins)

            await eventually(answered_while_health_answers, 60, "the huge Joins answered", interval_s=0.005)
            for j in joins:
                err = j.exception()
                assert err.code() is Code.INVALID_ARGUMENT and "(--max-spec-bytes)" in err.details()
            assert (await stub.Join(join_request("after", 1))).assignment.world_size == 1
    finally:
        await s.stop(0)


async def test_a_job_flood_stops_at_the_job_limit():
    s = await start_server("127.0.0.1", 0, limits=Limits(max_jobs=200, caller_share=1.0))  # one caller may take it all
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            stub = pb_grpc.RendezvousStub(ch)
            answers = await asyncio.gather(*(stub.Join(join_request(f"flood-{i}", 1)) for i in range(300)),
                                           return_exceptions=True)
            refused = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
            assert len(refused) == 100 and {a.code() for a in refused} == {Code.RESOURCE_EXHAUSTED}
            assert all("maximum of 200 jobs (--max-jobs)" in a.details() for a in refused)
            assert s.machine.stats().jobs == 200
    finally:
        await s.stop(0)


@pytest.mark.parametrize("field", ["job_id", "node_key", "role", "member_id", "member_secret", "job_secret"])
async def test_error_texts_stay_short_whatever_the_value(stub, field):
    request = join_request("short", 2)
    setattr(request, field, "\u2603" * 40_000)  # 120 KB of UTF-8: past gRPC's metadata limit if copied whole
    err = await rejected(stub.Join(request))
    assert err.code() is Code.INVALID_ARGUMENT and field.split("_")[0] in err.details()
    err = await rejected(stub.DescribeJob(pb.DescribeJobRequest(job_id="x" * 100_000)))
    assert err.code() is Code.INVALID_ARGUMENT


@pytest.mark.slow
def test_an_answered_leave_survives_kill_9(tmp_path):
    for attempt in range(5):
        state = tmp_path / f"state{attempt}"
        server = Server("127.0.0.1", "--state-dir", str(state))
        try:
            with grpc.insecure_channel(server.address) as ch:
                stub = pb_grpc.RendezvousStub(ch)
                calls = [stub.Join.future(pb.JoinRequest(job_id="leaving", spec=pb.JobSpec(world_size=2), node_key="n",
                                                         address="127.0.0.1", master_port=9 + i, wait_timeout_ms=20_000))
                         for i in range(2)]
                first, second = (c.result(20) for c in calls)
                stub.Leave(pb.LeaveRequest(job_id="leaving", member_id=first.member_id, member_secret=first.member_secret), timeout=5)
            server.kill()  # at once after the OK
        finally:
            server.stop()
        server = Server("127.0.0.1", "--state-dir", str(state))
        try:
            with grpc.insecure_channel(server.address) as ch:
                stub = pb_grpc.RendezvousStub(ch)
                d = stub.DescribeJob(pb.DescribeJobRequest(job_id="leaving"), timeout=5)
                assert d.joined == 1 and d.state == pb.JobDescription.ENDED, d  # the leave is kept, not undone
                with pytest.raises(grpc.RpcError) as gone:
                    stub.KeepAlive(pb.KeepAliveRequest(job_id="leaving", member_id=first.member_id,
                                                       member_secret=first.member_secret), timeout=5)
                assert gone.value.code() is Code.NOT_FOUND
        finally:
            server.stop()


def test_a_garbage_state_database_stops_the_server_with_one_line(tmp_path):
    (tmp_path / "commctx.sqlite3").write_bytes(b"not a database " * 500)
    run = subprocess.run([sys.executable, "-m", "commctx.server", "--port", "0", "--state-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"commctx-server: cannot use the state database {tmp_path / 'commctx.sqlite3'}: file is not a database"]


async def test_a_node_join_of_a_million_workers_is_refused(stub):
    request = pb.JoinRequest(job_id="huge-node", spec=pb.JobSpec(world_size=1 << 20), node_key="n0", address="127.0.0.1",
                             master_port=29500, workers=1 << 20)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Join(request, timeout=10)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "workers 1048576 is out of range 1..1024" in raised.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as raised:  # nothing was registered
        await stub.DescribeJob(pb.DescribeJobRequest(job_id="huge-node"), timeout=10)
    assert raised.value.code() is grpc.StatusCode.NOT_FOUND
