"""A job's history over a real server: ListEvents pages it, WatchEvents
follows it as it happens, `commctx events` prints it, a sealed job's needs its
secret, it survives a restart on SQLite, a reader that falls behind is cut
off; and a waiting worker says who it waits for, refusals included."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import threading

import grpc
import pytest
from grpc import StatusCode as Code

from commctx.server import start_server
from commctx.server.rendezvous.watching import Watchers
from commctx.server.rendezvous.sqlite import SqliteStore
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import clean_env, forked_run
from .conftest import eventually, join_request
from .test_detect import GRACE, TTL, world

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def server():
    s = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, reconnect_grace_s=GRACE)
    yield s
    await s.stop(0)


@pytest.fixture
async def stub(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.RendezvousStub(channel)


async def listed(stub, job: str, page_size: int = 0, **kw) -> list[pb.JobEvent]:
    events, token = [], ""
    while True:
        page = await stub.ListEvents(pb.ListEventsRequest(job_id=job, page_size=page_size, page_token=token, **kw))
        events += page.events
        token = page.next_page_token
        if not token:
            return events


async def test_a_jobs_life_is_listed_and_watched_as_it_happens(stub):
    a, b, c = await world(stub, "life")
    watch = stub.WatchEvents(pb.WatchEventsRequest(job_id="life"))
    seen = [await watch.read(), await watch.read()]  # the kept ones first
    assert [e.kind for e in seen] == ["joined", "formed"]
    c.call.cancel()  # killed: its world re-forms without it after the grace
    while seen[-1].kind != "formed" or seen[-1].generation != 2:
        seen.append(await asyncio.wait_for(watch.read(), 15))
    assert [e.kind for e in seen] == ["joined", "formed", "lost", "reforming", "formed"]
    lost = seen[2]
    assert dict(lost.fields) == {"member": c.joined.member_id, "node": "n2", "rank": 2.0, "why": "disconnected"}
    assert "disconnected: session closed without leave" in lost.message
    assert [e.seq for e in seen] == [1, 2, 3, 4, 5] and all(seen[i].time <= seen[i + 1].time for i in range(4))
    assert [e.seq for e in await listed(stub, "life", page_size=2)] == [1, 2, 3, 4, 5]  # paged
    page = await stub.ListEvents(pb.ListEventsRequest(job_id="life", page_size=2, page_token="3"))
    assert [e.seq for e in page.events] == [4, 5] and page.next_page_token == ""
    for m in (a, b):  # the job finishes: its events end with it, then the watch ends
        m.call.cancel()
        await m.stub.Leave(pb.LeaveRequest(job_id="life", member_id=m.joined.member_id, member_secret=m.joined.member_secret))
    rest = []
    while (e := await asyncio.wait_for(watch.read(), 15)) is not grpc.aio.EOF:  # then it ends: the job is gone
        rest.append(e.kind)
    assert rest == ["left", "reforming", "formed", "left", "ended"]  # a Leave within the grace is a leave, not a loss
    kept = await listed(stub, "life")  # the run that finished keeps its history, and a watch of it ends at once
    assert [e.kind for e in kept] == ["joined", "formed", "lost", "reforming", "formed", "left", "reforming", "formed", "left",
                                      "ended"] and "the last to go" in kept[-1].message
    again = stub.WatchEvents(pb.WatchEventsRequest(job_id="life", after_seq=kept[-2].seq))
    assert [(await again.read()).seq, await again.read()] == [kept[-1].seq, grpc.aio.EOF]
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await stub.ListEvents(pb.ListEventsRequest(job_id="life", run=2))
    assert gone.value.code() is Code.NOT_FOUND and "has no run 2 kept" in gone.value.details()


async def test_bad_requests_and_a_sealed_job(server, stub):
    sealed = join_request("sealed", 2, job_secret="s3cret-of-16-chars")
    joining = asyncio.ensure_future(stub.Join(sealed))
    await eventually(lambda: "sealed" in server.machine.job_ids())
    for call in (stub.ListEvents(pb.ListEventsRequest(job_id="sealed")),
                 stub.WatchEvents(pb.WatchEventsRequest(job_id="sealed", job_secret="wrong-secret-16ch")).read()):
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await call
        assert denied.value.code() is Code.PERMISSION_DENIED and "sealed" in denied.value.details()
    opened = await listed(stub, "sealed", job_secret="s3cret-of-16-chars")
    assert [e.kind for e in opened] == ["joined"]
    for request, code, words in (
            (pb.ListEventsRequest(job_id="nope"), Code.NOT_FOUND, "no job 'nope'"),
            (pb.ListEventsRequest(job_id="sealed", page_size=5000), Code.INVALID_ARGUMENT, "page_size 5000"),
            (pb.ListEventsRequest(job_id="sealed", page_token="x1"), Code.INVALID_ARGUMENT, "page_token 'x1'"),
            (pb.ListEventsRequest(job_id="../etc"), Code.INVALID_ARGUMENT, "job_id")):
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.ListEvents(request)
        assert bad.value.code() is code and words in bad.value.details()
    joining.cancel()


async def test_a_refused_join_is_in_the_history_and_in_the_waiting_workers_progress_line(server, stub, caplog):
    from commctx.session import Session

    caplog.set_level(logging.INFO, logger="commctx")
    session = Session(f"127.0.0.1:{server.port}")
    waiting = threading.Thread(target=lambda: _join_quietly(session, join_request("ppo", 3, "vm", 0)), daemon=True)
    waiting.start()
    await eventually(lambda: "ppo" in server.machine.job_ids())
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Join(join_request("ppo", 4, "other", 1))
    assert refused.value.code() is Code.FAILED_PRECONDITION
    events = await listed(stub, "ppo")
    assert [e.kind for e in events] == ["joined", "refused"]
    assert "world_size=3 but this worker asked for world_size=4" in events[1].message
    await eventually(lambda: any("1 join refused" in r.getMessage() for r in caplog.records), 10)
    line = next(r.getMessage() for r in caplog.records if "1 join refused" in r.getMessage())
    assert line.startswith("waiting for job 'ppo': 1 of 3 workers (nodes: vm×1); 2 missing; 1 join refused: job 'ppo'"), line
    await asyncio.to_thread(session.close, leave=False)
    await asyncio.to_thread(waiting.join, 10)


def _join_quietly(session, request: pb.JoinRequest) -> None:
    try:
        session.join(request, 30, progress_s=0.2)
    except Exception:  # noqa: BLE001 - closed under it at the end of the test
        pass


@pytest.mark.slow
def test_a_waiting_worker_says_so_on_stderr_when_nothing_configured_logging(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(
        "import sys\n"
        "from commctx import CommContext, RendezvousTimeout\n"
        "try:\n"
        "    CommContext.join(sys.argv[1], job_id='alone', world_size=2, timeout=2.5, progress_interval=0.5)\n"
        "except RendezvousTimeout as exc:\n"
        "    print('timed out', file=sys.stderr)\n")

    async def run() -> subprocess.CompletedProcess:
        s = await start_server("127.0.0.1", 0)
        try:
            return await asyncio.to_thread(forked_run, [str(script), f"127.0.0.1:{s.port}"], clean_env(), 60)
        finally:
            await s.stop(0)

    done = asyncio.run(run())
    lines = [line for line in done.stderr.splitlines() if line.startswith("commctx: waiting for job 'alone'")]
    assert len(lines) >= 2 and "1 of 2 workers" in lines[0] and "1 missing" in lines[0], done.stderr
    assert "timed out" in done.stderr


async def test_the_history_survives_a_restart_on_sqlite(tmp_path):
    server = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, store=SqliteStore(tmp_path))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        members = await world(pb_grpc.RendezvousStub(channel), "kept")
        before = await listed(pb_grpc.RendezvousStub(channel), "kept")
        await server.stop(0)
        for m in members:
            m.close()
    server = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, store=SqliteStore(tmp_path))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            after = await listed(pb_grpc.RendezvousStub(channel), "kept")
        assert [(e.seq, e.kind, e.message, e.time) for e in after] == [(e.seq, e.kind, e.message, e.time) for e in before]
        assert [e.kind for e in after] == ["joined", "formed"]
    finally:
        await server.stop(0)


async def test_a_watcher_that_falls_behind_is_cut_off_naming_where_to_resume(server, stub, monkeypatch):
    monkeypatch.setattr(Watchers, "QUEUE", 0)  # the first event the reader has not taken yet is one too many
    joining = asyncio.ensure_future(stub.Join(join_request("slow", 2)))
    await eventually(lambda: "slow" in server.machine.job_ids())
    watch = stub.WatchEvents(pb.WatchEventsRequest(job_id="slow"))
    assert (await watch.read()).kind == "joined"
    await stub.Join(join_request("slow", 2, "n1", 1))  # an event that does not fit
    with pytest.raises(grpc.aio.AioRpcError) as cut:
        while True:
            await asyncio.wait_for(watch.read(), 10)
    assert cut.value.code() is Code.RESOURCE_EXHAUSTED and "watch again with after_seq 1" in cut.value.details()
    await joining


async def test_commctx_events_prints_and_follows(server, stub):
    addr = f"127.0.0.1:{server.port}"
    a, b, c = await world(stub, "cli")
    printed = await asyncio.to_thread(subprocess.run, ["commctx", "events", "--addr", addr, "--job", "cli", "--json"],
                                      capture_output=True, text=True, timeout=30)
    assert printed.returncode == 0, printed.stderr
    assert [json.loads(line)["kind"] for line in printed.stdout.splitlines()] == ["joined", "formed"]
    follow = subprocess.Popen(["commctx", "events", "--addr", addr, "--job", "cli", "--follow"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert "joined" in await asyncio.to_thread(follow.stdout.readline)
        assert "formed" in await asyncio.to_thread(follow.stdout.readline)
        c.call.cancel()
        lost = await asyncio.to_thread(follow.stdout.readline)
        assert " lost " in lost and "disconnected: session closed without leave" in lost
    finally:
        follow.kill()
        follow.wait()
    env = {**os.environ, "COMMCTX_SERVER": addr, "COMMCTX_PORT": "1"}  # the worker's variable wins over the server's
    for command in (["commctx", "status"], ["commctx", "health"]):
        answer = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=30, env=env)
        assert answer.returncode == 0 and ("cli" in answer.stdout or "SERVING" in answer.stdout), answer
    for m in (a, b):
        m.close()
