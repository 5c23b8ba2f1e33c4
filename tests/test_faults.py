"""Faults with real processes: a worker killed, the server killed and restarted
on its state, a host's link cut, and a join storm."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from commctx.server import start_server
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Hosts, Server, netns_available, running, worker
from .conftest import eventually, holds_for, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
TTL = 2.0


def sums_of(result: dict) -> dict[str, float]:
    return {m: float(sum(x + 1 for x in g)) for m, g in result["groups"].items()}


def describe(address: str, job: str) -> pb.JobDescription:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.RendezvousStub(ch).DescribeJob(pb.DescribeJobRequest(job_id=job), timeout=5)


def test_a_killed_worker_is_replaced_by_a_smaller_world():
    """4 workers (elastic, min 3) on two node keys; SIGKILL rank 1. Its link
    to its host's membership closes with it, so the 3 survivors hear of it at
    once, long before its lease (60 s) would tell: they keep their node and
    local ranks, and all_reduce correctly in generation 2."""
    spec = {"elastic": {"min_size": 3, "last_call_ms": 10_000}}  # the world forms at 4 (its maximum) at once
    server = Server("127.0.0.1", "--lease-ttl-s", "60")
    nodes = ["node-a", "node-a", "node-b", "node-b"]
    workers = [worker(server.address, "ft", 4, node_key=n, spec=spec, name=f"w{i}") for i, n in enumerate(nodes)]
    with running([server, *workers]):
        first = {r["rank"]: (w, r) for w, r in ((w, w.event(120)) for w in workers)}
        assert sorted(first) == [0, 1, 2, 3]
        victim, _ = first[1]  # node-a, local rank 1
        survivors = {rank: first[rank] for rank in (0, 2, 3)}
        victim.kill()
        for w, _ in survivors.values():
            w.send("rejoin")
        after = {rank: w.event(30) for rank, (w, _) in survivors.items()}  # well within the lease
        for old_rank, r in after.items():
            # (its host's other worker saw its link close and said so at once)
            assert "(node 'node-a', rank 1) disconnected: its process ended without a leave" in r["reason"], r
            assert r["generation"] == 2 and r["world_size"] == 3 and r["previous_rank"] == old_rank
            assert r["sums"] == sums_of(r) and r["sums"]["GLOBAL"] == 6.0
        # node-a keeps node rank 0 and local rank 0; node-b keeps node rank 1, local ranks 0 and 1
        assert {old: (r["rank"], r["node_rank"], r["in_node_rank"]) for old, r in after.items()} == {
            0: (0, 0, 0), 2: (1, 1, 0), 3: (2, 1, 1)}
        assert after[0]["groups"]["INTRA_NODE"] == [0] and after[2]["groups"]["INTRA_NODE"] == [1, 2]
        assert after[0]["env"]["MASTER_PORT"] != first[0][1]["env"]["MASTER_PORT"]  # a new store for a new world
        for w, _ in survivors.values():
            w.send("destroy")
        for w, _ in survivors.values():
            assert w.event(60)["event"] == "destroyed"


def test_a_job_below_its_minimum_is_a_final_world_change():
    """Elastic, min 2, two workers; SIGKILL one. The survivor's job cannot go
    on, and it learns so as an event: wait_world_change() returns a change with
    `final` and the reason, its callback ran, and rejoin() raises MemberNotFound."""
    spec = {"elastic": {"min_size": 2, "last_call_ms": 10_000}}
    server = Server("127.0.0.1", "--lease-ttl-s", str(TTL))
    workers = [worker(server.address, "small", 2, node_key="n", spec=spec, name=f"w{i}") for i in range(2)]
    with running([server, *workers]):
        assert sorted(w.event(120)["rank"] for w in workers) == [0, 1]
        workers[1].kill()
        workers[0].send("ended")
        ended = workers[0].event(TTL + 30)
        assert (ended["final"], ended["same"], ended["callbacks"]) == (True, True, 1), ended
        assert "disconnected: its process ended without a leave" in ended["reason"], ended
        assert "fewer than the minimum of 2" in ended["reason"], ended
        assert ended["rejoin_error"].startswith("MemberNotFound: NOT_FOUND: job 'small'"), ended
        assert ended["reason"] in ended["rejoin_error"]


def test_an_ended_job_and_a_lost_lease_are_final_world_changes():
    """The same event for the two other ways a worker's job cannot go on: the
    other worker leaves (the job ENDS below its minimum), and this worker's own
    lease is lost (stopped for longer than the TTL, then resumed)."""
    spec = {"elastic": {"min_size": 2, "last_call_ms": 10_000}}
    server = Server("127.0.0.1", "--lease-ttl-s", str(TTL))
    # Two hosts a job: each worker's lease is its own (a host's workers share one, see test_host_link.py).
    workers = [worker(server.address, job, 2, node_key=f"n{i}", spec=spec, name=f"{job}{i}") for job in ("left", "lost")
               for i in range(2)]
    with running([server, *workers]):
        assert sorted(w.event(120)["rank"] for w in workers) == [0, 0, 1, 1]
        left, stays, lost, other = workers
        left.send("destroy")  # a graceful Leave: one of two remains, below the minimum
        assert left.event(60)["event"] == "destroyed"
        stays.send("ended")
        ended = stays.event(TTL + 30)
        assert (ended["final"], ended["same"], ended["callbacks"]) == (True, True, 1), ended
        # a normal end reads as an end, not a failure
        assert "finished: member" in ended["reason"] and "left; 1 worker remains, below the minimum of 2" in ended["reason"], ended
        assert "finished" in ended["reason"] and "fewer than" not in ended["reason"], ended
        assert ended["rejoin_error"].startswith("MemberNotFound: NOT_FOUND: job 'left'"), ended
        os.killpg(lost.popen.pid, signal.SIGSTOP)  # no renewals: its lease runs out, and the job fails without it
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = pb_grpc.RendezvousStub(channel)
                wait_until(lambda: stub.DescribeJob(pb.DescribeJobRequest(job_id="lost"), timeout=5).state
                           == pb.JobDescription.FAILED, TTL + 10, "the stopped worker's lease runs out")
        finally:
            os.killpg(lost.popen.pid, signal.SIGCONT)
        lost.send("ended")
        gone = lost.event(TTL + 30)
        assert (gone["final"], gone["same"], gone["callbacks"]) == (True, True, 1), gone
        assert "expired" in gone["reason"], gone
        assert gone["rejoin_error"].startswith("MemberNotFound: NOT_FOUND: "), gone


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_killed_and_restarted_on_its_state(tmp_path):
    """kill -9 the server under a running job: the workers keep computing, their
    sessions reconnect to the restarted server (one warning), nothing is lost,
    and a worker joining afterwards grows the world consistently."""
    spec = {"elastic": {"min_size": 2, "last_call_ms": 1000}}
    port = free_port()
    args = ("--lease-ttl-s", str(TTL), "--state-dir", str(tmp_path))
    argv = [sys.executable, "-m", "commctx.server", "--host", "127.0.0.1", "--port", str(port), *args]
    server = Server("127.0.0.1", argv=argv)
    workers = [worker(server.address, "durable", 3, node_key="n", spec=spec, name=f"w{i}") for i in range(2)]
    late = None
    try:
        with running(workers):
            first = [w.event(120) for w in workers]
            assert sorted(r["rank"] for r in first) == [0, 1]
            server.kill()
            for w in workers:
                w.send("reduce")
            assert [w.event(60)["sums"] for w in workers] == [r["sums"] for r in first]  # undisturbed
            server.stop()
            server = Server("127.0.0.1", argv=argv)  # same port, same state
            d = describe(server.address, "durable")
            assert (d.state, d.generation, d.joined) == (pb.JobDescription.FORMED, 1, 2)
            # Time that must pass, not a wait for something: past the grace only renewed leases survive, and
            # DescribeJob, asked throughout, never sees a member gone.
            def kept() -> bool:
                d = describe(server.address, "durable")
                return (d.state, d.generation, d.joined) == (pb.JobDescription.FORMED, 1, 2)

            holds_for(kept, 2 * TTL + 1, "the job formed, both workers in it", interval_s=0.2)
            d = describe(server.address, "durable")
            assert (d.state, d.generation, d.joined) == (pb.JobDescription.FORMED, 1, 2)
            # One warning for the host: its workers share one session, held by one of them.
            assert sum(w.log().count("unreachable") for w in workers) == 1, [w.log() for w in workers]
            late = worker(server.address, "durable", 3, node_key="n", spec=spec, name="late")
            for w in workers:
                w.send("rejoin")
            grown = [w.event(120) for w in workers] + [late.event(120)]
            assert sorted(r["rank"] for r in grown) == [0, 1, 2]
            assert {r["generation"] for r in grown} == {2}
            assert all(r["sums"]["GLOBAL"] == 6.0 for r in grown)
            # survivors kept their ranks; the newcomer took the next one
            assert {r["previous_rank"]: r["rank"] for r in grown[:2]} == {0: 0, 1: 1}
    finally:
        if late is not None:
            late.stop()
        server.stop()


@pytest.mark.slow(50)
def test_sessions_are_back_within_a_lease_of_a_server_down_for_half_a_minute(tmp_path):
    """A server restarted on its state gives every member one lease TTL to be heard from. Its
    clients must dial it again within that TTL however long it was down: gRPC's reconnect backoff
    grows towards two minutes, and after a 30 s outage the sessions came back some 12 s late, so
    every member of every job was lost. The client caps the backoff at 3 s (client/channels.py)."""
    ttl = 7.0
    spec = {"elastic": {"min_size": 2, "last_call_ms": 1000}}
    port = free_port()
    argv = [sys.executable, "-m", "commctx.server", "--host", "127.0.0.1", "--port", str(port),
            "--lease-ttl-s", str(ttl), "--state-dir", str(tmp_path)]
    server = Server("127.0.0.1", argv=argv)
    workers = [worker(server.address, "outage", 3, node_key=f"n{i}", spec=spec, name=f"w{i}") for i in range(2)]
    try:
        with running(workers):
            first = [w.event(120) for w in workers]
            assert sorted(r["rank"] for r in first) == [0, 1]
            server.kill()
            server.stop()
            # Time that must pass, not a wait for something: the outage whose length drives the backoff up.
            time.sleep(30)
            server = Server("127.0.0.1", argv=argv)  # same port, same state: one TTL for each member from now

            def kept() -> bool:
                d = describe(server.address, "outage")
                return (d.state, d.generation, d.joined) == (pb.JobDescription.FORMED, 1, 2)

            holds_for(kept, ttl + 2, "the job formed, both workers in it (their sessions back within the TTL)",
                      interval_s=0.2)
            for w in workers:
                w.send("reduce")
            assert [w.event(60)["sums"] for w in workers] == [r["sums"] for r in first]
    finally:
        server.stop()


GHOST = """
import sys, grpc
from commctx.v1 import rendezvous_pb2 as pb, rendezvous_pb2_grpc as pb_grpc
channel = grpc.insecure_channel(sys.argv[1])  # a plain channel: this client sends no pings of its own
pb_grpc.RendezvousStub(channel).Join(pb.JoinRequest(job_id="ghost", spec=pb.JobSpec(world_size=2), node_key="n",
    address="127.0.0.1", master_port=23456, wait_timeout_ms=600_000), timeout=700)
"""


@pytest.mark.slow(35)
def test_a_joiner_whose_host_stops_answering_is_withdrawn_within_half_a_minute():
    """A worker waiting in its Join whose host stops (crashed, or cut off, with no FIN) must not be
    seated in a world that then waits a lease for it: the server's pings find its connection dead and
    the Join is withdrawn. Not before a lease (the timeout is at least one, so that a paused member is
    found by its lease), and not after gRPC's default of two minutes (60 s / 20 s keepalive, closed on
    the 1-minute ping timeout: 121 s measured)."""
    server = Server("127.0.0.1")  # the default lease, 10 s: pings every 20 s, answered within 10 s
    ghost = subprocess.Popen([sys.executable, "-c", GHOST, server.address])
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.RendezvousStub(channel)

            def joined() -> int:
                try:
                    return stub.DescribeJob(pb.DescribeJobRequest(job_id="ghost"), timeout=5).joined
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        return 0
                    raise

            wait_until(lambda: joined() == 1, 30, "the joiner never waited in its Join")
            ghost.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            wait_until(lambda: joined() == 0, 40, "the stopped joiner was still waiting 40 s later")
            assert time.monotonic() - stopped >= 9.5  # at least the ping timeout, a lease
    finally:
        ghost.kill()
        ghost.wait(10)
        server.stop()


NETNS = netns_available()


@pytest.mark.skipif(NETNS is not None, reason=NETNS or "")
def test_a_host_whose_link_goes_down_is_expired_and_the_rest_reform():
    spec = {"elastic": {"min_size": 2, "last_call_ms": 10_000}}
    hosts = Hosts(2)
    try:
        server = Server(hosts.server_ip, "--lease-ttl-s", str(TTL))
        workers = [
            worker(server.address, "link", 4, netns=ns, hostname=host, name=f"{host}-{i}", spec=spec)
            for host, ns in zip(("host-a", "host-b"), hosts.names)
            for i in range(2)
        ]
        with running([server, *workers]):
            first = [w.event(120) for w in workers]
            assert sorted(r["rank"] for r in first) == [0, 1, 2, 3]
            subprocess.run(["ip", "link", "set", f"{hosts.bridge}v1", "down"], check=True)  # host-b's cable
            for w in workers[:2]:
                w.send("rejoin")
            after = [w.event(120) for w in workers[:2]]
            assert sorted(r["rank"] for r in after) == [0, 1] and all(r["world_size"] == 2 for r in after)
            assert all("host-b" in r["reason"] and "expired" in r["reason"] for r in after)
            assert all(r["sums"]["GLOBAL"] == 3.0 and r["sums"] == sums_of(r) for r in after)
            d = describe(server.address, "link")
            assert (d.state, d.generation, d.joined) == (pb.JobDescription.FORMED, 2, 2)
    finally:
        hosts.close()


async def test_join_storm_with_disconnects_and_rejoins():
    """1,000 clients join; a random tenth drop their call while the world forms
    and join again (half with their old member id, half as new members). The
    world that forms holds each final member exactly once, ranks 0..999."""
    rng = random.Random(7)
    server = await start_server("127.0.0.1", 0, lease_ttl_s=30)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.RendezvousStub(channel)
            world = 1000

            def request(i: int, member_id: str) -> pb.JoinRequest:
                return pb.JoinRequest(job_id="storm", spec=pb.JobSpec(world_size=world), node_key=f"node{i % 37}",
                                      address="127.0.0.1", master_port=10000 + i, member_id=member_id, wait_timeout_ms=60_000)

            ids = [f"{i:032x}" for i in range(world)]
            droppers = set(rng.sample(range(world), world // 10))
            calls = {}
            for i in range(world):
                calls[i] = stub.Join(request(i, ids[i]))
                if rng.random() < 0.2:
                    await asyncio.sleep(0)  # the scenario, not a wait for something: a yield now and then, Joins in waves
            tasks = {i: asyncio.ensure_future(c) for i, c in calls.items()}

            async def forming() -> bool:
                try:
                    return (await stub.DescribeJob(pb.DescribeJobRequest(job_id="storm"))).joined > 0
                except grpc.aio.AioRpcError as exc:
                    if exc.code() is not grpc.StatusCode.NOT_FOUND:
                        raise
                    return False

            await eventually(forming, what="the world forming")  # the Joins are under way
            for i in droppers:  # these drop their call before the world can form
                calls[i].cancel()
            await asyncio.gather(*(tasks[i] for i in droppers), return_exceptions=True)
            final = dict(ids=dict(enumerate(ids)))
            for i in droppers:
                if rng.random() < 0.5:
                    final["ids"][i] = f"{world + i:032x}"  # joins again as a new member
                tasks[i] = asyncio.ensure_future(stub.Join(request(i, final["ids"][i])))
            responses = await asyncio.gather(*tasks.values())
            by_member = {r.member_id: r.assignment.rank for r in responses}
            assert set(by_member) == set(final["ids"].values())
            assert sorted(by_member.values()) == list(range(world))
            d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="storm"))
            assert (d.state, d.joined, d.generation) == (pb.JobDescription.FORMED, world, 1)
    finally:
        await server.stop(0)


def test_a_full_disk_refuses_answers_it_cannot_make_durable(tmp_path):
    """The state directory is a 2 MiB tmpfs that a filler file fills. A Join
    whose world formed in the failing commit hears UNAVAILABLE at once; a job
    that completes meanwhile stays FORMING (DescribeJob says why); health is
    NOT_SERVING. Once space is freed the held job forms and health recovers."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    state = tmp_path / "state"
    state.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(state)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs (needs root)")
    server = None
    try:
        server = Server("127.0.0.1", "--state-dir", str(state), "--lease-ttl-s", "5", health=True)
        with grpc.insecure_channel(server.address) as ch, grpc.insecure_channel(server.health_address) as hch:
            stub, health = pb_grpc.RendezvousStub(ch), health_pb2_grpc.HealthStub(hch)

            def serving() -> int:
                return health.Check(health_pb2.HealthCheckRequest(service="commctx.v1.Rendezvous"), timeout=5).status

            def join(job: str, world: int, node: str, **kw):
                return stub.Join.future(pb.JoinRequest(job_id=job, spec=pb.JobSpec(world_size=world), node_key=node,
                                                       address="127.0.0.1", master_port=9, wait_timeout_ms=30_000), **kw)

            assert join("before", 1, "n").result(10).assignment.generation == 1
            with open(state / "filler", "wb") as f:  # fill the disk
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                join("solo", 1, "n").result(30)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE and "cannot write its state" in refused.value.details()
            assert time.monotonic() - started < 5  # at once, not at the 30 s wait
            assert serving() == health_pb2.HealthCheckResponse.NOT_SERVING

            held = [join("held", 2, "a"), join("held", 2, "b")]

            def held_joined() -> int:
                try:
                    return describe(server.address, "held").joined
                except grpc.RpcError as exc:
                    if exc.code() is not grpc.StatusCode.NOT_FOUND:
                        raise
                    return 0

            wait_until(lambda: held_joined() >= 2, what="both held Joins registered")  # in flight: the job may not exist yet
            d = describe(server.address, "held")
            assert (d.state, d.joined, d.generation) == (pb.JobDescription.FORMING, 2, 0)
            assert d.reason.startswith("held: the server cannot write its state") and not any(h.done() for h in held)

            os.unlink(state / "filler")
            assert sorted(h.result(15).assignment.rank for h in held) == [0, 1]
            wait_until(lambda: serving() == health_pb2.HealthCheckResponse.SERVING, what="health SERVING again")
            assert serving() == health_pb2.HealthCheckResponse.SERVING
            assert describe(server.address, "held").state == pb.JobDescription.FORMED
    finally:
        if server is not None:
            server.stop()
        subprocess.run(["umount", str(state)], check=True)
