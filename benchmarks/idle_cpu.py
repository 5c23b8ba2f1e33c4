"""An idle server holding many members: how much CPU does it spend doing nothing?

--members workers join --jobs jobs (through a few connections; the join speed
is not measured here), with a lease long enough that none expires during the
run; then the clients disconnect and the server's user + system CPU is read
over --seconds. The server runs as deployed (its own process, unpinned,
SQLite store, garbage collection paced on a timer). Nothing scans every
member on a timer: leases wait in a heap, so an idle server only runs its
50 ms loop-lag timer and its 20 ms young-generation collections.

    python benchmarks/idle_cpu.py [--members 100000] [--jobs 10000] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import commctx_server, cpu_s, memory_kib, tune_gc


async def fill(address: str, members: int, jobs: int) -> None:
    per_job = members // jobs
    channels = [grpc.aio.insecure_channel(address) for _ in range(8)]
    stubs = [pb_grpc.RendezvousStub(c) for c in channels]
    for wave in range(0, jobs, 500):  # 500 jobs at a time
        await asyncio.gather(*(
            stubs[(j * per_job + i) % 8].Join(pb.JoinRequest(
                job_id=f"job-{j}", spec=pb.JobSpec(world_size=per_job), node_key=f"node{i // 8}", address="127.0.0.1",
                master_port=20000 + i, wait_timeout_ms=300_000))
            for j in range(wave, min(wave + 500, jobs)) for i in range(per_job)
        ))
    for c in channels:
        await c.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, default=100_000)
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--seconds", type=float, default=30.0)
    args = p.parse_args()
    tune_gc()
    with tempfile.TemporaryDirectory() as state, \
            commctx_server("--log-level", "warning", "--lease-ttl-s", "3600", "--state-dir", state,
                           "--caller-share", "1") as server:  # every job comes from one caller (this host)
        rss0 = memory_kib(server.proc.pid)["VmRSS"]
        t = time.monotonic()
        asyncio.run(fill(server.address, args.members, args.jobs))
        filled = time.monotonic() - t
        time.sleep(5)  # let the last commits and collections finish
        c0, t0 = cpu_s(server.proc.pid), time.monotonic()
        time.sleep(args.seconds)
        c1, t1 = cpu_s(server.proc.pid), time.monotonic()
        rss = memory_kib(server.proc.pid)["VmRSS"]
    print(f"{args.members} members in {args.jobs} jobs (joined in {filled:.1f} s): idle server CPU "
          f"{100 * (c1 - c0) / (t1 - t0):.2f} % of one core over {t1 - t0:.0f} s; RSS {rss / 1024:.0f} MiB "
          f"({(rss - rss0) / args.members:.2f} KiB per member)")


if __name__ == "__main__":
    main()
