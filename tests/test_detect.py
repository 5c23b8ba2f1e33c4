"""Failure seen at the speed of the connection, over a real server: a session
the client ends without a Leave is a departure after the reconnect grace; one
reopened within it keeps its seat and nobody hears; a member holds one session;
and the ends the server causes (connection age, draining) remove nobody.

The lease here is 30 s, far longer than any wait below, so a departure these
tests see came through the grace, not the lease."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import StatusCode as Code

from commctx.server import start_server
from commctx.server.rendezvous.model import Limits
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .conftest import consistently, eventually
from .conftest import join_request as _join_request
from .test_protocol import next_event

pytestmark = pytest.mark.timeout(60)
TTL = 30.0
GRACE = 1.0


class Member:
    """A joined member over a raw stub, with its session stream read into a queue
    (a cancelled read would cancel the whole call)."""

    def __init__(self, stub: pb_grpc.RendezvousStub, joined: pb.JoinResponse, job: str) -> None:
        self.stub, self.joined, self.job = stub, joined, job
        self.call: grpc.aio.StreamStreamCall | None = None
        self.events: asyncio.Queue = asyncio.Queue()  # SessionEvents, then the AioRpcError or EOF that ended the call
        self._readers: list[asyncio.Task] = []

    def request(self, generation: int = 1, **kw) -> pb.SessionRequest:
        return pb.SessionRequest(job_id=self.job, member_id=self.joined.member_id, member_secret=self.joined.member_secret,
                                 generation=generation, **kw)

    async def open(self, generation: int = 1, spare_port: int = 0) -> asyncio.Queue:
        """Opens a session; returns the queue its events (after the lease) go to."""
        call = self.stub.Session()
        await call.write(self.request(generation, spare_port=spare_port))
        assert (await next_event(call)).lease_ttl_ms == TTL * 1000
        self.call, self.events = call, asyncio.Queue()
        self._readers.append(asyncio.ensure_future(self._read(call, self.events)))
        return self.events

    @staticmethod
    async def _read(call: grpc.aio.StreamStreamCall, events: asyncio.Queue) -> None:
        try:
            while (event := await call.read()) is not grpc.aio.EOF:
                events.put_nowait(event)
            events.put_nowait(grpc.aio.EOF)
        except grpc.aio.AioRpcError as exc:
            events.put_nowait(exc)

    async def next(self, queue: asyncio.Queue | None = None, timeout_s: float = 10.0):
        return await asyncio.wait_for((queue or self.events).get(), timeout_s)

    async def silent(self, for_s: float) -> bool:
        """Whether nothing arrives on the session for `for_s` seconds."""
        try:
            await asyncio.wait_for(self.events.get(), for_s)
        except asyncio.TimeoutError:
            return True
        return False

    def close(self) -> None:
        for task in self._readers:
            task.cancel()


def join_request(job: str, n: int, node: str, i: int, spec: pb.JobSpec) -> pb.JoinRequest:
    r = _join_request(job, n, node, i)
    r.spec.CopyFrom(spec)
    return r


async def world(stub: pb_grpc.RendezvousStub, job: str, n: int = 3) -> list[Member]:
    """A formed elastic world of n (min 1): a lost member re-forms it, so news is observable."""
    spec = pb.JobSpec(world_size=n, elastic=pb.Elastic(min_size=1, last_call_ms=10_000))  # forms at n at once
    requests = [join_request(job, n, f"n{i}", i, spec=spec) for i in range(n)]
    joined = await asyncio.gather(*(stub.Join(r) for r in requests))
    members = sorted((Member(stub, j, job) for j in joined), key=lambda m: m.joined.assignment.rank)
    for i, m in enumerate(members):
        await m.open(spare_port=41000 + i)  # rank 0 offers a new spare, so the next world can form at once
    return members


@pytest.fixture
def members():
    """Closes the session readers a test made."""
    made: list[Member] = []
    yield made
    for m in made:
        m.close()


async def describe(stub: pb_grpc.RendezvousStub, job: str) -> pb.JobDescription:
    return await stub.DescribeJob(pb.DescribeJobRequest(job_id=job))


@pytest.fixture
async def stub():
    server = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, reconnect_grace_s=GRACE)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield pb_grpc.RendezvousStub(channel)
    finally:
        await server.stop(0)


async def test_a_session_cancelled_without_leave_is_a_departure_after_the_grace(stub, members):
    members += (trio := await world(stub, "crash"))
    a, b, c = trio
    c.call.cancel()  # as the OS does for a killed process: the stream is reset
    for survivor in (a, b):
        news = (await survivor.next()).assignment  # the survivors renewed lately: one message each
        assert news.generation == 2 and news.world_size == 2
        assert f"member {c.joined.member_id} (node 'n2', rank 2) disconnected: session closed without leave" == news.reason
    assert (await describe(stub, "crash")).joined == 2


async def test_a_stream_broken_and_reopened_within_the_grace_keeps_its_seat_and_nobody_hears(stub, members):
    members += (trio := await world(stub, "blip"))
    a, b, c = trio
    for _ in range(3):  # a transient network error, three times over
        c.call.cancel()
        await asyncio.sleep(0.05)  # the scenario, not a wait for something: the client's backoff before it reconnects
        await c.open()
    assert await a.silent(GRACE + 1.0) and await b.silent(0.1)
    job = await describe(stub, "blip")
    assert (job.generation, job.joined, job.state) == (1, 3, pb.JobDescription.FORMED)


async def test_a_stale_or_foreign_session_does_not_save_a_detached_member(stub, members):
    members += (trio := await world(stub, "stale"))
    a, b, c = trio
    c.call.cancel()
    stale = stub.Session()
    await stale.write(c.request(generation=0))  # older than the generation its sessions held
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stale.read()
    assert refused.value.code() is Code.FAILED_PRECONDITION and "holds generation 1" in refused.value.details()
    foreign = stub.Session()
    await foreign.write(pb.SessionRequest(job_id="stale", member_id=c.joined.member_id, member_secret="ab" * 16,
                                          generation=1))
    assert (await next_event(foreign)).gone  # a wrong secret: told gone, as an unknown member is
    news = (await a.next()).assignment
    assert news.generation == 2 and "disconnected" in news.reason


async def test_a_newer_session_ends_the_older_which_is_no_departure(stub, members):
    members += (trio := await world(stub, "twice"))
    a, b, c = trio
    older = c.events
    await c.open()
    replaced = await c.next(older)
    assert replaced.code() is Code.ABORTED and "opened a newer session" in replaced.details()
    assert await a.silent(GRACE + 1.0)
    assert (await describe(stub, "twice")).generation == 1
    c.call.cancel()  # the newer one's end is a departure, as any
    assert "disconnected" in (await a.next()).assignment.reason


async def test_a_flood_of_sessions_for_one_member_holds_one_stream():
    server = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, reconnect_grace_s=GRACE)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.RendezvousStub(channel)
            (a,) = await world(stub, "flood", 1)
            try:
                queues = [await a.open() for _ in range(50)]
                for events in queues[:-1]:
                    assert (await a.next(events)).code() is Code.ABORTED
                assert server.servicer.open_sessions == 1
                assert (await describe(stub, "flood")).generation == 1
            finally:
                a.close()
    finally:
        await server.stop(0)


async def test_connections_cut_at_their_age_remove_nobody():
    """GOAWAY at the connection's age, then the stream is cut: a server-side end.
    The real client reconnects within the grace and keeps its seat."""
    from commctx.session import Session

    server = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, reconnect_grace_s=GRACE,
                                limits=Limits(max_connection_age_s=0.5, max_join_wait_s=0.5))
    sessions = [Session(f"127.0.0.1:{server.port}") for _ in range(3)]
    try:
        spec = pb.JobSpec(world_size=3, elastic=pb.Elastic(min_size=1, last_call_ms=10_000))
        joins = [asyncio.to_thread(s.join, join_request("aged", 3, f"n{i}", i, spec=spec), 20) for i, s in enumerate(sessions)]
        await asyncio.gather(*joins)
        def cut() -> float:  # connections are cut every 2 s (age 0.5 s, + the longest Join wait + 1 s for calls in flight)
            return server.telemetry.registry.get_sample_value("commctx_session_ends_total", {"how": "cancelled"}) or 0.0

        before = cut()
        await eventually(lambda: cut() >= before + 6, 20, "the connections were not cut")  # every session cut twice, and reconnected
        def seated() -> bool:
            job = server.machine.describe("aged")
            return (job.generation, job.joined) == (1, 3) and all(s.world_change is None for s in sessions)

        # Time that must pass: past the grace of the last cut, asked throughout, nobody is removed or told of a change.
        await consistently(seated, GRACE + 0.5, "the world of 3 at generation 1, no session told of a change")
        job = server.machine.describe("aged")
        assert (job.generation, job.joined) == (1, 3)
        assert all(s.world_change is None for s in sessions)
    finally:
        for s in sessions:
            await asyncio.to_thread(s.close)
        await server.stop(0)


async def test_a_draining_server_removes_nobody(tmp_path):
    """SIGTERM's drain cancels every stream after its grace: the members are
    restored by the next server on the same store, every one of them."""
    from commctx.server.rendezvous.sqlite import SqliteStore

    server = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, reconnect_grace_s=GRACE, store=SqliteStore(tmp_path))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        members = await world(pb_grpc.RendezvousStub(channel), "drain")
        await server.stop(0.2)  # the streams are still open: they are cut when the grace ends
        for m in members:
            m.close()
    server = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, reconnect_grace_s=GRACE, store=SqliteStore(tmp_path))
    try:
        view = server.machine.describe("drain")
        assert (view.generation, view.joined) == (1, 3)
    finally:
        await server.stop(0)
