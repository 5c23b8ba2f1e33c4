"""Worlds and workers are bounded (issue 37): one caller's node Joins of 1,024
workers each cannot build a world past --max-world-size, nor hold more than
--max-workers-per-caller workers waiting, and the biggest world it may build
leaves another tenant's lease alone: the loop answers its KeepAlives
throughout. Against a real server process; the 100 ms target itself is
benchmarks/bounds.py's (results/bounds.txt), this test allows a busy machine 500 ms."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc import StatusCode as Code

from commctx.server.errors import LimitExceeded
from commctx.server.rendezvous.model import Limits
from commctx.server.rendezvous.shares import SERVER, WORKERS, Caller, Shares
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server
from .conftest import eventually, join_request

pytestmark = pytest.mark.timeout(90)

NODE = 1024  # workers of a node Join: the most one may hold (params.MAX_NODE_WORKERS)
WORLD = Limits().max_world_size  # the default --max-world-size: 131,072, 128 nodes
PER_CALLER = 2 * Limits().max_workers_per_caller  # --max-workers-per-caller here: the victim and the attacker are one peer;
# the default is as many
ROUND_TRIP_BOUND_S = 0.5  # generous for a busy 2-core machine; the benchmark holds the 100 ms target


def node_join(job: str, nodes: int, i: int, *, least: int | None = None, wait_ms: int = 30_000) -> pb.JoinRequest:
    spec = pb.JobSpec(nodes=pb.Nodes(min=nodes if least is None else least, max=nodes))
    return pb.JoinRequest(job_id=job, spec=spec, node_key=f"attacker-{i}", address="127.0.0.1", master_port=21000 + i,
                          workers=NODE, wait_timeout_ms=wait_ms)


class Victim:
    """Another tenant's formed 2-worker job, renewing by KeepAlive every 20 ms from
    a thread with its own connection; keeps every round trip."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        stub = self.stub = pb_grpc.RendezvousStub(self.channel)
        joins = [stub.Join.future(join_request("victim", 2, f"v{i}", i), timeout=20) for i in range(2)]
        self.members = [f.result() for f in joins]
        self.round_trips: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        i = 0
        while not self._stop.is_set():
            m = self.members[i % 2]
            i += 1
            began = time.monotonic()
            try:
                answer = self.stub.KeepAlive(pb.KeepAliveRequest(job_id="victim", member_id=m.member_id,
                                                                 member_secret=m.member_secret, generation=1), timeout=10)
                if answer.generation != 1:
                    self.failures.append(f"generation {answer.generation}")
            except grpc.RpcError as exc:
                self.failures.append(f"{exc.code().name}: {exc.details()}")
            self.round_trips.append(time.monotonic() - began)
            self._stop.wait(0.02)  # the scenario, not a wait for something: a renewal every 20 ms until stop()

    def state(self) -> str:
        return pb.JobDescription.State.Name(self.stub.DescribeJob(pb.DescribeJobRequest(job_id="victim"), timeout=10).state)

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(15)
            self.channel.close()


async def joined(stub: pb_grpc.RendezvousStub, *jobs: str) -> int:
    """The node Joins the jobs hold now (a job not there yet holds none)."""
    views = await asyncio.gather(*[stub.DescribeJob(pb.DescribeJobRequest(job_id=j, node_page_size=1)) for j in jobs],
                                 return_exceptions=True)
    return sum(v.num_nodes for v in views if isinstance(v, pb.JobDescription))


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def test_a_caller_building_the_biggest_world_it_may_is_refused_past_it_and_the_other_tenant_renews_throughout():
    server = Server("127.0.0.1", "--lease-ttl-s", "2", "--log-level", "warning",  # the default --max-world-size
                    "--max-workers-per-caller", str(PER_CALLER))
    victim = None
    try:
        victim = await asyncio.to_thread(Victim, server.address)
        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(server.address, options=options) as channel:
            stub = pb_grpc.RendezvousStub(channel)
            nodes = WORLD // NODE
            # The biggest world: 128 node Joins at once (the last forms it, each answered with its 1,024 workers).
            answers = await asyncio.gather(*[stub.Join(node_join("attack", nodes, i, least=nodes - 1), timeout=60)
                                             for i in range(nodes)])
            assert {a.assignment.world_size for a in answers} == {WORLD}
            assert all(len(a.worker_assignments) == NODE for a in answers)
            assert sorted(w.rank for a in answers for w in a.worker_assignments) == list(range(WORLD))
            # One node more (a standby) would take the job past --max-world-size.
            err = await refused(stub.Join(node_join("attack", nodes, nodes, least=nodes - 1), timeout=10))
            assert err.code() is Code.RESOURCE_EXHAUSTED
            assert err.details() == (f"job 'attack' holds {WORLD:,} workers; node 'attacker-{nodes}' cannot add 1,024 more: "
                                     f"a job holds at most {WORLD:,} workers on this server (--max-world-size)")
            # A spec whose smallest world is larger could never form: refused at its first Join.
            err = await refused(stub.Join(node_join("huge", 200_000, 0), timeout=10))
            assert err.code() is Code.INVALID_ARGUMENT
            assert err.details() == (f"spec's smallest world is 200,000 nodes; this server forms worlds of at most {WORLD:,} "
                                     f"workers (--max-world-size)")
            # The workers a caller holds, placed (the attack's world, the victim's) and waiting, over several jobs, are at
            # most --max-workers-per-caller.
            held = WORLD + 2
            more = (PER_CALLER - held) // NODE
            waiting = [asyncio.ensure_future(stub.Join(node_join(f"wait-{i % 2}", nodes, i), timeout=60)) for i in range(more)]
            async def arrived() -> bool:
                return await joined(stub, "wait-0", "wait-1") >= more

            await eventually(arrived, 20, "the Joins waiting did not all arrive")
            err = await refused(stub.Join(node_join("wait-2", nodes, 0), timeout=10))
            assert err.code() is Code.RESOURCE_EXHAUSTED
            assert err.details() == (f"peer 127.0.0.1 holds {held + more * NODE:,} workers (waiting or placed, all its jobs); "
                                     f"this Join's 1,024 more would pass its {PER_CALLER:,} (--max-workers-per-caller); end "
                                     f"some, or retry later")
            for f in waiting:
                f.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        state = await asyncio.to_thread(victim.state)
        victim.stop()
        assert state == "FORMED" and not victim.failures
        assert len(victim.round_trips) > 10
        assert max(victim.round_trips) < ROUND_TRIP_BOUND_S, sorted(victim.round_trips)[-5:]
    finally:
        if victim is not None:
            victim.stop()
        server.stop()


def test_a_callers_workers_waiting_are_counted_given_back_and_an_admin_is_exempt():
    shares = Shares(Limits(max_workers_per_caller=2048))
    team, admin = Caller("peer:10.0.0.1", "peer 10.0.0.1"), Caller("token:ab", "this token", exempt=True)
    shares.take(WORKERS, team, 1024)
    shares.take(WORKERS, team, 1000)
    with pytest.raises(LimitExceeded, match=r"peer 10.0.0.1 holds 2,024 workers \(waiting or placed, all its jobs\); this "
                                            r"Join's 1,024 more would pass its 2,048 \(--max-workers-per-caller\)"):
        shares.take(WORKERS, team, 1024)
    shares.take(WORKERS, team, 24)  # to the last worker
    shares.give(WORKERS, team, 1024)
    shares.take(WORKERS, team, 1024)  # what is given back can be taken again
    for caller in (admin, SERVER):  # exempt: never counted
        shares.take(WORKERS, caller, 1 << 20)
        assert shares.held(WORKERS, caller) == 0
