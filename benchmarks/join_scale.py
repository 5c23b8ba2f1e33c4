"""N simulated workers join one job: time from the first join to the last
assignment delivered, and the server's memory per member.

The server runs as its own process (`python -m commctx.server`, as deployed);
the workers are grpc.aio clients in this process, 8 per node key. By default
the server is pinned to CPU 0 and this load generator to CPU 1, as a
rendezvous server would run beside, not under, its clients; --no-pin shares
both CPUs.

For each N, three jobs of N workers join one after another on a fresh server
(all members stay); the time is the median of the three. Memory, as RSS
growth per member: "peak" while the first job's N calls are in flight (gRPC
call buffers); "after" once the server has settled after that first job (what
the allocator keeps: freed pages pinned by surviving objects); "warm" across
the second job (what each further member costs once the pages are there).

    python benchmarks/join_scale.py [--no-pin] [--log-level info] [--store memory] [N ...]    (default N: 100 1000 10000)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import memory_kib, pin_load_generator, server, tune_gc

WORKERS_PER_NODE = 8


async def run_job(stub: pb_grpc.RendezvousStub, job_id: str, n: int) -> float:
    requests = [
        pb.JoinRequest(
            job_id=job_id, spec=pb.JobSpec(world_size=n), node_key=f"node{i // WORKERS_PER_NODE}",
            address="127.0.0.1", master_port=20000 + i % 40000, wait_timeout_ms=120_000,
        )
        for i in range(n)
    ]
    start = time.perf_counter()
    responses = await asyncio.gather(*(stub.Join(r) for r in requests))
    seconds = time.perf_counter() - start
    if sorted(r.assignment.rank for r in responses) != list(range(n)):
        raise RuntimeError("ranks are not a permutation")
    return seconds


async def settled_rss(pid: int) -> int:
    """RSS once it stops moving: the server finishes each RPC shortly after the client has its answer."""
    last, still = memory_kib(pid)["VmRSS"], 0
    for _ in range(100):
        await asyncio.sleep(0.1)
        now = memory_kib(pid)["VmRSS"]
        still = still + 1 if abs(now - last) < 64 else 0
        last = now
        if still >= 5:
            break
    return last


async def measure(n: int, pin: bool, log_level: str, store_args: list[str]) -> dict[str, float]:
    # A long lease: the clients here do not renew, and every member must stay.
    with server("--log-level", log_level, "--lease-ttl-s", "600", *store_args, cpu=0 if pin else None) as (proc, port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.RendezvousStub(channel)
            await run_job(stub, "warmup", 16)
            r0 = await settled_rss(proc.pid)
            times = [await run_job(stub, "a", n)]
            peak = memory_kib(proc.pid)["VmHWM"]
            r1 = await settled_rss(proc.pid)
            times.append(await run_job(stub, "b", n))
            r2 = await settled_rss(proc.pid)
            times.append(await run_job(stub, "c", n))
        return {
            "n": n,
            "seconds": statistics.median(times),
            "worst": max(times),
            "peak_kib": (peak - r0) / n,
            "after_kib": (r1 - r0) / n,
            "warm_kib": (r2 - r1) / n,
            "rss_mib": r2 / 1024,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sizes", nargs="*", type=int, default=[100, 1000, 10000])
    p.add_argument("--no-pin", action="store_true")
    p.add_argument("--log-level", default="warning", help="the server's; at info it logs a line per join (to this stderr)")
    p.add_argument("--store", choices=["sqlite", "memory"], default="sqlite", help="the server's store (default: sqlite, as deployed)")
    args = p.parse_args()
    pin = not args.no_pin and pin_load_generator()
    tune_gc()
    print(f"# {os.cpu_count()} CPUs; server pinned to CPU 0, clients to CPU 1: {pin}; {WORKERS_PER_NODE} workers per node; store: {args.store}")
    print(f"{'workers':>8} {'first join -> last assignment':>30} {'worst of 3':>11}  RSS growth per member: {'peak':>9} {'after':>9} {'warm':>9}  {'server RSS':>10}")
    with tempfile.TemporaryDirectory() as state_dir:
        for n in args.sizes:
            store_args = ["--store", args.store, "--state-dir", os.path.join(state_dir, str(n))]
            run(n, pin, args.log_level, store_args)


def run(n: int, pin: bool, log_level: str, store_args: list[str]) -> None:
    r = asyncio.run(measure(n, pin, log_level, store_args))
    print(
        f"{r['n']:>8} {r['seconds']:>28.3f} s {r['worst']:>9.3f} s {'':>23}{r['peak_kib']:>5.1f} KiB {r['after_kib']:>5.1f} KiB"
        f" {r['warm_kib']:>5.1f} KiB {r['rss_mib']:>6.1f} MiB",
        flush=True,
    )


if __name__ == "__main__":
    main()
