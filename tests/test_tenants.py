"""Trust, round 2, against real servers: one caller cannot take another's
share of the server (jobs, Joins waiting, streams), a revoked token's calls in
flight end at once, TLS cannot fail open, and the smaller holes stay closed
(an out-of-range spare port, short job secrets, guessing a job's secret).
A frozen HA leader that thaws answers nothing: tests/test_ha.py."""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import subprocess
import sys

import grpc
import pytest
from grpc import StatusCode as Code

from commctx.server import start_server
from commctx.server.rendezvous.model import Limits
from commctx.server.rendezvous.shares import Guesses
from commctx.server.tokens import Callers
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server
from .conftest import eventually, join_request, wait_until
from .test_operate import scrape

pytestmark = pytest.mark.timeout(120)
A, B, ADMIN = "token-of-team-a-0123456789", "token-of-team-b-0123456789", "token-of-the-operators-0123"
SECRET = "the-job-secret-0123456789"


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"{A}\n{B}\n{ADMIN} admin\n")
    return path


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


@pytest.fixture
async def shared(tokens, request):
    """A server with tokens and small limits (a test's marker `limits` overrides them): each caller may hold a quarter."""
    marker = request.node.get_closest_marker("limits")
    limits = {"max_jobs": 40, "max_members": 40, "max_streams": 40, **(marker.kwargs if marker else {})}
    server = await start_server("127.0.0.1", 0, callers=Callers(tokens), limits=Limits(caller_share=0.25, **limits))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server, pb_grpc.RendezvousStub(channel)
    await server.stop(0)


@pytest.mark.limits(max_members=400)  # so that the jobs, not the Joins waiting, are what A runs out of
async def test_a_tokens_job_flood_stops_at_its_share_and_another_tenant_still_forms(shared):
    server, stub = shared
    flood = [asyncio.ensure_future(stub.Join(join_request(f"a-{i}", 2), metadata=bearer(A))) for i in range(30)]
    await eventually(lambda: sum(f.done() for f in flood) == 20, what="the 20 beyond A's share refused")
    errors = [f.exception() for f in flood if f.done()]
    assert {e.code() for e in errors} == {Code.RESOURCE_EXHAUSTED}
    assert errors[0].details().startswith("this token holds 10 of its 10 jobs (a caller's share")
    assert A not in errors[0].details()  # the token itself is never echoed
    both = [stub.Join(join_request("b-job", 2, f"n{i}", i), metadata=bearer(B)) for i in range(2)]
    formed = await asyncio.wait_for(asyncio.gather(*both), 5)  # during A's flood, B's job forms at once
    assert sorted(r.assignment.rank for r in formed) == [0, 1]
    for f in flood:
        f.cancel()


async def test_a_tokens_waiting_joins_stop_at_its_share(shared):
    server, stub = shared
    held = [asyncio.ensure_future(stub.Join(join_request("a-big", 40, f"n{i}", i), metadata=bearer(A))) for i in range(10)]
    await eventually(lambda: "a-big" in server.machine.job_ids() and server.machine.describe("a-big").joined == 10)
    err = await refused(stub.Join(join_request("a-big", 40, "n10", 10), metadata=bearer(A)))
    assert err.code() is Code.RESOURCE_EXHAUSTED and "this token holds 10 of its 10 waiting joins" in err.details()
    assert server.machine.describe("a-big").joined == 10  # the refused one registered nothing
    ok = await stub.Join(join_request("b-one", 1), metadata=bearer(B))
    assert ok.assignment.world_size == 1
    for f in held:
        f.cancel()
    await eventually(lambda: "a-big" not in server.machine.job_ids(), what="A's withdrawn joins free its share")
    await stub.Join(join_request("a-again", 1), metadata=bearer(A))


async def test_a_tokens_streams_stop_at_its_share_and_an_admin_is_exempt(shared):
    server, stub = shared
    await stub.Join(join_request("watched", 1), metadata=bearer(A))
    watches = [stub.WatchEvents(pb.WatchEventsRequest(job_id="watched"), metadata=bearer(A)) for _ in range(10)]
    for w in watches:
        assert (await w.read()).kind == "joined"
    err = await refused(stub.WatchEvents(pb.WatchEventsRequest(job_id="watched"), metadata=bearer(A)).read())
    assert err.code() is Code.RESOURCE_EXHAUSTED and "this token holds 10 of its 10 open streams" in err.details()
    admin = [stub.WatchEvents(pb.WatchEventsRequest(job_id="watched"), metadata=bearer(ADMIN)) for _ in range(15)]
    for w in admin:
        assert (await w.read()).kind == "joined"
    for w in watches + admin:
        w.cancel()


async def test_without_tokens_the_share_is_the_peers():
    server = await start_server("127.0.0.1", 0, limits=Limits(max_jobs=8, caller_share=0.25))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.RendezvousStub(channel)
            for i in range(2):
                await stub.Join(join_request(f"p-{i}", 1))
            err = await refused(stub.Join(join_request("p-2", 1)))
            assert err.code() is Code.RESOURCE_EXHAUSTED and err.details().startswith("peer 127.0.0.1 holds 2 of its 2 jobs")
    finally:
        await server.stop(0)


async def test_a_revoked_tokens_session_and_waiting_join_end_at_once(shared, tokens):
    server, stub = shared
    mine = await stub.Join(join_request("mine", 1), metadata=bearer(A))
    session = stub.Session(metadata=bearer(A))
    await session.write(pb.SessionRequest(job_id="mine", member_id=mine.member_id, member_secret=mine.member_secret,
                                          generation=1))
    assert (await session.read()).HasField("lease_ttl_ms")
    waiting = asyncio.ensure_future(stub.Join(join_request("pair", 2, "a", 0), metadata=bearer(A)))
    watch = stub.WatchEvents(pb.WatchEventsRequest(job_id="mine"), metadata=bearer(A))
    assert (await watch.read()).kind == "joined"
    await eventually(lambda: "pair" in server.machine.job_ids())
    tokens.write_text(f"{B}\n{ADMIN} admin\n")  # A is revoked
    server._callers.reload()  # noqa: SLF001 - what SIGHUP does (test_a_sighup_... runs the real signal)
    assert server.revoke_tokens() == 3
    async def watch_to_its_end() -> None:
        while True:
            await watch.read()  # the events queued before the revocation, then its end

    for call in (session.read(), waiting, watch_to_its_end()):
        err = await refused(asyncio.wait_for(call, 1.0))
        assert err.code() is Code.UNAUTHENTICATED and "no longer accepted" in err.details()
    assert "pair" not in server.machine.job_ids()  # its waiting member was withdrawn: it will never be placed
    second = await refused(stub.Join(join_request("pair", 2, "b", 1), metadata=bearer(A)))
    assert second.code() is Code.UNAUTHENTICATED
    b = asyncio.ensure_future(stub.Join(join_request("pair", 2, "b", 1), metadata=bearer(B)))
    await eventually(lambda: "pair" in server.machine.job_ids())
    assert server.machine.describe("pair").joined == 1  # only B's: A's never comes back
    b.cancel()


def test_a_sighup_that_drops_a_token_ends_its_calls(tokens):
    server = Server("127.0.0.1", "--auth-tokens", str(tokens))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.RendezvousStub(channel)
            waiting = stub.Join.future(join_request("sighup", 2), metadata=bearer(A), timeout=60)
            wait_until(lambda: stub.ListJobs(pb.ListJobsRequest(), metadata=bearer(A), timeout=5).jobs, what="the job")
            watch = stub.WatchEvents(pb.WatchEventsRequest(job_id="sighup"), metadata=bearer(A), timeout=60)
            assert next(watch).kind == "joined"
            tokens.write_text(f"{B}\n")
            os.kill(server.popen.pid, signal.SIGHUP)
            def watch_to_its_end() -> None:
                for _ in watch:  # the events queued before the revocation, then its end
                    pass

            for call in (lambda: waiting.result(timeout=2), watch_to_its_end):
                with pytest.raises(grpc.RpcError) as ended:
                    call()
                assert ended.value.code() is Code.UNAUTHENTICATED, ended.value.details()
    finally:
        log = server.log()
        server.stop()
    assert "tokens_reloaded" in log and "calls_ended=2" in log and A not in log


# -- TLS that cannot fail open ------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    import trustme  # here: every xdist worker imports each test module, few run this

    d = tmp_path_factory.mktemp("certs")
    ca, other = trustme.CA(), trustme.CA()
    now = datetime.datetime.now(datetime.timezone.utc)
    made = {
        "good": ca.issue_cert("127.0.0.1"),
        "expired": ca.issue_cert("127.0.0.1", not_before=now - datetime.timedelta(days=30), not_after=now - datetime.timedelta(days=1)),
        "future": ca.issue_cert("127.0.0.1", not_before=now + datetime.timedelta(days=1), not_after=now + datetime.timedelta(days=30)),
        "soon": ca.issue_cert("127.0.0.1", not_after=now + datetime.timedelta(days=3)),
        "other": other.issue_cert("127.0.0.1"),
    }
    files = {}
    for name, leaf in made.items():
        files[name] = (str(d / f"{name}.crt"), str(d / f"{name}.key"))
        leaf.cert_chain_pems[0].write_to_path(files[name][0])
        leaf.private_key_pem.write_to_path(files[name][1])
    files["garbage"] = (str(d / "garbage.crt"), files["good"][1])
    (d / "garbage.crt").write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    return files


def serve(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commctx.server", "--port", "0", "--store", "memory", *flags],
                          capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})})


def test_an_empty_tls_flag_never_turns_tls_off(certs):
    cert, key = certs["good"]
    run = serve("--tls-cert", "", "--tls-key", "", env={"COMMCTX_TLS_CERT": cert, "COMMCTX_TLS_KEY": key})
    assert run.returncode == 2 and "--tls-cert is empty but COMMCTX_TLS_CERT is set" in run.stderr
    run = serve("--auth-tokens", "", env={"COMMCTX_AUTH_TOKENS": "/etc/tokens"})
    assert run.returncode == 2 and "--auth-tokens is empty but COMMCTX_AUTH_TOKENS is set" in run.stderr


@pytest.mark.parametrize("which,words", [
    ("mismatch", "cannot serve TLS: the key does not match the certificate"),
    ("garbage", "cannot serve TLS"),
    ("expired", "expired"),
    ("future", "is not valid yet"),
])
def test_a_certificate_that_cannot_serve_stops_the_server_naming_it(certs, which, words):
    cert, key = (certs["good"][0], certs["other"][1]) if which == "mismatch" else certs[which]
    run = serve("--tls-cert", cert, "--tls-key", key)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("commctx-server: --tls-cert ") and cert in run.stderr and words in run.stderr, run.stderr


def test_the_start_up_line_says_how_it_serves_and_a_certificate_expiring_soon_is_a_warning_and_a_metric(certs, tokens):
    plain = Server("127.0.0.1")
    plain.stop()
    assert "(plaintext, tokens off) listening on" in plain.banner
    cert, key = certs["soon"]
    server = Server("127.0.0.1", "--tls-cert", cert, "--tls-key", key, "--auth-tokens", str(tokens), metrics=True)
    try:
        left = scrape(server.metrics_url)["commctx_tls_cert_expiry_seconds"]
        assert 2 * 86400 < left <= 3 * 86400
        log = server.log()
    finally:
        server.stop()
    assert "(TLS, tokens on) listening on" in server.banner and "tls_certificate_expires_soon" in log


# -- the smaller holes ------------------------------------------------------------------------


async def test_a_spare_port_out_of_range_ends_the_stream(stub):
    joined = await stub.Join(join_request("ports", 1))
    for port in (70000, 4294967295):
        session = stub.Session()
        await session.write(pb.SessionRequest(job_id="ports", member_id=joined.member_id, member_secret=joined.member_secret,
                                              generation=1, spare_port=port))
        err = await refused(session.read())
        assert err.code() is Code.INVALID_ARGUMENT and f"spare_port {port} is out of range 1..65535" in err.details()
    assert (await stub.DescribeJob(pb.DescribeJobRequest(job_id="ports"))).joined == 1  # nothing was recorded


async def test_a_short_job_secret_is_refused_naming_its_length(stub):
    err = await refused(stub.Join(join_request("short", 1, job_secret="8-chars!")))
    assert err.code() is Code.INVALID_ARGUMENT and "job_secret is malformed (8 characters): give 16-256" in err.details()
    assert "8-chars!" not in err.details()


async def test_guessing_a_jobs_secret_is_throttled_and_logged_once(server, stub, caplog):
    waiting = asyncio.ensure_future(stub.Join(join_request("vault", 2, job_secret=SECRET)))
    await eventually(lambda: "vault" in server.machine.job_ids())
    for i in range(Guesses.LIMIT):
        err = await refused(stub.DescribeJob(pb.DescribeJobRequest(job_id="vault", job_secret=f"guess-number-{i:04d}")))
        assert err.code() is Code.PERMISSION_DENIED
    err = await refused(stub.DescribeJob(pb.DescribeJobRequest(job_id="vault", job_secret="guess-number-more")))
    assert err.code() is Code.RESOURCE_EXHAUSTED and f"gave {Guesses.LIMIT} wrong job secrets for job 'vault'" in err.details()
    err = await refused(stub.Join(join_request("vault", 2, "n1", 1, job_secret="guess-number-join")))
    assert err.code() is Code.RESOURCE_EXHAUSTED  # wrong joins of that caller to that job too
    # The guesser shares this address (one NAT, one team token): the team's right secret still passes, at once.
    assert (await stub.DescribeJob(pb.DescribeJobRequest(job_id="vault", job_secret=SECRET))).joined == 1
    joined = await stub.Join(join_request("vault", 2, "n1", 1, job_secret=SECRET))
    assert joined.assignment.world_size == 2
    lines = [r for r in caplog.records if r.getMessage() == "wrong_job_secrets"]
    assert len(lines) == 1 and SECRET not in str(lines[0].__dict__)
    assert (await stub.Join(join_request("other", 1))).assignment.world_size == 1  # other jobs are untouched
    waiting.cancel()


async def test_a_strangers_standby_cannot_close_a_teams_run_nor_crowd_out_its_replacement(shared):
    """The audit's attack over gRPC: team A's run of 2 nodes is formed; B parks
    a standby and sends Leave(close=True) from it, with its own member secret.
    B's standby just leaves and A's run stays formed; B's second standby is
    refused; A's replacement is admitted all the same."""
    server, stub = shared
    spec = pb.JobSpec(nodes=pb.Nodes(min=2, max=2))

    def node(key: str, **kw) -> pb.JoinRequest:
        return pb.JoinRequest(job_id="team-run", spec=spec, node_key=key, address="127.0.0.1", master_port=9, workers=2,
                              wait_timeout_ms=30_000, **kw)

    def nodes() -> list[str]:
        return sorted(n.node_key for n in server.machine.describe("team-run").nodes)

    first = asyncio.ensure_future(stub.Join(node("a0"), metadata=bearer(A)))
    await stub.Join(node("a1"), metadata=bearer(A))
    await first
    mid, secret = "b0" * 8, "5e" * 16
    parked = asyncio.ensure_future(stub.Join(node("b0", member_id=mid, member_secret=secret), metadata=bearer(B)))
    await eventually(lambda: nodes() == ["a0", "a1", "b0"], what="B's standby waits")
    await stub.Leave(pb.LeaveRequest(job_id="team-run", member_id=mid, member_secret=secret, close=True), metadata=bearer(B))
    await eventually(lambda: nodes() == ["a0", "a1"], what="B's standby left")
    assert server.machine.describe("team-run").state.value == "formed"  # not closed
    again = asyncio.ensure_future(stub.Join(node("b1"), metadata=bearer(B)))
    await eventually(lambda: nodes() == ["a0", "a1", "b1"], what="B's standby waits again")
    err = await refused(stub.Join(node("b2"), metadata=bearer(B)))
    assert err.code() is Code.RESOURCE_EXHAUSTED and "holds no seat in it: at most 1" in err.details()
    replacement = asyncio.ensure_future(stub.Join(node("a2"), metadata=bearer(A)))  # the team's own: admitted
    await eventually(lambda: nodes() == ["a0", "a1", "a2", "b1"], what="A's replacement waits")
    for f in (parked, again, replacement):
        f.cancel()
