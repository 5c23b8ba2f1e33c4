"""Sealed jobs: the first Join seals a job with its job_secret; a stranger can
neither join it (the rank-0 hijack), describe it, nor read its details in
ListJobs, while its own workers (CommContext.join, `commctx status`) can."""

from __future__ import annotations

import asyncio
import os
import subprocess

import grpc
import pytest
import torch
import torch.distributed as dist

from commctx import CommContext, PermissionDenied
from commctx.server import start_server
from commctx.server.tokens import Callers
from commctx.transport import error_from_rpc, error_reason
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server
from .conftest import eventually, join_request, wait_until

SECRET = "team-a:9f8e7d6c5b4a"
Code = grpc.StatusCode


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def test_a_sealed_job_admits_and_shows_itself_only_to_its_secret(stub):
    first = asyncio.ensure_future(stub.Join(join_request("ppo", 2, "node-a", 0, job_secret=SECRET)))
    async def sealed() -> bool:
        try:
            return (await stub.DescribeJob(pb.DescribeJobRequest(job_id="ppo", job_secret=SECRET))).joined == 1
        except grpc.aio.AioRpcError:
            return False

    await eventually(sealed, what="the first worker has sealed the job")
    # The stranger's attempt at rank 0 (node key '0evil' sorts first), without or with a wrong secret:
    for secret in ("", "team-b:0000000000"):
        err = await refused(stub.Join(join_request("ppo", 2, "0evil", 1, job_secret=secret)))
        assert (err.code(), error_reason(err)) == (Code.PERMISSION_DENIED, "JOB_SEALED")
        assert err.details() == "job 'ppo' is sealed: this join's job_secret is missing or wrong"
        err = await refused(stub.DescribeJob(pb.DescribeJobRequest(job_id="ppo", job_secret=secret)))
        assert err.code() == Code.PERMISSION_DENIED and "node-a" not in err.details() and "127.0.0.1" not in err.details()
    # A worker that passes a secret to an open job is told so (every worker passes the same one).
    await stub.Join(join_request("open", 1))
    err = await refused(stub.Join(join_request("open", 2, job_secret=SECRET)))
    assert err.code() == Code.FAILED_PRECONDITION and "is not sealed, but this join carries a job_secret" in err.details()
    err = await refused(stub.Join(join_request("other", 1, job_secret="short")))
    assert err.code() == Code.INVALID_ARGUMENT and "job_secret is malformed (5 characters)" in err.details()

    second = await stub.Join(join_request("ppo", 2, "node-b", 1, job_secret=SECRET))
    a = await first
    assert (a.assignment.rank, second.assignment.rank) == (0, 1)  # node-a, not 0evil, holds rank 0
    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="ppo", job_secret=SECRET))
    assert (d.state, d.joined, [n.node_key for n in d.nodes]) == (pb.JobDescription.FORMED, 2, ["node-a", "node-b"])
    # ListJobs: the sealed job as id and state only; the open one in full.
    listed = {j.job_id: j for j in (await stub.ListJobs(pb.ListJobsRequest())).jobs}
    assert listed["ppo"] == pb.JobDescription(job_id="ppo", state=pb.JobDescription.FORMED, run=1)
    assert (listed["open"].num_nodes, listed["open"].spec.world_size) == (1, 1)
    # Leave: the member's own secret is not enough for a sealed job; with the job's it goes.
    leave = pb.LeaveRequest(job_id="ppo", member_id=second.member_id, member_secret=second.member_secret)
    for secret in ("", "team-b:0000000000"):
        leave.job_secret = secret
        err = await refused(stub.Leave(leave))
        assert (err.code(), error_reason(err)) == (Code.PERMISSION_DENIED, "JOB_SEALED")
        assert err.details() == "job 'ppo' is sealed: this leave's job_secret is missing or wrong"
    leave.job_secret = SECRET
    await stub.Leave(leave)
    assert (await stub.DescribeJob(pb.DescribeJobRequest(job_id="ppo", job_secret=SECRET))).joined == 1


async def test_an_admin_token_sees_sealed_jobs_in_full(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("ops-0123456789 admin\nuser-0123456789\n")
    server = await start_server("127.0.0.1", 0, callers=Callers(tokens))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.RendezvousStub(ch)

            def bearer(token: str) -> list[tuple[str, str]]:
                return [("authorization", f"Bearer {token}")]

            await stub.Join(join_request("sealed", 1, job_secret=SECRET), metadata=bearer("user-0123456789"))
            as_user = (await stub.ListJobs(pb.ListJobsRequest(), metadata=bearer("user-0123456789"))).jobs
            as_admin = (await stub.ListJobs(pb.ListJobsRequest(), metadata=bearer("ops-0123456789"))).jobs
            assert [(j.job_id, j.num_nodes) for j in as_user] == [("sealed", 0)]
            assert [(j.job_id, j.num_nodes, j.spec.world_size) for j in as_admin] == [("sealed", 1, 1)]
    finally:
        await server.stop(0)


def test_workers_seal_their_job_and_the_tool_opens_it(monkeypatch):
    server = Server("127.0.0.1")
    try:
        monkeypatch.setenv("COMMCTX_JOB_SECRET", SECRET)  # as a launcher would export it
        ctx = CommContext.join(server.address, job_id="sealed-solo", world_size=1, timeout=30)
        try:
            t = torch.tensor([5.0])
            dist.all_reduce(t)
            assert t.item() == 5.0
        finally:
            ctx.destroy()
        monkeypatch.delenv("COMMCTX_JOB_SECRET")
        # A job whose first worker waits: another worker without the secret is refused, as a typed error.
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.RendezvousStub(ch)
            waiting = stub.Join.future(join_request("held2", 2, "n0", 0, job_secret=SECRET, wait_timeout_ms=20_000))
            try:
                wait_until(lambda: described(stub, "held2") == 1)
                with pytest.raises(grpc.RpcError) as info:
                    stub.Join(join_request("held2", 2, "n1", 1), timeout=5)
                assert isinstance(error_from_rpc(info.value), PermissionDenied)
                shown = commctx("status", "--addr", server.address, "--job", "held2", "--job-secret", SECRET)
                assert shown.returncode == 0 and "job held2 (run 1): forming" in shown.stdout and "n0" in shown.stdout
                hidden = commctx("status", "--addr", server.address, "--job", "held2")
                assert hidden.returncode == 1 and "PERMISSION_DENIED" in hidden.stderr and "n0" not in hidden.stderr
                listed = commctx("status", "--addr", server.address)
                assert "held2" in listed.stdout and "n0" not in listed.stdout
            finally:
                waiting.cancel()
    finally:
        server.stop()


def described(stub, job: str) -> int:
    try:
        return stub.DescribeJob(pb.DescribeJobRequest(job_id=job, job_secret=SECRET), timeout=5).joined
    except grpc.RpcError:
        return 0


def commctx(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COMMCTX_JOB_SECRET"}
    return subprocess.run(["commctx", *args], capture_output=True, text=True, timeout=60, env=env)
