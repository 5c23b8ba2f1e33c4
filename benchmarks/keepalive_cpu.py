"""Server CPU spent on keep-alives: N members each renewing their lease on
their session every TTL/3 (default TTL 10 s: 3,000 renewals a second for
10,000 members). Also the server's RSS per member with a session open.

The server runs as deployed (`python -m commctx.server`, SQLite store) pinned
to CPU 0; the members are grpc.aio clients in this process on CPU 1. The CPU
is the server process's user + system time over a steady window, after
every session is open; the target is 30 % of one core.

    python benchmarks/keepalive_cpu.py [--members 10000] [--lease-ttl-s 10] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import cpu_s, memory_kib, pin_load_generator, server, tune_gc


async def member(stub, job: str, member_id: str, secret: str, ttl: float, delay: float, renewals: list[int], stop: asyncio.Event) -> None:
    call = stub.Session()
    request = pb.SessionRequest(job_id=job, member_id=member_id, member_secret=secret, generation=1)
    await call.write(request)
    await call.read()  # the lease
    await asyncio.sleep(delay)  # spread renewals over the period
    while not stop.is_set():
        await call.write(request)
        renewals[0] += 1
        try:
            await asyncio.wait_for(stop.wait(), ttl / 3)
        except TimeoutError:
            pass
    call.cancel()


async def main_async(n: int, ttl: float, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as state, server("--log-level", "warning", "--lease-ttl-s", str(ttl), "--state-dir", state) as (proc, port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.RendezvousStub(channel)
            joined = await asyncio.gather(*(
                stub.Join(pb.JoinRequest(job_id="ka", spec=pb.JobSpec(world_size=n), node_key=f"node{i // 8}",
                                         address="127.0.0.1", master_port=20000 + i % 40000, wait_timeout_ms=120_000))
                for i in range(n)
            ))
            before_sessions = memory_kib(proc.pid)["VmRSS"]
            stop, renewals = asyncio.Event(), [0]
            tasks = [asyncio.ensure_future(member(stub, "ka", r.member_id, r.member_secret, ttl, ttl / 3 * i / n, renewals, stop))
                     for i, r in enumerate(joined)]
            await asyncio.sleep(ttl / 3 + 2)  # all open, renewals spread out
            with_sessions = memory_kib(proc.pid)["VmRSS"]
            c0, r0, t0 = cpu_s(proc.pid), renewals[0], time.monotonic()
            await asyncio.sleep(seconds)
            c1, r1, t1 = cpu_s(proc.pid), renewals[0], time.monotonic()
            # Counted before the sessions end: a session cancelled without a Leave is a
            # departure once the reconnect grace (1 s) has passed.
            d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="ka"))
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        rate = (r1 - r0) / (t1 - t0)
        print(f"{n} members, lease TTL {ttl:g} s: {rate:.0f} renewals/s; server CPU {100 * (c1 - c0) / (t1 - t0):.1f} % of one core "
              f"over {t1 - t0:.0f} s; {d.joined} members still held; RSS with sessions open "
              f"{with_sessions / 1024:.0f} MiB (+{(with_sessions - before_sessions) / n:.1f} KiB per session)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, default=10_000)
    p.add_argument("--lease-ttl-s", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()
    pin_load_generator()
    tune_gc()
    asyncio.run(main_async(args.members, args.lease_ttl_s, args.seconds))


if __name__ == "__main__":
    main()
