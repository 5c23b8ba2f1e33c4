"""TLS and mutual TLS on the main port (certificates made at test time with
trustme), the plaintext health-only port beside it, and the clients that
speak it: raw gRPC, CommContext.join, and the `commctx` tool."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
import torch
import torch.distributed as dist
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commctx import CommContext, UsageError
from commctx.transport import Tls
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def describe(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """The status a DescribeJob of an unknown job gets: NOT_FOUND means it reached the servicer."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        try:
            pb_grpc.RendezvousStub(channel).DescribeJob(pb.DescribeJobRequest(job_id="nope"), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def commctx(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("COMMCTX_TLS_")}
    return subprocess.run(["commctx", *args], capture_output=True, text=True, timeout=60, env={**base, **(env or {})})


def test_the_main_port_speaks_tls_only_and_the_health_port_stays_plaintext(pki):
    server = Server("127.0.0.1", "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"], health=True)
    try:
        trusted = grpc.ssl_channel_credentials(read(pki["ca"]))
        assert describe(server.address, trusted) == grpc.StatusCode.NOT_FOUND
        assert describe(server.address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext is refused
        assert describe(server.address, grpc.ssl_channel_credentials(read(pki["stranger_ca"]))) == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(server.health_address) as ch:  # probes need no certificate
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:  # and that port serves health only
                pb_grpc.RendezvousStub(ch).DescribeJob(pb.DescribeJobRequest(job_id="nope"), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED

        ok = commctx("health", "--addr", server.address, "--tls-ca", pki["ca"])
        assert ok.returncode == 0 and "SERVING" in ok.stdout
        plain = commctx("health", "--addr", server.address, "--timeout", "2")
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
        status = commctx("status", "--addr", server.address, env={"COMMCTX_TLS_CA": pki["ca"]})
        assert status.returncode == 0 and status.stdout.strip() == "no jobs"
        # The probe inside the server's container, where COMMCTX_TLS_CERT/KEY are the server's own files:
        # without a CA they do not make it a TLS client, so the plaintext health port answers.
        own = {"COMMCTX_TLS_CERT": pki["server_cert"], "COMMCTX_TLS_KEY": pki["server_key"]}
        probe = commctx("health", "--addr", server.health_address, env=own)
        assert probe.returncode == 0 and "SERVING" in probe.stdout
        missing = commctx("status", "--addr", server.address, "--tls-ca", "/nonexistent/ca.pem")
        assert missing.returncode == 2 and "cannot read tls_ca '/nonexistent/ca.pem'" in missing.stderr
    finally:
        server.stop()


def test_mutual_tls_admits_only_clients_with_a_certificate_of_its_ca(pki, monkeypatch):
    server = Server("127.0.0.1", env={"COMMCTX_TLS_CERT": pki["server_cert"], "COMMCTX_TLS_KEY": pki["server_key"],
                                      "COMMCTX_TLS_CLIENT_CA": pki["ca"]})
    try:
        ca = read(pki["ca"])
        assert describe(server.address, grpc.ssl_channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE  # no certificate
        stranger = grpc.ssl_channel_credentials(ca, read(pki["stranger_key"]), read(pki["stranger_cert"]))
        assert describe(server.address, stranger) == grpc.StatusCode.UNAVAILABLE  # one the server's CA did not sign
        client = grpc.ssl_channel_credentials(ca, read(pki["client_key"]), read(pki["client_cert"]))
        assert describe(server.address, client) == grpc.StatusCode.NOT_FOUND

        # A worker: the files from COMMCTX_TLS_* (as a launcher would export them), a real gloo world.
        monkeypatch.setenv("COMMCTX_TLS_CA", pki["ca"])
        monkeypatch.setenv("COMMCTX_TLS_CERT", pki["client_cert"])
        monkeypatch.setenv("COMMCTX_TLS_KEY", pki["client_key"])
        ctx = CommContext.join(server.address, job_id="sealed-wire", world_size=1, timeout=30)
        try:
            assert (ctx.assignment.rank, ctx.assignment.world_size) == (0, 1)
            t = torch.tensor([3.0])
            dist.all_reduce(t)
            assert t.item() == 3.0
        finally:
            ctx.destroy()

        ok = commctx("status", "--addr", server.address, "--tls-ca", pki["ca"], "--tls-cert", pki["client_cert"],
                     "--tls-key", pki["client_key"])
        assert ok.returncode == 0 and "no jobs" in ok.stdout  # the worker left: its job is gone
        refused = commctx("status", "--addr", server.address, "--tls-ca", pki["ca"])
        assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
    finally:
        server.stop()


def test_tls_mistakes_are_named(pki, tmp_path):
    half = subprocess.run([sys.executable, "-m", "commctx.server", "--tls-cert", pki["server_cert"]],
                          capture_output=True, text=True, timeout=60)
    assert half.returncode == 2 and "--tls-cert and --tls-key go together" in half.stderr
    ca_only = subprocess.run([sys.executable, "-m", "commctx.server", "--tls-client-ca", pki["ca"]],
                             capture_output=True, text=True, timeout=60)
    assert ca_only.returncode == 2 and "--tls-client-ca requires" in ca_only.stderr
    unreadable = subprocess.run(
        [sys.executable, "-m", "commctx.server", "--store", "memory", "--port", "0",
         "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", pki["server_key"]],
        capture_output=True, text=True, timeout=60)
    assert unreadable.returncode == 1
    assert unreadable.stderr.strip() == f"commctx-server: cannot read --tls-cert {tmp_path / 'missing.pem'}: No such file or directory"

    with pytest.raises(UsageError, match="needs its key"):
        Tls(cert=pki["client_cert"])
    with pytest.raises(UsageError, match=r"cannot read tls_ca '/nonexistent/ca.pem': No such file or directory"):
        CommContext.join("127.0.0.1:1", job_id="j", world_size=1, tls_ca="/nonexistent/ca.pem", timeout=1)
