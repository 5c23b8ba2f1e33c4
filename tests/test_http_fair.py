"""The HTTP port shared fairly, each attack of issue 37 against a real server
process (tests/cluster.py) on port 0, with raw sockets where a browser or
curl would not misbehave so:

- one peer holding every connection it may (idle ones, and more) while another
  still gets /metrics, the pages and /api/v1/jobs; idle ones closed;
- a slowloris (a request's head dribbled) closed after --http-header-timeout-s;
- event streams beyond the caller's share of --max-streams, counted with its
  gRPC WatchEvents streams: 429 and a JSON error;
- every method on every path: 405 with Allow, 404, 400 for garbage, and not
  one line logged; the log limit that holds any event to a few lines a minute;
- mutual TLS: the JSON API closed to plain HTTP without tokens, open to admin
  tokens with them; SIGHUP swaps the client CA (the old CA's certificates are
  refused after it)."""

from __future__ import annotations

import http.client
import json
import logging
import os
import pathlib
import re
import select
import signal
import socket
import time

import grpc
import pytest

from commctx.server.main import LogLimit
from commctx.server.web.connections import AiohttpLog
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server
from .conftest import join_request, wait_until

pytestmark = pytest.mark.timeout(60)
ATTACKER, OTHER = "127.0.0.2", "127.0.0.1"  # two peers of one loopback server (Linux routes all of 127/8)


def http_port(server: Server) -> int:
    return int(server.http_url.rstrip("/").rsplit(":", 1)[1])


def connect(port: int, source: str = OTHER) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def get(port: int, path: str, method: str = "GET", source: str = OTHER,
        headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request(method, path, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, reply.headers, reply.read()
    finally:
        conn.close()


def closed_count(port: int, why: str) -> float:
    """commctx_http_connections_closed_total{why=...} as /metrics says it now (0 when never counted)."""
    status, _, body = get(port, "/metrics")
    assert status == 200
    found = re.search(rf'^commctx_http_connections_closed_total{{why="{why}"}} (\S+)$', body.decode(), re.M)
    return float(found.group(1)) if found else 0.0


def readable(s: socket.socket, timeout: float = 0.0) -> bool:
    return bool(select.select([s], [], [], timeout)[0])


def read_head(s: socket.socket) -> tuple[int, bytes]:
    """The status of the answer on `s` and what came with it (at least its head)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = re.search(rb"\r\nContent-Length: (\d+)", head)
    while length and len(rest) < int(length.group(1)):
        rest += s.recv(65536)
    return int(head.split(b" ", 2)[1]), data


def wait_closed(s: socket.socket, within_s: float) -> float:
    """Seconds until the server closes `s` (EOF or reset), reading what it sends; fails after `within_s`."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if readable(s, 0.05):
            try:
                if s.recv(65536) == b"":
                    return time.monotonic() - start
            except ConnectionError:
                return time.monotonic() - start
    raise AssertionError(f"still open after {within_s} s")


def test_one_peer_holding_every_connection_it_may_leaves_the_port_to_others():
    server = Server("127.0.0.1", "--http-peer-connections", "8", "--http-idle-timeout-s", "4", metrics=True)
    held: list[socket.socket] = []
    try:
        port = http_port(server)
        held = [connect(port, ATTACKER) for _ in range(8 + 12)]
        wait_until(lambda: closed_count(port, "refused_peer") >= 12, what="12 connections refused")
        refused = [s for s in held if readable(s)]
        assert len(refused) == 12  # the other 8 are held, silent
        for s in refused:
            status, data = read_head(s)
            assert status == 429 and json.loads(data.partition(b"\r\n\r\n")[2]) == {"error": (
                "peer 127.0.0.2 holds 8 of its 8 HTTP connections (--http-peer-connections); close some, or retry later")}
        # Another peer meanwhile: the pages, the API and the metrics all answer.
        assert get(port, "/")[0] == 200
        status, _, body = get(port, "/api/v1/jobs")
        assert status == 200 and json.loads(body) == {"jobs": [], "next_page_token": ""}
        assert closed_count(port, "idle") == 0  # ... while the 8 are still held
        assert closed_count(port, "refused_peer") == 12
        # The 8 silent ones are closed after --http-idle-timeout-s, and the peer may connect again.
        for s in held:
            if s not in refused:
                assert wait_closed(s, 4 + 5) > 0
        assert closed_count(port, "idle") == 8
        assert get(port, "/metrics", source=ATTACKER)[0] == 200
    finally:
        for s in held:
            s.close()
        server.stop()


def test_a_slowloris_is_closed_after_the_header_timeout_and_a_patient_client_is_not():
    server = Server("127.0.0.1", "--http-header-timeout-s", "1", "--http-idle-timeout-s", "30", metrics=True)
    try:
        port = http_port(server)
        quiet = connect(port)  # opened, nothing sent yet: idle (30 s), not slow
        slow = connect(port, ATTACKER)
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        started, closed_after = time.monotonic(), None
        while closed_after is None and time.monotonic() - started < 5:
            try:
                slow.sendall(b"X-Slow: 1\r\n")  # a header line every 0.1 s, the head never ending
            except OSError:
                closed_after = time.monotonic() - started
                break
            if readable(slow, 0.1):
                try:
                    assert slow.recv(65536) == b""
                except ConnectionError:
                    pass
                closed_after = time.monotonic() - started
        assert closed_after is not None and 0.8 <= closed_after <= 4.0, closed_after
        assert not readable(quiet)  # still open: the header timeout runs from a request's first byte
        quiet.sendall(b"GET /api/v1/server HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.3)  # the scenario, not a wait for something: a head sent slowly, within the timeout
        quiet.sendall(b"\r\n")  # its head complete within the timeout
        status, _ = read_head(quiet)
        assert status == 200
        quiet.close()
        assert closed_count(port, "slow_header") == 1 and closed_count(port, "idle") == 0
    finally:
        server.stop()


def open_stream(port: int, job: str, source: str = OTHER) -> tuple[socket.socket, int, bytes]:
    s = connect(port, source)
    s.sendall(f"GET /api/v1/jobs/{job}/events/stream HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status, data = read_head(s)
    return s, status, data


def test_event_streams_count_against_the_callers_stream_share_with_its_grpc_streams():
    # A share of 4 streams (8 x 0.5): one gRPC WatchEvents and three event streams of this peer fill it.
    server = Server("127.0.0.1", "--max-streams", "8", "--caller-share", "0.5", metrics=True)
    streams: list[socket.socket] = []
    channel = grpc.insecure_channel(server.address)
    try:
        port = http_port(server)
        stub = pb_grpc.RendezvousStub(channel)
        waiting = stub.Join.future(join_request("fair", 2, wait_timeout_ms=30_000))
        wait_until(lambda: get(port, "/api/v1/jobs/fair")[0] == 200, what="the job 'fair' there")
        watch = stub.WatchEvents(pb.WatchEventsRequest(job_id="fair"), timeout=30)
        assert next(watch).kind == "joined"  # open on the server
        for _ in range(3):
            s, status, data = open_stream(port, "fair")
            streams.append(s)
            assert status == 200
        s, status, data = open_stream(port, "fair")
        s.close()
        share = ("peer 127.0.0.1 holds 4 of its 4 open streams (a caller's share of the server's limit, --caller-share "
                 "of --max-streams); end some, or retry later")
        assert status == 429 and json.loads(data.partition(b"\r\n\r\n")[2]) == {"error": share}
        with pytest.raises(grpc.RpcError) as info:  # the same share refuses gRPC's streams too
            next(stub.WatchEvents(pb.WatchEventsRequest(job_id="fair"), timeout=10))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.details() == share
        s, status, _ = open_stream(port, "fair", ATTACKER)  # another peer: a share of its own
        streams.append(s)
        assert status == 200
        streams.pop(0).close()  # one stream ends: its share is given back at once
        def opened() -> bool:
            s, status, _ = open_stream(port, "fair")
            streams.append(s)
            return status == 200

        wait_until(opened, 5, "a stream of this peer's opened again", interval_s=0.05)
        watch.cancel()
        waiting.cancel()
    finally:
        for s in streams:
            s.close()
        channel.close()
        server.stop()


def stderr_of(server: Server) -> str:
    return pathlib.Path(server.stderr.name).read_text()


def test_every_method_and_path_answers_cleanly_and_nothing_is_logged():
    server = Server("127.0.0.1", metrics=True)
    try:
        port = http_port(server)
        assert get(port, "/metrics")[0] == 200
        before = stderr_of(server)
        for path in ("/", "/jobs/x", "/metrics", "/static/app.js", "/api/v1/server", "/api/v1/jobs",
                     "/api/v1/jobs/x", "/api/v1/jobs/x/events", "/api/v1/jobs/x/events/stream"):
            for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
                status, headers, body = get(port, path, method)
                assert (status, headers["Allow"], headers.get_content_type()) == (405, "GET,HEAD", "application/json")
                assert json.loads(body) == {"error": f"{method} is not allowed on {path}: GET, HEAD only"}
        for method in ("GET", "POST", "DELETE"):
            status, headers, body = get(port, "/no/such/path", method)
            assert status == 404 and json.loads(body) == {"error": "Not Found: /no/such/path"}
        # A flood of POSTs on one connection: each a 405, none logged (it was a 500 and two tracebacks each).
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for _ in range(500):
            conn.request("POST", "/metrics", body=b"")
            reply = conn.getresponse()
            reply.read()
            assert reply.status == 405
        conn.close()
        # Garbage, a header over 8 KiB, TLS to the plain port: 400 and closed, never a log line.
        for raw in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64), b"NOT HTTP AT ALL\r\n\r\n",
                    b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n"):
            s = connect(port)
            s.sendall(raw)
            status, _ = read_head(s)
            assert status == 400
            s.close()
        assert get(port, "/metrics")[0] == 200  # served throughout
        assert stderr_of(server) == before  # not one line, at any level the server logs
    finally:
        server.stop()


def test_the_log_limit_holds_each_event_to_a_few_lines_a_minute(caplog):
    now = [0.0]
    limit = LogLimit(clock=lambda: now[0])

    def record(msg: str, level: int = logging.ERROR) -> logging.LogRecord:
        return logging.LogRecord("commctx.server", level, __file__, 0, msg, (), None)

    assert sum(limit.filter(record("http_internal_error")) for _ in range(100)) == LogLimit.LINES
    assert limit.filter(record("store_failed"))  # another event: a limit of its own
    assert all(limit.filter(record("join", logging.INFO)) for _ in range(100))  # INFO: one line per membership event
    now[0] += LogLimit.WINDOW_S
    first = record("http_internal_error")
    assert limit.filter(first) and first.fields == {"held_back": 100 - LogLimit.LINES}
    # aiohttp's lines: a client's malformed request at DEBUG; anything else one line, no traceback.
    from aiohttp.http_exceptions import LineTooLong

    with caplog.at_level(logging.DEBUG, logger="commctx.server.http"):
        AiohttpLog().exception("Error handling request from %s", "192.0.2.1", exc_info=LineTooLong(b"x", "8190"))
        AiohttpLog().exception("Unhandled exception", exc_info=RuntimeError("boom"))
    (bad, bug) = [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records if r.name == "commctx.server.http"]
    assert bad[0] == "DEBUG"
    assert bug == ("ERROR", "http_error", None)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """PEM files: a CA that signed the server's certificate and client 'one', and a second CA that signed client 'two'."""
    import trustme

    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    files = {"ca": str(d / "ca.pem"), "other_ca": str(d / "other_ca.pem")}
    ca.cert_pem.write_to_path(files["ca"])
    other.cert_pem.write_to_path(files["other_ca"])
    for name, issuer, identity in (("server", ca, "127.0.0.1"), ("one", ca, "worker-1"), ("two", other, "worker-2")):
        cert = issuer.issue_cert(identity)
        files[name] = (b"".join(b.bytes() for b in cert.cert_chain_pems), cert.private_key_pem.bytes())
        with open(d / f"{name}.pem", "wb") as f:
            f.write(files[name][0])
        with open(d / f"{name}.key", "wb") as f:
            f.write(files[name][1])
        files[f"{name}_cert"], files[f"{name}_key"] = str(d / f"{name}.pem"), str(d / f"{name}.key")
    files["ca_pem"] = ca.cert_pem.bytes()
    return files


def describe(address: str, pki: dict, client: str) -> grpc.StatusCode:
    """What a DescribeJob of an unknown job gets over a new connection with `client`'s certificate:
    NOT_FOUND means the handshake admitted it."""
    chain, key = pki[client]
    credentials = grpc.ssl_channel_credentials(pki["ca_pem"], key, chain)
    with grpc.secure_channel(address, credentials, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            pb_grpc.RendezvousStub(channel).DescribeJob(pb.DescribeJobRequest(job_id="nope"), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_with_client_certificates_the_http_api_is_closed_unless_tokens_open_it(pki, tmp_path):
    tls = ("--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"], "--tls-client-ca", pki["ca"])
    server = Server("127.0.0.1", *tls, metrics=True)
    try:
        port = http_port(server)
        assert describe(server.address, pki, "one") == grpc.StatusCode.NOT_FOUND  # gRPC: certificates admit
        status, _, body = get(port, "/metrics")
        assert status == 200 and b"commctx_active_jobs" in body
        assert get(port, "/")[0] == 200  # the page itself holds no job data
        assert json.loads(get(port, "/api/v1/server")[2])["auth"] is False
        for path in ("/api/v1/jobs", "/api/v1/jobs/x", "/api/v1/jobs/x/events", "/api/v1/jobs/x/events/stream"):
            status, _, body = get(port, path)
            assert status == 403 and "--tls-client-ca" in json.loads(body)["error"]
            assert "--auth-tokens" in json.loads(body)["error"]
    finally:
        server.stop()
    tokens = tmp_path / "tokens"
    tokens.write_text("ops-token-0123456789 admin\n")
    server = Server("127.0.0.1", *tls, "--auth-tokens", str(tokens), metrics=True)
    try:
        port = http_port(server)
        assert get(port, "/api/v1/jobs")[0] == 401
        status, _, body = get(port, "/api/v1/jobs", headers={"Authorization": "Bearer ops-token-0123456789"})
        assert status == 200 and json.loads(body)["jobs"] == []
    finally:
        server.stop()


def test_sighup_swaps_the_client_ca_and_the_old_cas_certificates_are_refused(pki, tmp_path):
    ca_file = tmp_path / "client-ca.pem"
    ca_file.write_bytes(pathlib.Path(pki["ca"]).read_bytes())
    server = Server("127.0.0.1", "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                    "--tls-client-ca", str(ca_file))
    try:
        assert describe(server.address, pki, "one") == grpc.StatusCode.NOT_FOUND
        assert describe(server.address, pki, "two") == grpc.StatusCode.UNAVAILABLE

        def hup(line: str) -> None:
            server.popen.send_signal(signal.SIGHUP)
            wait_until(lambda: line in stderr_of(server), what=lambda: stderr_of(server))

        ca_file.write_bytes(pathlib.Path(pki["other_ca"]).read_bytes())
        hup("tls_reloaded")
        assert describe(server.address, pki, "one") == grpc.StatusCode.UNAVAILABLE  # the old CA's: refused
        assert describe(server.address, pki, "two") == grpc.StatusCode.NOT_FOUND
        ca_file.write_text("not a CA bundle\n")  # a bundle that does not load changes nothing
        hup("tls_not_reloaded")
        assert describe(server.address, pki, "two") == grpc.StatusCode.NOT_FOUND
        assert describe(server.address, pki, "one") == grpc.StatusCode.UNAVAILABLE
        assert "Handshake failed" not in stderr_of(server)  # gRPC core's line per refused handshake: off
    finally:
        server.stop()
