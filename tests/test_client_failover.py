"""Clients find the leader of a highly available server: replicas that are not
the leader answer every call UNAVAILABLE with reason NOT_LEADER and, when they
know it, the leader's address (ErrorInfo metadata "leader").

The replicas here are fakes (grpc.aio servers on loopback) whose role each test
sets; the client code under test is blocking, so it runs in a thread while the
fakes answer in the test's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_status import rpc_status

from commctx import transport
from commctx.channels import Endpoints, LeaderStub, Tls
from commctx.cli import main
from commctx.errors import ServerUnavailable
from commctx.session import Session
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .conftest import eventually

pytestmark = pytest.mark.timeout(60)

TTL_MS = 1500
NAME = "replicas.test"  # a reserved name (RFC 6761), resolved here by a patched getaddrinfo


class Replica(pb_grpc.RendezvousServicer):
    """One replica: the leader (hint None) or a follower naming the leader ("": it does not know)."""

    def __init__(self, hint: str | None = None) -> None:
        self.hint = hint
        self.joins: list[pb.JoinRequest] = []
        self.renewals: list[tuple[float, pb.SessionRequest]] = []
        self.keepalives: list[pb.KeepAliveRequest] = []
        self.leaves: list[pb.LeaveRequest] = []
        self.listed = 0
        self._demoted = asyncio.Event()  # ends the sessions this replica holds
        self.server: grpc.aio.Server | None = None
        self.health = health_aio.HealthServicer()
        self.address = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0,
                    credentials: grpc.ServerCredentials | None = None) -> Replica:
        self.server = grpc.aio.server()
        pb_grpc.add_RendezvousServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        target = f"{host}:{port}"
        bound = self.server.add_secure_port(target, credentials) if credentials else self.server.add_insecure_port(target)
        self.address = f"{host}:{bound}"
        await self.server.start()
        await self._set_health()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    async def follow(self, leader: str) -> None:
        """Becomes a follower naming `leader` ("": unknown); the sessions it holds end NOT_LEADER."""
        self.hint = leader
        demoted, self._demoted = self._demoted, asyncio.Event()
        demoted.set()
        await self._set_health()

    async def lead(self) -> None:
        self.hint = None
        await self._set_health()

    async def _set_health(self) -> None:
        rendezvous = health_pb2.HealthCheckResponse.SERVING if self.hint is None else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("commctx.v1.Rendezvous", rendezvous)

    def _not_leader(self) -> grpc.Status:
        info = any_pb2.Any()
        info.Pack(error_details_pb2.ErrorInfo(domain="commctx", reason="NOT_LEADER",
                                              metadata={"leader": self.hint} if self.hint else {}))
        return rpc_status.to_status(status_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0],
                                                      message="this replica is not the leader", details=[info]))

    async def Join(self, request, context):
        self.joins.append(request)
        if self.hint is not None:
            await context.abort_with_status(self._not_leader())
        a = pb.Assignment(job_id=request.job_id, generation=1, rank=0, world_size=1, node_rank=0, num_nodes=1,
                          local_rank=0, local_world_size=1, master_addr="127.0.0.1", master_port=request.master_port,
                          dist_url=f"tcp://127.0.0.1:{request.master_port}")
        return pb.JoinResponse(member_id=request.member_id, lease_ttl_ms=TTL_MS, assignment=a)

    async def Session(self, request_iterator, context):
        if self.hint is not None:
            await context.abort_with_status(self._not_leader())
        demoted = self._demoted
        await context.write(pb.SessionEvent(lease_ttl_ms=TTL_MS))

        async def read() -> None:
            async for request in request_iterator:
                self.renewals.append((time.monotonic(), request))

        reader, ended = asyncio.ensure_future(read()), asyncio.ensure_future(demoted.wait())
        try:
            await asyncio.wait({reader, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            reader.cancel()
            ended.cancel()
        if demoted.is_set():
            await context.abort_with_status(self._not_leader())

    async def KeepAlive(self, request, context):
        self.keepalives.append(request)
        if self.hint is not None:
            await context.abort_with_status(self._not_leader())
        return pb.KeepAliveResponse(lease_ttl_ms=TTL_MS, generation=request.generation)

    async def Leave(self, request, context):
        self.leaves.append(request)
        if self.hint is not None:
            await context.abort_with_status(self._not_leader())
        return pb.LeaveResponse()

    async def ListJobs(self, request, context):
        self.listed += 1
        if self.hint is not None:
            await context.abort_with_status(self._not_leader())
        return pb.ListJobsResponse(jobs=[self._job()])

    async def DescribeJob(self, request, context):
        if self.hint is not None:
            await context.abort_with_status(self._not_leader())
        return self._job()

    @staticmethod
    def _job() -> pb.JobDescription:
        return pb.JobDescription(job_id="ppo-7", state=pb.JobDescription.FORMED, generation=3,
                                 spec=pb.JobSpec(world_size=2), joined=2, num_nodes=1)


@pytest.fixture
async def replicas() -> AsyncIterator[Callable[..., Awaitable[Replica]]]:
    """Starts replicas (stopped at the end of the test)."""
    started: list[Replica] = []

    async def start(hint: str | None = None, **kw) -> Replica:
        replica = Replica(hint)
        started.append(replica)
        return await replica.start(**kw)

    yield start
    for replica in started:
        await replica.stop()


def join_request(job_id: str = "ha") -> pb.JoinRequest:
    return pb.JoinRequest(job_id=job_id, spec=pb.JobSpec(world_size=1), node_key="n0", address="127.0.0.1", master_port=29500)


async def joined(server_addr: str, tls: Tls | None = None, timeout_s: float = 10) -> Session:
    session = Session(server_addr, tls)
    try:
        await asyncio.to_thread(session.join, join_request(), timeout_s)
    except BaseException:
        await asyncio.to_thread(session.close, leave=False)
        raise
    return session


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "fake"

    def trailing_metadata(self) -> tuple:
        return ()


# -- addresses -----------------------------------------------------------------------


def test_one_address_stays_as_it_is():
    e = Endpoints("127.0.0.1:1")
    try:
        assert e.candidates == ["127.0.0.1:1"] and not e.several
        assert not e.failed(FakeRpcError(grpc.StatusCode.UNAVAILABLE))  # nowhere else to go
        assert e.address == "127.0.0.1:1"
    finally:
        e.close()


def test_a_list_is_tried_round_robin(monkeypatch):
    monkeypatch.setattr(transport.socket, "getaddrinfo", lambda *a, **kw: pytest.fail("a list is not resolved"))
    e = Endpoints("a.test:1, [::1]:2,a.test:1,b.test")
    try:
        assert e.candidates == ["a.test:1", "[::1]:2", "b.test:50051"] and e.several
        assert not e.failed(FakeRpcError(grpc.StatusCode.PERMISSION_DENIED))  # an answer, not a dead replica
        moves = []
        for _ in range(3):
            assert e.failed(FakeRpcError(grpc.StatusCode.UNAVAILABLE))
            moves.append(e.address)
        assert moves == ["[::1]:2", "b.test:50051", "a.test:1"]
    finally:
        e.close()
    with pytest.raises(ValueError):
        Endpoints("a.test:1,")


# -- joining ----------------------------------------------------------------------------


async def test_join_follows_the_hint_of_a_listed_follower(replicas, caplog):
    leader = await replicas()
    follower = await replicas(hint=leader.address)
    session = await joined(f"{follower.address},{leader.address}")
    try:
        assert session.assignment.job_id == "ha" and session.assignment.member_id == session.member_id
        assert [j.member_id for j in follower.joins] == [session.member_id]
        assert [j.member_id for j in leader.joins] == [session.member_id]
        await eventually(lambda: leader.renewals, 5, "the session renews at the leader")
        assert not follower.renewals
    finally:
        await asyncio.to_thread(session.close)
    assert [(left.member_id, left.member_secret) for left in leader.leaves] == [(session.member_id, leader.joins[0].member_secret)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # finding the leader is no failure


async def test_join_follows_a_hint_beyond_the_list_and_waits_out_an_election(replicas):
    leader = await replicas()
    follower = await replicas(hint="")  # an election: nobody knows the leader yet
    session = Session(follower.address)
    join = asyncio.ensure_future(asyncio.to_thread(session.join, join_request(), 20))
    try:
        await eventually(lambda: len(follower.joins) >= 2, 10, "the join is retried while there is no leader")
        assert not join.done() and not leader.joins
        follower.hint = leader.address
        assignment = await asyncio.wait_for(join, 10)
        assert assignment.job_id == "ha"
        assert [j.member_id for j in leader.joins] == [session.member_id]
        assert {j.member_id for j in follower.joins} == {session.member_id}  # the same membership each time
        assert {j.member_secret for j in follower.joins + leader.joins} == {leader.joins[0].member_secret}
    finally:
        await asyncio.to_thread(session.close)
    assert len(leader.leaves) == 1


async def test_a_join_without_a_leader_fails_as_unavailable(replicas):
    follower = await replicas(hint="")
    session = Session(follower.address)
    try:
        with pytest.raises(ServerUnavailable, match="no answer from rendezvous server"):
            await asyncio.to_thread(session.join, join_request(), 0.5)
    finally:
        await asyncio.to_thread(session.close, leave=False)


async def test_keep_alive_and_leave_follow_the_hint(replicas):
    leader = await replicas()
    follower = await replicas(hint=leader.address)
    e = Endpoints(follower.address)
    try:
        stub = LeaderStub(e)
        reply = await asyncio.to_thread(stub.KeepAlive, pb.KeepAliveRequest(job_id="j", member_id="m", generation=4), 5)
        assert reply.generation == 4 and len(leader.keepalives) == 1 and len(follower.keepalives) == 1
        await asyncio.to_thread(stub.Leave, pb.LeaveRequest(job_id="j", member_id="m"), 5)
        assert len(leader.leaves) == 1 and not follower.leaves  # the known leader first
        assert e.address == leader.address
    finally:
        e.close()


# -- the session moves -----------------------------------------------------------------------


def pauses_of(session: Session) -> list[float]:
    """The pauses the session's stream takes between tries, as it takes them."""
    pauses, pick = [], session._backoff  # noqa: SLF001

    def recorded(attempt: int) -> float:
        pauses.append(pick(attempt))
        return pauses[-1]

    session._backoff = recorded  # noqa: SLF001
    return pauses


async def test_the_session_moves_to_the_new_leader(replicas, caplog):
    old = await replicas()
    new = await replicas(hint=old.address)
    session = await joined(f"{old.address},{new.address}")
    pauses = pauses_of(session)
    try:
        await eventually(lambda: old.renewals, 5, "the session renews at the first leader")
        await new.lead()
        await old.follow(new.address)  # ends the stream: UNAVAILABLE, NOT_LEADER, the new leader's address
        await eventually(lambda: new.renewals, 5, "the session renews at the new leader")
        assert len(pauses) <= 1 and all(p <= TTL_MS / 1000 / 3 for p in pauses)  # straight to the hint
        secret = old.joins[0].member_secret
        assert {(r.member_id, r.member_secret, r.job_id) for _, r in new.renewals} == {(session.member_id, secret, "ha")}
        assert session.lease_error is None and session.world_change is None
        assert not new.joins  # it did not join again
    finally:
        await asyncio.to_thread(session.close)
    assert len(new.leaves) == 1 and not old.leaves
    moved = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert moved == [f"rendezvous server: the leader moved from {old.address} to {new.address}"]


async def test_failover_backoff_stays_under_a_third_of_the_lease(replicas, caplog):
    a = await replicas()
    b = await replicas(hint=a.address)
    session = await joined(f"{a.address},{b.address}")
    pauses = pauses_of(session)
    try:
        await eventually(lambda: a.renewals, 5, "the session renews at the first leader")
        # An election that takes a while: nobody knows the leader, and the session keeps trying.
        await b.follow("")
        await a.follow("")
        await eventually(lambda: len(pauses) >= 6, 10, "six tries without a leader")
        assert session.lease_error is None
        await b.lead()
        elected = len(pauses)
        await a.follow(b.address)
        await eventually(lambda: b.renewals, 5, "the session renews at the elected leader")
        # At most two tries (the one it is at, then the hint), each after a pause of at most TTL/3.
        assert len(pauses) - elected <= 2 and max(pauses) <= TTL_MS / 1000 / 3
        assert {r.member_id for _, r in b.renewals} == {session.member_id}
    finally:
        await asyncio.to_thread(session.close)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [  # once each, however many tries
        f"rendezvous server {a.address} is not the leader and knows none yet; the job keeps running, "
        "and the session reconnects when a leader answers",
        f"rendezvous server: the leader moved from {a.address} to {b.address}",
    ]


# -- a name that resolves to several addresses ---------------------------------------------------


@pytest.fixture
def pki(tmp_path):
    import trustme  # here: every xdist worker imports each test module, few run this

    ca = trustme.CA()
    cert = ca.issue_cert(NAME)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    key_chain = (cert.private_key_pem.bytes(), b"".join(p.bytes() for p in cert.cert_chain_pems))
    return str(tmp_path / "ca.pem"), grpc.ssl_server_credentials([key_chain])


@pytest.mark.parametrize("use_tls", [False, True], ids=["plaintext", "tls"])
async def test_a_name_that_resolves_to_several_replicas(replicas, monkeypatch, pki, use_tls):
    ca, server_credentials = pki
    credentials = server_credentials if use_tls else None
    for _ in range(10):  # one port on 127.0.0.2 and 127.0.0.1 (both loopback), as a name's replicas would have
        leader = await replicas(host="127.0.0.2", credentials=credentials)
        port = int(leader.address.rsplit(":", 1)[1])
        try:
            follower = await replicas(hint="", host="127.0.0.1", port=port, credentials=credentials)
            break
        except RuntimeError:  # the port is taken on 127.0.0.1
            continue
    else:
        pytest.skip("no port free on both 127.0.0.1 and 127.0.0.2")
    real = socket.getaddrinfo
    resolved: list[str] = []

    def getaddrinfo(host, port_, *args, **kwargs):
        if host != NAME:
            return real(host, port_, *args, **kwargs)
        resolved.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, int(port_))) for ip in ("127.0.0.1", "127.0.0.2")]

    monkeypatch.setattr(transport.socket, "getaddrinfo", getaddrinfo)
    # The follower (first) does not know the leader: the client tries the next address.
    session = await joined(f"{NAME}:{port}", Tls(ca=ca) if use_tls else None)
    try:
        assert resolved and [j.member_id for j in leader.joins] == [session.member_id]
        assert [j.member_id for j in follower.joins] == [session.member_id]
        await eventually(lambda: leader.renewals, 5, "the session renews at the leader")
    finally:
        await asyncio.to_thread(session.close)
    assert len(leader.leaves) == 1


# -- the command line -----------------------------------------------------------------------------


async def test_status_asks_the_leader(replicas, capsys):
    leader = await replicas()
    follower = await replicas(hint=leader.address)
    assert await asyncio.to_thread(main, ["status", "--addr", f"{follower.address},{leader.address}"]) == 0
    out = capsys.readouterr().out
    assert "ppo-7" in out and "formed" in out
    assert (follower.listed, leader.listed) == (1, 1)
    # Only the follower given: its hint leads there too, for a job's description as well.
    assert await asyncio.to_thread(main, ["status", "--addr", follower.address, "--job", "ppo-7", "--json"]) == 0
    assert '"jobId": "ppo-7"' in capsys.readouterr().out
    # Nobody knows the leader: the replica's answer is the error.
    await leader.follow("")
    await follower.follow("")
    assert await asyncio.to_thread(main, ["status", "--addr", f"{follower.address},{leader.address}"]) == 1
    assert "UNAVAILABLE: this replica is not the leader" in capsys.readouterr().err


async def test_health_probes_every_address_given(replicas, capsys):
    leader = await replicas()
    follower = await replicas(hint=leader.address)
    addrs = f"{follower.address},{leader.address}"
    assert await asyncio.to_thread(main, ["health", "--addr", addrs]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{follower.address}: SERVING", f"{leader.address}: SERVING"]
    assert await asyncio.to_thread(main, ["health", "--addr", addrs, "--service", "commctx.v1.Rendezvous"]) == 1
    assert capsys.readouterr().out.splitlines() == [f"{follower.address}: NOT_SERVING", f"{leader.address}: SERVING"]
    assert await asyncio.to_thread(main, ["health", "--addr", leader.address]) == 0  # one address: as before
    assert capsys.readouterr().out == f"{leader.address}: SERVING\n"
