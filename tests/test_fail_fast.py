"""Mistakes that cannot heal end a join at once; what can heal is retried.

Against real servers (TLS, mutual TLS, tokens, the HTTP and health ports; an
HTTP/1 server; certificates made with trustme), `CommContext.join` with a
60 s timeout raises within seconds, a `CommCtxError` whose one-line message
names the cause and the setting to change, for each of:

- a plaintext client and a TLS server (tls_ca=), and a mutual-TLS one (and tls_cert=);
- a TLS client and a plaintext server (drop tls_ca=);
- a server certificate its tls_ca= does not trust (tls_ca=), or that names another host (server_addr=);
- mutual TLS without a client certificate, or with one the server refuses (tls_cert=);
- the HTTP port, or any HTTP/1 server, given as the gRPC address, with or without TLS (server_addr=, --port);
- a gRPC server without commctx's Rendezvous service, the health port (server_addr=);
- no token, or one the server does not know (token=, COMMCTX_TOKEN);
- a sealed job without its secret (job_secret=, COMMCTX_JOB_SECRET);

in a host's shared membership (the default: the hub joins, the worker gets the
error over the host link) and in a membership of its own, and through the
torchrun handler. What may heal waits out the timeout with the warning: a
refused connection, a port whose connections close at once (a server going
away), a host name that does not resolve (yet: a name that comes late is
waited for). Also: a failover's warnings name the replica the client moves
to; Ctrl-C in a waiting join ends it without gRPC's frames and withdraws the
membership; `from commctx import CommContext` without torch says what to
install.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest

from commctx import CommContext, CommCtxError, ConnectionMismatch, PermissionDenied, ServerUnavailable, Unauthenticated
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server, clean_env
from .conftest import join_request, wait_until
from .etcd import free_port as closed_port

TIMEOUT_S = 60.0  # the joins' timeout: an unhealable mistake must end far sooner
FAST_S = 15.0  # a bound, not a benchmark (two busy cores)
TOKEN = "fail-fast-token-0123456789"


class _Quiet(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def servers(pki, tmp_path_factory):
    """Address by name: plaintext (with its health and HTTP ports), TLS, mutual TLS, TLS whose
    certificate names another host, tokens; and a plain HTTP/1 server."""
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    tls = ("--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"])
    started: list[Server] = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        def start(*args: str, **kw) -> Server:
            if not kw.get("metrics"):
                args = (*args, "--http-port", "0")  # not the default port, which another test may hold
            started.append(Server("127.0.0.1", *args, **kw))
            return started[-1]

        plain = start(health=True, metrics=True)
        yield {
            "plain": plain.address, "health": plain.health_address, "http": plain.http_url.split("//")[1].rstrip("/"),
            "tls": start(*tls).address,
            "mtls": start(*tls, "--tls-client-ca", pki["ca"]).address,
            "other_name": start("--tls-cert", pki["other_name_cert"], "--tls-key", pki["other_name_key"]).address,
            "tokens": start("--auth-tokens", str(tokens)).address,
            "http1": f"127.0.0.1:{httpd.server_address[1]}",
        }
    finally:
        httpd.shutdown()
        httpd.server_close()
        for server in started:
            server.stop()


def tls_files(pki: dict, ca: str | None = None, client: str | None = None) -> dict:
    kw = {"tls_ca": pki[ca]} if ca else {}
    if client:
        kw.update(tls_cert=pki[f"{client}_cert"], tls_key=pki[f"{client}_key"])
    return kw


# (server, TLS files (CA, client), token, exception, fragments of its message)
CASES = {
    "plaintext client, TLS server": (
        "tls", (None, None), None, ConnectionMismatch,
        ["speaks TLS and this client does not: set tls_ca= or COMMCTX_TLS_CA"]),
    "plaintext client, mutual-TLS server": (
        "mtls", (None, None), None, ConnectionMismatch,
        ["speaks TLS and this client does not: set tls_ca= or COMMCTX_TLS_CA", "and tls_cert= and tls_key=",
         "it requires one"]),
    "TLS client, plaintext server": (
        "plain", ("ca", None), None, ConnectionMismatch,
        ["does not speak TLS (it answers plaintext gRPC): drop tls_ca= and COMMCTX_TLS_CA"]),
    "a CA that did not sign the server's certificate": (
        "tls", ("stranger_ca", None), None, ConnectionMismatch,
        ["its TLS certificate is not signed by the CA in tls_ca=", "stranger_ca.pem",
         "CERTIFICATE_VERIFY_FAILED", "set tls_ca= or COMMCTX_TLS_CA"]),
    "a certificate for another host": (
        "other_name", ("ca", None), None, ConnectionMismatch,
        ["its TLS certificate does not name '127.0.0.1': set server_addr= or COMMCTX_SERVER"]),
    "mutual TLS, no client certificate": (
        "mtls", ("ca", None), None, ConnectionMismatch,
        ["requires a client certificate (mutual TLS) and this client has none: set tls_cert= and tls_key="]),
    "mutual TLS, a client certificate it refuses": (
        "mtls", ("ca", "stranger"), None, ConnectionMismatch,
        ["refused this client's certificate tls_cert=", "stranger_cert.pem", "set tls_cert= and tls_key="]),
    "the HTTP port": (
        "http", (None, None), None, ConnectionMismatch,
        ["answers HTTP/1, not gRPC (is it commctx-server's HTTP port, --http-port?)",
         "set server_addr= or COMMCTX_SERVER to the server's gRPC port (--port, default 50051)"]),
    "the HTTP port, over TLS": (
        "http", ("ca", None), None, ConnectionMismatch,
        ["answers plaintext HTTP/1, not TLS nor gRPC", "set server_addr= or COMMCTX_SERVER"]),
    "another HTTP/1 server": (
        "http1", (None, None), None, ConnectionMismatch,
        ["answers HTTP/1, not gRPC", "set server_addr= or COMMCTX_SERVER"]),
    "the health port (gRPC, not commctx's service)": (
        "health", (None, None), None, ConnectionMismatch,
        ["serves gRPC but not commctx's Rendezvous service", "is it the health port (--health-port)?",
         "set server_addr= or COMMCTX_SERVER"]),
    "no token": (
        "tokens", (None, None), None, Unauthenticated,
        ["requires a token and this client sent none: pass token= or set COMMCTX_TOKEN"]),
    "a token the server does not know": (
        "tokens", (None, None), "not-the-token-0123456789", Unauthenticated,
        ["does not know this client's token (token= or COMMCTX_TOKEN"]),
}


@pytest.fixture(autouse=True)
def no_commctx_env(monkeypatch):
    for name in ("COMMCTX_TLS_CA", "COMMCTX_TLS_CERT", "COMMCTX_TLS_KEY", "COMMCTX_TOKEN", "COMMCTX_SHARE_HOST"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("share_host", [True, False], ids=["host membership", "own membership"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_mistake_that_cannot_heal_ends_the_join_at_once_naming_the_setting(servers, pki, case, share_host):
    server, (ca, client), token, raised, fragments = CASES[case]
    address = servers[server]
    start = time.monotonic()
    with pytest.raises(raised) as info:
        CommContext.join(address, job_id=f"ff-{server}", world_size=2, timeout=TIMEOUT_S, token=token,
                         share_host=share_host, progress_interval=0, **tls_files(pki, ca, client))
    elapsed = time.monotonic() - start
    err = info.value
    message = str(err)
    assert elapsed < FAST_S, (elapsed, message)
    assert isinstance(err, CommCtxError) and "\n" not in message
    assert f"rendezvous server {address}" in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    if raised is ConnectionMismatch:
        assert isinstance(err, ServerUnavailable) and err.reason == "CONNECTION_MISMATCH"
        assert err.code == ("UNIMPLEMENTED" if server == "health" else "UNAVAILABLE")


def test_the_variables_are_read_as_the_arguments_are(servers, pki, monkeypatch):
    """COMMCTX_TLS_CA naming a CA that did not sign the server's certificate: named as the file it read."""
    monkeypatch.setenv("COMMCTX_TLS_CA", pki["stranger_ca"])
    start = time.monotonic()
    with pytest.raises(ConnectionMismatch, match=r"not signed by the CA in tls_ca='.*stranger_ca\.pem'.*COMMCTX_TLS_CA"):
        CommContext.join(servers["tls"], job_id="ff-env", world_size=2, timeout=TIMEOUT_S, progress_interval=0)
    assert time.monotonic() - start < FAST_S


def test_a_sealed_job_s_refusal_names_the_job_secret_setting(servers, monkeypatch):
    """PermissionDenied was final before; its message now names where the secret comes from."""
    monkeypatch.delenv("COMMCTX_JOB_SECRET", raising=False)
    with grpc.insecure_channel(servers["plain"]) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        first = stub.Join.future(join_request("ff-sealed", 2, job_secret="ff-secret-0123456789", wait_timeout_ms=30_000))
        try:
            wait_until(lambda: joined(stub, "ff-sealed", "ff-secret-0123456789") == 1, 15, "the sealing join never waited")
            start = time.monotonic()
            with pytest.raises(PermissionDenied) as info:
                CommContext.join(servers["plain"], job_id="ff-sealed", world_size=2, timeout=TIMEOUT_S, progress_interval=0)
            assert time.monotonic() - start < FAST_S
        finally:
            first.cancel()
    assert str(info.value) == ("PERMISSION_DENIED: job 'ff-sealed' is sealed: this join's job_secret is missing or wrong "
                               "(job_secret= or COMMCTX_JOB_SECRET)")


def test_the_torchrun_handler_fails_at_once_too(servers, monkeypatch):
    """The agent's handler joins through the same session: torch's RendezvousConnectionError, the same line."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    handler = get_rendezvous_handler(RendezvousParameters(
        backend="commctx", endpoint=servers["tls"], run_id="ff-torchrun", min_nodes=1, max_nodes=1,
        local_addr="127.0.0.1", nproc_per_node=1, join_timeout=TIMEOUT_S))
    try:
        start = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="speaks TLS and this client does not: set tls_ca= or COMMCTX_TLS_CA"):
            handler.next_rendezvous()
        assert time.monotonic() - start < FAST_S
    finally:
        handler.shutdown()


# -- what may heal is retried until the timeout -----------------------------------------------------


def unreachable_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "commctx" and r.levelno == logging.WARNING
            and "cannot reach the rendezvous server" in r.getMessage()]


@pytest.fixture
def warn_early(monkeypatch, caplog):
    from commctx import session as session_module

    monkeypatch.setattr(session_module, "UNREACHABLE_WARN_AFTER_S", 0.5)
    monkeypatch.setattr(session_module, "UNREACHABLE_WARN_EVERY_S", 30.0)
    caplog.set_level(logging.WARNING, logger="commctx")


@contextlib.contextmanager
def closing_port():
    """A port that accepts every connection and closes it at once, as a server going away does."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # accept() fails now (Linux)
        listener.close()
        thread.join(5)


@pytest.mark.parametrize("kind", ["refused", "closes at once", "closes at once, TLS client"])
def test_what_may_heal_is_retried_until_the_timeout(kind, warn_early, caplog, pki):
    with contextlib.ExitStack() as stack:
        address = f"127.0.0.1:{closed_port()}" if kind == "refused" else stack.enter_context(closing_port())
        tls = tls_files(pki, "ca") if "TLS" in kind else {}
        start = time.monotonic()
        with pytest.raises(ServerUnavailable) as info:
            CommContext.join(address, job_id="ff-heal", world_size=2, timeout=2.5, share_host=False,
                             progress_interval=0, **tls)
        elapsed = time.monotonic() - start
    assert type(info.value) is ServerUnavailable, info.value  # not a ConnectionMismatch
    assert 2.0 <= elapsed < 10, elapsed
    assert f"no answer from rendezvous server {address} within 2.5 s" in str(info.value)
    warnings = unreachable_warnings(caplog)
    assert warnings and all(w.startswith(f"cannot reach the rendezvous server at {address} for ") for w in warnings), warnings


def test_a_name_that_does_not_resolve_is_waited_for_until_the_timeout(warn_early, caplog):
    """A Kubernetes headless Service's name resolves only once its pod is ready: not an error at once."""
    start = time.monotonic()
    with pytest.raises(ServerUnavailable) as info:
        CommContext.join("no-such-host.invalid:50051", job_id="ff-dns", world_size=2, timeout=2.5, progress_interval=0)
    elapsed = time.monotonic() - start
    assert 2.0 <= elapsed < 10, elapsed
    assert type(info.value) is ServerUnavailable
    assert str(info.value).startswith("UNAVAILABLE: cannot reach rendezvous server no-such-host.invalid:50051: host "
                                      "'no-such-host.invalid' did not resolve within 2.5 s ("), info.value
    assert str(info.value).endswith("; check server_addr= or COMMCTX_SERVER")
    warnings = unreachable_warnings(caplog)
    assert len(warnings) == 1, warnings  # the next would be 30 s later
    assert re.fullmatch(r"cannot reach the rendezvous server at no-such-host\.invalid:50051 for [01] s \(host "
                        r"'no-such-host\.invalid' does not resolve: .+\); still trying for [12] s", warnings[0]), warnings


def test_a_name_that_resolves_late_is_used_once_it_does(monkeypatch):
    from commctx import lifecycle, netif

    real = socket.getaddrinfo
    ready_at = time.monotonic() + 0.6

    def getaddrinfo(host, port, *args, **kwargs):
        if host == "late.invalid":
            if time.monotonic() < ready_at:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            host = "127.0.0.1"
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(netif.socket, "getaddrinfo", getaddrinfo)
    with pytest.raises(ServerUnavailable, match="host 'late.invalid'"):  # without a timeout: at once, as before
        lifecycle.advertised_address("late.invalid:50051", None)
    start = time.monotonic()
    assert lifecycle.advertised_address("late.invalid:50051", None, timeout_s=10) == "127.0.0.1"
    assert 0.3 <= time.monotonic() - start < 5


# -- a failover names where it goes ----------------------------------------------------------------


def test_the_join_warning_names_the_replica_it_tries_next(warn_early, caplog):
    from commctx.session import Session

    a, b = f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}"
    session = Session(f"{a},{b}")
    try:
        with pytest.raises(ServerUnavailable):
            session.join(join_request("ff-replicas", 2), 2.0)
    finally:
        session.close(leave=False)
    warnings = unreachable_warnings(caplog)
    assert warnings, caplog.text
    first = warnings[0]
    other = {a: b, b: a}[first.split(" at ", 1)[1].split(" ", 1)[0]]
    assert first.endswith(f", next at {other}"), first


def test_the_session_warning_names_the_replica_it_moves_to(caplog):
    """A placed member whose leader dies: the warning names the replica that failed and the one the session moves to."""
    from commctx.session import Session

    caplog.set_level(logging.WARNING, logger="commctx")
    leader = Server("127.0.0.1", "--http-port", "0")
    dead = f"127.0.0.1:{closed_port()}"
    session = Session(f"{leader.address},{dead}")
    try:
        session.join(join_request("ff-failover", 1), 20.0, progress_s=0)
        time.sleep(1.5)  # time that must pass, not a wait for something: a stream over 1 s old moves to the next replica at once
        leader.kill()
        said = wait_until(lambda: [r.getMessage() for r in caplog.records if "unreachable (" in r.getMessage()],
                          what="the session's warning")
    finally:
        session.close(leave=False)
        leader.stop()
    assert said == [f"rendezvous server {dead} unreachable (UNAVAILABLE); the job keeps running, and the session moves to "
                    f"{leader.address} (then the other replicas in turn) until the leader answers"], said


# -- Ctrl-C in a waiting join ----------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, signal, sys, threading, time
    from commctx import CommContext

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal (a suite run in the background ignores it)
    print("joining", flush=True)
    try:
        CommContext.join(sys.argv[1], job_id=sys.argv[2], world_size=2, timeout=60, progress_interval=0,
                         share_host=sys.argv[3] == "1")
    except KeyboardInterrupt:
        deadline = time.monotonic() + 5  # the withdrawal's threads end: joined, one after the other, within 5 s
        while (left := [t for t in threading.enumerate() if t.name.startswith("commctx")]) and time.monotonic() < deadline:
            left[0].join(deadline - time.monotonic())
        print(json.dumps([t.name for t in threading.enumerate() if t.name.startswith("commctx")]), flush=True)
        sys.stdin.readline()  # the test looks at the server meanwhile
        raise  # as an uncaught Ctrl-C: the interpreter prints the traceback and ends by SIGINT
""")


def joined(stub: pb_grpc.RendezvousStub, job_id: str, job_secret: str = "") -> int:
    try:
        return stub.DescribeJob(pb.DescribeJobRequest(job_id=job_id, job_secret=job_secret), timeout=5).joined
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:  # the job went with its last member
            return 0
        raise


@pytest.mark.slow(8)
@pytest.mark.parametrize("share_host", ["1", "0"], ids=["host membership", "own membership"])
def test_ctrl_c_in_a_waiting_join_withdraws_it_without_grpc_frames(share_host, tmp_path):
    server = Server("127.0.0.1", "--http-port", "0")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    job = f"ff-ctrl-c-{share_host}"
    child = subprocess.Popen([sys.executable, str(script), server.address, job, share_host], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.RendezvousStub(channel)
            assert child.stdout.readline().strip() == "joining"
            def waiting() -> bool:
                assert child.poll() is None, "the child never waited in its join"
                return joined(stub, job) == 1

            wait_until(waiting, 30, "the child never waited in its join")
            child.send_signal(signal.SIGINT)
            interrupted = time.monotonic()
            threads = json.loads(child.stdout.readline() or "null")
            assert time.monotonic() - interrupted < 8
            assert threads == [], threads  # no session, hub or progress thread left behind
            assert joined(stub, job) == 0  # withdrawn by the client, while its process lives on
        child.stdin.close()
        child.wait(10)
        stderr = child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        server.stop()
    assert child.returncode == -signal.SIGINT, (child.returncode, stderr)
    lines = stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[-1] == (
        f"KeyboardInterrupt: while joining job {job!r} at {server.address}: the join was withdrawn"), stderr
    for internal in ("_channel.py", "cygrpc", "threading.py", "grpc"):
        assert internal not in stderr, stderr


# -- without torch ---------------------------------------------------------------------------------


def test_commctx_without_torch_says_what_to_install():
    code = "import sys; sys.modules['torch'] = None\nimport commctx; commctx.ServerUnavailable\nfrom commctx import CommContext"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env())
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: commctx.CommContext needs torch, which is not installed: install the worker extra, "
        "pip install 'commctx[worker]' (it keeps a torch already installed; for a CPU-only one, install torch from "
        "PyTorch's CPU index first)"), done.stderr
    assert "No module named 'torch'" not in done.stderr and "halted" not in done.stderr
    direct = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None\nimport commctx._torch"],
                            capture_output=True, text=True, timeout=60, env=clean_env())
    assert "needs torch, which is not installed: install the worker extra" in direct.stderr.splitlines()[-1], direct.stderr
