"""Import boundaries and the console script, as installed."""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .cluster import Server


def test_server_never_imports_torch():
    code = "import sys, commctx.server.main, commctx.server; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_no_bare_server_or_client_package_is_installed():
    code = "import importlib.util as u, sys; sys.exit(any(u.find_spec(n) for n in ('server', 'client', 'proto')))"
    assert subprocess.run([sys.executable, "-c", code], cwd="/").returncode == 0


def test_console_script_serves_health_and_drains_on_sigterm():
    server = Server("127.0.0.1")
    try:
        with grpc.insecure_channel(server.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="commctx.v1.Rendezvous"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        server.popen.send_signal(signal.SIGTERM)
        assert server.popen.wait(15) == 0
    finally:
        server.stop()


def test_invalid_flags_fail_at_start_with_a_message():
    out = subprocess.run([sys.executable, "-m", "commctx.server", "--port", "70000"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "--port=70000: out of range 0..65535" in out.stderr
