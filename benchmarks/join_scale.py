"""N simulated workers join one job; how long until the last has its assignment,
and how much memory the server holds per member.

The server runs as its own process (`python -m commctx.server`, as deployed);
the workers are grpc.aio clients in this process, 8 per node key.

    python benchmarks/join_scale.py [N ...]     (default: 100 1000 10000)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

WORKERS_PER_NODE = 8
CHANNELS = 8


def rss_kib(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields


def start_server() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "commctx.server", "--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING"],
        stderr=None,
        stdout=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


async def run_job(stubs: list, job_id: str, n: int) -> tuple[float, list[str]]:
    start = time.perf_counter()

    async def worker(i: int) -> str:
        stub = stubs[i % len(stubs)]
        request = pb.JoinRequest(
            job_id=job_id, spec=pb.JobSpec(world_size=n), node_key=f"node{i // WORKERS_PER_NODE}",
            address="127.0.0.1", master_port=20000 + i % 40000, wait_timeout_ms=120_000,
        )
        response = await stub.Join(request)
        if response.assignment.world_size != n:
            raise RuntimeError(f"bad assignment {response.assignment}")
        return response.member_id

    members = await asyncio.gather(*(worker(i) for i in range(n)))
    return time.perf_counter() - start, members


async def measure(n: int) -> dict[str, float]:
    proc, port = start_server()
    try:
        channels = [
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(CHANNELS)
        ]
        stubs = [pb_grpc.RendezvousStub(c) for c in channels]
        await run_job(stubs, "warmup", 16)  # connections up, code paths warm
        before = rss_kib(proc.pid)
        seconds, members = await run_job(stubs, "bench", n)
        after = rss_kib(proc.pid)
        for i in range(0, n, 256):
            await asyncio.gather(*(stubs[0].Leave(pb.LeaveRequest(job_id="bench", member_id=m)) for m in members[i:i + 256]))
        for c in channels:
            await c.close()
        return {
            "n": n,
            "seconds": seconds,
            "rss_growth_kib_per_member": (after["VmRSS"] - before["VmRSS"]) / n,
            "peak_growth_kib_per_member": (after["VmHWM"] - before["VmRSS"]) / n,
            "rss_mib": after["VmRSS"] / 1024,
        }
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [100, 1000, 10000]
    print(f"# {os.cpu_count()} CPUs; server: python -m commctx.server; {CHANNELS} client channels")
    print(f"{'workers':>8} {'first join -> last assignment':>30} {'server RSS':>11} {'RSS growth/member':>18} {'peak growth/member':>19}")
    for n in sizes:
        r = asyncio.run(measure(n))
        print(
            f"{r['n']:>8} {r['seconds']:>28.3f} s {r['rss_mib']:>7.1f} MiB {r['rss_growth_kib_per_member']:>14.2f} KiB"
            f" {r['peak_growth_kib_per_member']:>15.2f} KiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
