"""The HTTP server over a real server on port 0, at the HTTP level: the JSON
API's answers and errors, access with --auth-tokens, sealed jobs, the event
stream, and what idle connections cost (no threads). The pages themselves are
driven in a real browser by tests/test_dashboard.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from commctx.server import start_server
from commctx.server.tokens import Callers
from commctx.server.web import WebServer
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .conftest import eventually, join_request
from .test_detect import GRACE, TTL, world

pytestmark = pytest.mark.timeout(90)
ADMIN, USER = "admin-token-0123456789", "user-token-0123456789"


def get(url: str, token: str | None = None, timeout: float = 10) -> tuple[int, dict | str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if r.headers.get_content_type() == "application/json" else body
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


async def aget(url: str, token: str | None = None) -> tuple[int, dict | str]:
    return await asyncio.to_thread(get, url, token)


@pytest.fixture
async def web():
    server = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, reconnect_grace_s=GRACE, http_port=0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server, pb_grpc.RendezvousStub(channel), f"http://127.0.0.1:{server.http_port}"
    await server.stop(0)


async def test_jobs_a_job_and_its_events(web):
    server, stub, base = web
    members = await world(stub, "shown")
    status, jobs = await aget(f"{base}/api/v1/jobs")
    assert status == 200 and jobs["next_page_token"] == ""
    (job,) = jobs["jobs"]
    assert (job["job_id"], job["state"], job["generation"], job["joined"], job["world_size"], job["num_nodes"]) == (
        "shown", "formed", 1, 3, 3, 3)
    assert job["last_event"]["kind"] == "formed"
    status, detail = await aget(f"{base}/api/v1/jobs/shown")
    assert status == 200
    assert [(n["node_key"], n["node_rank"], [(w["local_rank"], w["rank"]) for w in n["workers"]]) for n in detail["nodes"]] == [
        ("n0", 0, [(0, 0)]), ("n1", 1, [(0, 1)]), ("n2", 2, [(0, 2)])]
    assert {w["lease"] for n in detail["nodes"] for w in n["workers"]} == {"renewing"}  # their sessions renewed
    assert {g["mode"]: g["count"] for g in detail["groups"]} == {"GLOBAL": 1, "INTRA_NODE": 3, "INTER_NODE": 1}
    assert [e["kind"] for e in detail["events"]] == ["joined", "formed"]
    status, page = await aget(f"{base}/api/v1/jobs/shown/events?after=1")
    assert status == 200 and [e["seq"] for e in page["events"]] == [2]
    for m in members:
        m.close()


async def test_errors_are_clear_and_never_interpreted(web):
    server, stub, base = web
    await world(stub, "ok", 1)
    for path, code, words in (
            ("/api/v1/jobs/nope", 404, "no job 'nope' on this server"),
            ("/api/v1/jobs/..%2F..%2Fetc", 400, "job_id"),
            ("/api/v1/jobs/%3Cscript%3E", 400, "job_id"),
            ("/api/v1/jobs?page_size=x", 400, "page_size 'x'"),
            ("/api/v1/jobs/ok/events?after=-1", 400, "after '-1'"),
            ("/static/../../etc/passwd", 404, ""),
            ("/static/secret.py", 404, "no asset")):
        status, body = await aget(base + path)
        assert status == code and words in body["error"], (path, status, body)
    status, capped = await aget(f"{base}/api/v1/jobs?page_size=1000000")  # a huge page is capped, not refused
    assert status == 200 and capped["jobs"][0]["job_id"] == "ok"


async def test_a_sealed_job_is_shown_only_by_id_and_state(web):
    server, stub, base = web
    joining = asyncio.ensure_future(stub.Join(join_request("secret", 2, job_secret="s3cret-of-16-chars")))
    await eventually(lambda: "secret" in server.machine.job_ids())
    _, jobs = await aget(f"{base}/api/v1/jobs")
    assert jobs["jobs"] == [{"job_id": "secret", "run": 1, "state": "forming", "sealed": True, "ended_at": None}]
    for path in ("/api/v1/jobs/secret", "/api/v1/jobs/secret/events", "/api/v1/jobs/secret/events/stream"):
        status, body = await aget(base + path)
        assert status == 403 and "sealed" in body["error"], path
    joining.cancel()


async def test_tokens_guard_every_api_path_but_not_metrics_or_the_pages(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} admin\n{USER}\n")
    server = await start_server("127.0.0.1", 0, http_port=0, callers=Callers(tokens))
    base = f"http://127.0.0.1:{server.http_port}"
    try:
        for path in ("/api/v1/jobs", "/api/v1/jobs/x", "/api/v1/jobs/x/events", "/api/v1/jobs/x/events/stream"):
            for token in (None, USER, "wrong"):
                status, body = await aget(base + path, token)
                assert status == 401 and "admin token" in body["error"], (path, token)
        assert (await aget(f"{base}/api/v1/jobs", ADMIN))[0] == 200
        assert (await aget(f"{base}/api/v1/server"))[1]["auth"] is True
        status, metrics = await aget(f"{base}/metrics")  # open, as the health service is
        assert status == 200 and "commctx_active_jobs" in metrics
        status, page = await aget(f"{base}/")
        assert status == 200 and "<html" in page  # the pages hold no job data: the API does
    finally:
        await server.stop(0)


async def test_the_event_stream_follows_the_job_until_it_is_gone(web):
    server, stub, base = web
    a, b = await world(stub, "streamed", 2)
    got: list[str] = []
    done = threading.Event()

    def read() -> None:
        with urllib.request.urlopen(f"{base}/api/v1/jobs/streamed/events/stream", timeout=30) as r:
            assert r.headers.get_content_type() == "text/event-stream"
            for line in r:
                got.append(line.decode().rstrip("\n"))
                if line.startswith(b"event: end"):
                    break
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    await eventually(lambda: sum(1 for line in got if line.startswith("id: ")) == 2)  # the kept ones first
    b.call.cancel()  # its world re-forms without it: the stream carries it as it happens
    await eventually(lambda: any('"kind":"lost"' in line.replace(" ", "") for line in got), 15)
    await stub.Leave(pb.LeaveRequest(job_id="streamed", member_id=a.joined.member_id, member_secret=a.joined.member_secret))
    for m in (a, b):  # b is gone already; a's leave empties the job
        m.close()
    await asyncio.to_thread(done.wait, 15)
    assert got[-1] == "event: end"
    ids = [int(line[4:]) for line in got if line.startswith("id: ")]
    assert ids == sorted(ids) and ids[0] == 1


async def test_idle_connections_cost_no_threads_and_metrics_still_answer(web):
    server, stub, base = web
    server.web.connections.peer_connections = 1000  # all from this one peer (tests/test_http_fair.py caps it)
    threads = threading.active_count()
    idle = await asyncio.to_thread(lambda: [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(300)])
    try:
        await eventually(lambda: len(server.web._runner.server.connections) == 300)  # noqa: SLF001 - all accepted
        assert threading.active_count() - threads <= 20
        status, metrics = await aget(f"{base}/metrics")
        assert status == 200 and "commctx_active_jobs" in metrics
    finally:
        for s in idle:
            s.close()


async def test_connections_beyond_the_cap_are_closed_and_idle_ones_time_out(monkeypatch):
    monkeypatch.setattr(WebServer, "MAX_CONNECTIONS", 5)
    monkeypatch.setattr(WebServer, "IDLE_S", 1.0)
    server = await start_server("127.0.0.1", 0, http_port=0)
    connect = lambda: socket.create_connection(("127.0.0.1", server.http_port), timeout=10)  # noqa: E731
    held = await asyncio.to_thread(lambda: [connect() for _ in range(5)])
    try:
        await eventually(lambda: len(server.web._runner.server.connections) == 5)  # noqa: SLF001
        extra = await asyncio.to_thread(connect)
        refused = await asyncio.to_thread(extra.recv, 4096)  # answered and closed as it came
        assert refused.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and b"(--http-max-connections)" in refused
        extra.close()
        assert await asyncio.to_thread(held[0].recv, 1) == b""  # and an idle one is closed after IDLE_S
    finally:
        for s in held:
            s.close()
        await server.stop(0)
