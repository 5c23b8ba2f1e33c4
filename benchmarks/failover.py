"""Failover: N simulated members hold sessions; one stops renewing (dies). How
long until every survivor holds its assignment for the new generation?

The server runs as deployed (`python -m commctx.server`, default lease TTL
10 s, SQLite store) pinned to CPU 0; the members are grpc.aio clients in this
process on CPU 1. Each member renews every TTL/3 and offers a spare port,
as CommContext does. The job is elastic
(min N-1, max N). The clock starts at the dead member's last renewal, since
that is when its lease begins to run out; the target is TTL + 0.5 s.

    python benchmarks/failover.py [--members 1000] [--lease-ttl-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import pin_load_generator, server, tune_gc


class Member:
    def __init__(self, stub, job: str, member_id: str, secret: str, ttl: float) -> None:
        self.stub, self.job, self.member_id, self.secret, self.ttl = stub, job, member_id, secret, ttl
        self.generation = 1
        self.spare_port = 40000
        self.changed_at = self.assigned_at = None
        self.last_renewal = 0.0
        self.alive = True
        self.call = None
        self.writing = asyncio.Lock()  # one write at a time on a stream

    async def send(self) -> None:
        async with self.writing:
            await self.call.write(self._request())

    async def run(self, start_delay: float) -> None:
        self.call = self.stub.Session()
        await self.send()
        reader = asyncio.ensure_future(self._read())
        await asyncio.sleep(start_delay)  # spread renewals over the period
        while self.alive:
            await self.send()
            self.last_renewal = time.monotonic()
            await asyncio.sleep(self.ttl / 3)
        self.call.cancel()
        reader.cancel()

    def _request(self) -> pb.SessionRequest:
        return pb.SessionRequest(job_id=self.job, member_id=self.member_id, member_secret=self.secret, generation=self.generation,
                                 spare_port=self.spare_port)

    async def _read(self) -> None:
        async for event in self.call:
            kind = event.WhichOneof("event")
            if kind in ("world_changed", "assignment") and self.changed_at is None:
                self.changed_at = time.monotonic()  # told: a world change, or the new world itself
            if kind == "assignment":
                self.assigned_at = time.monotonic()
                self.generation = event.assignment.generation


async def main_async(n: int, ttl: float) -> None:
    with tempfile.TemporaryDirectory() as state, server("--log-level", "warning", "--lease-ttl-s", str(ttl), "--state-dir", state) as (_, port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.RendezvousStub(channel)
            spec = pb.JobSpec(world_size=n, elastic=pb.Elastic(min_size=n - 1, last_call_ms=60_000))
            joined = await asyncio.gather(*(
                stub.Join(pb.JoinRequest(job_id="failover", spec=spec, node_key=f"node{i // 8}", address="127.0.0.1",
                                         master_port=20000 + i, wait_timeout_ms=120_000))
                for i in range(n)
            ))
            members = [Member(stub, "failover", r.member_id, r.member_secret, ttl) for r in joined]
            tasks = [asyncio.ensure_future(m.run(ttl / 3 * i / n)) for i, m in enumerate(members)]
            await asyncio.sleep(ttl / 3 + 1)  # everyone has renewed at least once
            victim = members[n // 2]
            victim.alive = False  # dies after its next renewal
            while victim.call is not None and not victim.call.done():
                await asyncio.sleep(0.01)
            died = victim.last_renewal
            survivors = [m for m in members if m is not victim]
            deadline = time.monotonic() + ttl + 30
            while any(m.assigned_at is None for m in survivors) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            missing = sum(m.assigned_at is None for m in survivors)
            told = max(m.changed_at for m in survivors if m.changed_at) - died
            done = max(m.assigned_at for m in survivors if m.assigned_at) - died
            print(f"{n} members, lease TTL {ttl:g} s: survivors told {told:.3f} s after the dead member's last renewal; "
                  f"all {n - 1 - missing} hold generation 2 after {done:.3f} s (TTL + {done - ttl:.3f} s)")
            for m in members:
                m.alive = False
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, default=1000)
    p.add_argument("--lease-ttl-s", type=float, default=10.0)
    args = p.parse_args()
    pin_load_generator()
    tune_gc()
    asyncio.run(main_async(args.members, args.lease_ttl_s))


if __name__ == "__main__":
    main()
