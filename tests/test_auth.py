"""Callers: a real server started with --auth-tokens; every call but health
needs a bearer token of the file (reflection too); SIGHUP re-reads it; the
clients (raw gRPC, CommContext.join, `commctx status`) send theirs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest
import torch
import torch.distributed as dist
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from commctx import CommContext, Unauthenticated, UsageError
from commctx.transport import error_reason
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server
from .conftest import holds_for, wait_until

USER_TOKEN = "u-7f3a9c2e41b8"
ADMIN_TOKEN = "a-0d5e6f7a8b9c"


def describe(address: str, token: str | None) -> grpc.RpcError:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.RendezvousStub(ch).DescribeJob(pb.DescribeJobRequest(job_id="nope"), timeout=5, metadata=metadata)
    return info.value


def scrape(url: str) -> dict[str, float]:
    lines = urllib.request.urlopen(url, timeout=5).read().decode().splitlines()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines if line and not line.startswith("#"))}


def commctx(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "COMMCTX_TOKEN"}
    return subprocess.run(["commctx", *args], capture_output=True, text=True, timeout=60, env={**base, **(env or {})})


def test_every_call_but_health_needs_a_known_token(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# operators and the training team\n{ADMIN_TOKEN} admin\n\n{USER_TOKEN}\n")
    server = Server("127.0.0.1", "--auth-tokens", str(tokens), "--log-level", "debug")
    try:
        for token in (None, "not-a-token", f"{USER_TOKEN}x"):
            err = describe(server.address, token)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, token
            assert error_reason(err) == "UNAUTHENTICATED_CALLER"
            assert "authorization: Bearer <token>" in err.details()
        for token in (USER_TOKEN, ADMIN_TOKEN):  # reached the servicer
            assert describe(server.address, token).code() == grpc.StatusCode.NOT_FOUND
        with grpc.insecure_channel(server.address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)  # no token needed
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(ch)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            with pytest.raises(grpc.RpcError) as info:
                list(reflect.ServerReflectionInfo(iter([ask]), timeout=5))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            (answer,) = reflect.ServerReflectionInfo(iter([ask]), timeout=5, metadata=[("authorization", f"Bearer {USER_TOKEN}")])
            assert "commctx.v1.Rendezvous" in {s.name for s in answer.list_services_response.service}

        # The CLI: --token, or COMMCTX_TOKEN; without one, UNAUTHENTICATED.
        assert commctx("status", "--addr", server.address, "--token", USER_TOKEN).stdout.strip() == "no jobs"
        assert commctx("status", "--addr", server.address, env={"COMMCTX_TOKEN": USER_TOKEN}).returncode == 0
        refused = commctx("status", "--addr", server.address)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr

        # SIGHUP re-reads the file: the user token is revoked, the admin's stays.
        tokens.write_text(f"{ADMIN_TOKEN} admin\n")
        server.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: describe(server.address, USER_TOKEN).code() == grpc.StatusCode.UNAUTHENTICATED, what="the old token refused")
        assert describe(server.address, ADMIN_TOKEN).code() == grpc.StatusCode.NOT_FOUND
        # A file that no longer parses changes nothing, and the log says why without echoing it.
        tokens.write_text(f"{ADMIN_TOKEN} operator\n")
        server.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: "tokens_not_reloaded" in server.log(), what=server.log)
        assert "line 1: expected a token, optionally followed by 'admin'" in server.log()
        assert describe(server.address, ADMIN_TOKEN).code() == grpc.StatusCode.NOT_FOUND
        log = server.log()  # at debug level
        assert USER_TOKEN not in log and ADMIN_TOKEN not in log
    finally:
        server.stop()


def test_a_worker_sends_its_token(tmp_path, monkeypatch):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{USER_TOKEN}\n")
    server = Server("127.0.0.1", "--lease-ttl-s", "1", env={"COMMCTX_AUTH_TOKENS": str(tokens)}, metrics=True)
    try:
        with pytest.raises(Unauthenticated, match="needs an 'authorization: Bearer <token>' header"):
            CommContext.join(server.address, job_id="tok", world_size=1, timeout=10)
        ctx = CommContext.join(server.address, job_id="tok", world_size=1, timeout=30, token=USER_TOKEN)
        try:
            t = torch.tensor([2.0])
            dist.all_reduce(t)
            assert (ctx.assignment.rank, t.item()) == (0, 2.0)
            with grpc.insecure_channel(server.address) as ch:
                def describe_tok() -> tuple:
                    d = pb_grpc.RendezvousStub(ch).DescribeJob(pb.DescribeJobRequest(job_id="tok"), timeout=5,
                                                               metadata=[("authorization", f"Bearer {USER_TOKEN}")])
                    return d.state, d.generation, d.joined

                # Time that must pass, not a wait for something: over two lease TTLs, the job lives on (asked
                # throughout) only if the session stream renews with the token.
                holds_for(lambda: describe_tok() == (pb.JobDescription.FORMED, 1, 1), 2.5, "the job formed, its worker in it")
                assert describe_tok() == (pb.JobDescription.FORMED, 1, 1)
        finally:
            ctx.destroy()
        # Only the token-less Join was refused: the session stream and the Leave carried the token.
        refused = {k: v for k, v in scrape(server.metrics_url).items() if 'code="UNAUTHENTICATED"' in k}
        assert refused == {'commctx_rpc_errors_total{code="UNAUTHENTICATED",method="Join"}': 1.0}
        monkeypatch.setenv("COMMCTX_TOKEN", USER_TOKEN)  # as a launcher would export it
        ctx = CommContext.join(server.address, job_id="tok2", world_size=1, timeout=30)
        assert ctx.assignment.world_size == 1
        ctx.destroy()
        with pytest.raises(UsageError, match="printable ASCII without spaces"):
            CommContext.join(server.address, job_id="tok3", world_size=1, timeout=5, token="two words")
    finally:
        server.stop()


def test_token_file_mistakes_stop_the_server_with_one_line(tmp_path):
    def run(path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "commctx.server", "--store", "memory", "--port", "0",
                               "--auth-tokens", str(path)], capture_output=True, text=True, timeout=60)

    missing = run(tmp_path / "absent")
    assert missing.returncode == 1
    assert missing.stderr.strip() == f"commctx-server: cannot read --auth-tokens {tmp_path / 'absent'}: No such file or directory"
    empty = tmp_path / "empty"
    empty.write_text("# nobody yet\n")
    assert "holds no token: no caller could get in" in run(empty).stderr
    bad = tmp_path / "bad"
    bad.write_text(f"{USER_TOKEN}\nsecret-value root\n")
    out = run(bad)
    assert out.returncode == 1 and "line 2: expected a token" in out.stderr and "secret-value" not in out.stderr
