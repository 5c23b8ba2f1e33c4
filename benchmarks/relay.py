"""A protocol-only rendezvous server: the yardstick for benchmarks.

It speaks commctx.v1 as the real server does (Join long-polls until the job
has all its workers; Session renews leases and pushes assignments; health;
the same event-loop lag gauge), but plans nothing and keeps no store: every
assignment is a canned message with the member's arrival index as its rank.
Leases are one asyncio timer per member, started when its session opens
and reset on every renewal. When a
lease runs out, every other member of the job gets its next-generation
assignment on its session, as the real server does for a re-form.

--trivial answers every Join at once (no waiting for the others): the floor
of what a Join costs in gRPC alone.

    python benchmarks/relay.py [--port 0] [--lease-ttl-s 10] [--trivial] [--metrics-port off]
"""

from __future__ import annotations

import argparse
import asyncio
import os

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from commctx.server.telemetry import LoopLag
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc


class Member:
    __slots__ = ("rank", "outbox", "timer")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.outbox: asyncio.Queue | None = None
        self.timer: asyncio.TimerHandle | None = None


class Job:
    def __init__(self, size: int) -> None:
        self.size = size
        self.members: dict[str, Member] = {}
        self.formed = asyncio.Event()
        self.generation = 0
        self.workers = 0  # joined: a node or host membership's Join brings several


def assignment(job_id: str, generation: int, rank: int, world_size: int) -> pb.Assignment:
    return pb.Assignment(job_id=job_id, generation=generation, rank=rank, world_size=world_size, master_addr="127.0.0.1",
                         master_port=29500, dist_url="tcp://127.0.0.1:29500",
                         groups=[pb.Group(mode="GLOBAL", ranks=pb.RankSet(runs=[pb.RankRun(start=0, count=world_size, stride=1)]))])


class Relay(pb_grpc.RendezvousServicer):
    def __init__(self, lease_ttl_s: float, trivial: bool) -> None:
        self.ttl = lease_ttl_s
        self.trivial = trivial
        self.jobs: dict[str, Job] = {}

    async def Join(self, request, context):
        member_id = request.member_id or os.urandom(8).hex()
        if self.trivial:
            return pb.JoinResponse(member_id=member_id, lease_ttl_ms=int(self.ttl * 1000),
                                   assignment=assignment(request.job_id, 1, 0, request.spec.world_size))
        job = self.jobs.setdefault(request.job_id, Job(request.spec.world_size))
        member = job.members[member_id] = Member(len(job.members))
        job.workers += len(request.host_workers) or request.workers or 1
        if job.workers >= job.size:
            job.generation = 1
            job.formed.set()
        await job.formed.wait()
        return pb.JoinResponse(member_id=member_id, lease_ttl_ms=int(self.ttl * 1000),
                               assignment=assignment(request.job_id, 1, member.rank, job.size))

    def _lease(self, job_id: str, member_id: str, member: Member) -> None:
        if member.timer is not None:
            member.timer.cancel()
        member.timer = asyncio.get_running_loop().call_later(self.ttl, self._expire, job_id, member_id)

    def _expire(self, job_id: str, member_id: str) -> None:
        job = self.jobs[job_id]
        job.members.pop(member_id)
        job.generation += 1
        job.size = len(job.members)
        for rank, (mid, m) in enumerate(job.members.items()):
            m.rank = rank
            if m.outbox is not None:
                m.outbox.put_nowait(pb.SessionEvent(assignment=assignment(job_id, job.generation, rank, job.size)))

    async def Session(self, requests, context):
        first = await context.read()
        job = self.jobs.get(first.job_id)
        member = job.members.get(first.member_id) if job is not None else None
        if member is None:
            await context.write(pb.SessionEvent(gone="unknown member"))
            return
        member.outbox = asyncio.Queue()
        self._lease(first.job_id, first.member_id, member)
        await context.write(pb.SessionEvent(lease_ttl_ms=int(self.ttl * 1000)))

        async def renewals():
            while await context.read() is not grpc.aio.EOF:
                if first.member_id in job.members:
                    self._lease(first.job_id, first.member_id, member)
            member.outbox.put_nowait(None)

        reader = asyncio.ensure_future(renewals())
        try:
            while (event := await member.outbox.get()) is not None:
                await context.write(event)
        finally:
            reader.cancel()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--lease-ttl-s", type=float, default=10.0)
    p.add_argument("--trivial", action="store_true")
    p.add_argument("--metrics-port", default="off")
    args = p.parse_args()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                                      ("grpc.server.max_pending_requests", 1 << 17)])
    pb_grpc.add_RendezvousServicer_to_server(Relay(args.lease_ttl_s, args.trivial), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    registry = prometheus_client.CollectorRegistry()
    lag = LoopLag()
    registry.register(_LagCollector(lag))
    lag_task = asyncio.create_task(lag.run())
    print(f"relay listening on {args.host}:{port}", flush=True)
    if args.metrics_port != "off":
        httpd, _ = prometheus_client.start_http_server(int(args.metrics_port), addr=args.host, registry=registry)
        print(f"relay metrics on http://{args.host}:{httpd.server_port}/metrics", flush=True)
    try:
        await server.wait_for_termination()
    finally:
        lag_task.cancel()


class _LagCollector:
    def __init__(self, lag: LoopLag) -> None:
        self._lag = lag

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("commctx_event_loop_lag_max_seconds", "worst lag in the last 10 s", value=self._lag.worst())


if __name__ == "__main__":
    asyncio.run(main())
