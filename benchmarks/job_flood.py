"""A flood of 100,000 new jobs against a server that holds at most 10,000
(its default --max-jobs): what is accepted and refused, how long a gRPC
health Check waits meanwhile, and the server's memory before, at its peak,
holding the jobs, and once they are gone.

Every Join creates a job of world_size 1 (its own job id). Such a job forms
at once and its Join is answered at once, so every Join ends in a status:
OK, or RESOURCE_EXHAUSTED once the server holds its maximum. The server's
lease TTL is 600 s, longer than the flood, and nobody renews: no accepted job
expires during the flood, so every slot taken stays taken and the cap is the
only thing that bounds the server's jobs (and its memory), which should be
exactly --max-jobs OK. (World_size 2 jobs would stay forming with their Joins
held open: 10,000 waiting calls would be measured along with the jobs, and
with a short wait_timeout_ms their members would be withdrawn and the slots
freed during the flood, so more than --max-jobs would be accepted.)

The server is its own process, unpinned, with its defaults otherwise (SQLite
store in a temporary --state-dir), but --caller-share 1: the flood comes from
one host, which by default may hold only a quarter of the jobs (a second
host's would then still find room; tests/test_tenants.py checks that). The load is --procs processes of
--channels connections each (a connection per job would need 100,000
sockets), every process keeping --window Joins in flight, spread over its
connections; all are connected before the clock starts. Meanwhile a prober
thread in this process calls grpc.health.v1 Check every 20 ms on its own
connection. Memory is the server's RSS: settled before the flood, its peak
(VmHWM), settled at the end of the flood (10,000 jobs held, connections
open), and "after": once the load has left every accepted job, closed its
connections and the server has idled 8 s. The bytes per job are (holding -
before) / accepted jobs, so they include whatever the refused calls left
behind. One more Join then shows that the slots are free again.

    python benchmarks/job_flood.py [--jobs 100000] [--procs 4] [--channels 250] [--window 64] [--repeat 1]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import tempfile
import time
from multiprocessing.connection import Connection

import grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import commctx_server, cpu_s, memory_kib, start_loads, tune_gc
from join_scale import settled_rss
from reform_scale import Prober

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def single(job: str) -> pb.JoinRequest:
    return pb.JoinRequest(job_id=job, spec=pb.JobSpec(world_size=1), node_key="n", address="127.0.0.1", master_port=29500)


def load(first: int, count: int, address: str, channels: int, window: int, conn: Connection) -> None:
    tune_gc()
    asyncio.run(_load(address, first, count, channels, window, conn))


async def _load(address: str, first: int, count: int, channels: int, window: int, conn: Connection) -> None:
    chans = [grpc.aio.insecure_channel(address, options=OWN_CONNECTION) for _ in range(channels)]
    await asyncio.gather(*(asyncio.wait_for(c.channel_ready(), 120) for c in chans))
    stubs = [pb_grpc.RendezvousStub(c) for c in chans]
    codes: collections.Counter[str] = collections.Counter()
    accepted: list[tuple[int, str, str]] = []
    left = 0

    async def join(lane: int) -> None:
        for i in range(lane, count, window):
            try:
                r = await stubs[i % channels].Join(single(f"flood-{first + i}"), timeout=120)
            except grpc.aio.AioRpcError as exc:
                codes[exc.code().name] += 1
            else:
                codes["OK"] += 1
                accepted.append((i, r.member_id, r.member_secret))

    async def leave(lane: int) -> None:
        nonlocal left
        for i, member_id, secret in accepted[lane::window]:
            await stubs[i % channels].Leave(pb.LeaveRequest(job_id=f"flood-{first + i}", member_id=member_id, member_secret=secret),
                                            timeout=120)
            left += 1

    conn.send("connected")
    await asyncio.to_thread(conn.recv)
    started = time.monotonic()
    await asyncio.gather(*(join(lane) for lane in range(window)))
    conn.send((started, time.monotonic(), dict(codes)))
    await asyncio.to_thread(conn.recv)
    await asyncio.gather(*(leave(lane) for lane in range(window)))
    for c in chans:
        await c.close()
    conn.send(left)


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as state, \
            commctx_server("--log-level", "warning", "--lease-ttl-s", "600", "--state-dir", state,
                           "--caller-share", "1") as server:  # one caller (this host) may take the whole --max-jobs
        pid = server.proc.pid
        pipes, workers = start_loads(load, args.jobs, args.procs, server.address, args.channels, args.window)
        for c in pipes:
            assert c.poll(300) and c.recv() == "connected"
        before = settled_rss(pid)
        prober = Prober(server.address)
        time.sleep(1)  # the prober connected, before the clock starts
        c0, go = cpu_s(pid), time.monotonic()
        for c in pipes:
            c.send("go")
        flooded = [c.recv() for c in pipes]
        c1 = cpu_s(pid)
        end = max(e for _, e, _ in flooded)
        prober.stop()
        peak = memory_kib(pid)["VmHWM"]
        held = settled_rss(pid)
        for c in pipes:
            c.send("leave")
        left = sum(c.recv() for c in pipes)
        for w in workers:
            w.join(60)
        time.sleep(8)
        after = settled_rss(pid)
        with grpc.insecure_channel(server.address) as ch:
            pb_grpc.RendezvousStub(ch).Join(single("after-the-flood"), timeout=30)
    codes = collections.Counter()
    for _, _, counted in flooded:
        codes.update(counted)
    health = [dt for t0, dt in prober.samples if go <= t0 <= end]
    return {"seconds": end - min(s for s, _, _ in flooded), "cpu": c1 - c0, "codes": codes, "left": left,
            "health": (statistics.median(health), statistics.quantiles(health, n=100, method="inclusive")[98], max(health), len(health)),
            "rss": (before, peak, held, after)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--channels", type=int, default=250, help="connections per load process")
    p.add_argument("--window", type=int, default=64, help="Joins in flight per load process")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args()
    print(f"# {args.jobs} Joins, each a new world_size-1 job, from {args.procs} processes x {args.channels} connections, "
          f"{args.window} in flight each; server unpinned, defaults (--max-jobs 10000, SQLite store), lease TTL 600 s")
    for _ in range(args.repeat):
        r = measure(args)
        codes = ", ".join(f"{name} {n}" for name, n in r["codes"].most_common())
        p50, p99, worst, probes = r["health"]
        before, peak, held, after = (kib / 1024 for kib in r["rss"])
        print(f"flood: {r['seconds']:.1f} s ({args.jobs / r['seconds']:.0f} Joins/s), server CPU {r['cpu']:.1f} s; answers: {codes}; "
              f"left afterwards: {r['left']}, then one more new job: OK", flush=True)
        print(f"  health Check during the flood: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {worst * 1000:.1f} ms "
              f"({probes} probes)", flush=True)
        print(f"  server RSS: before {before:.1f} MiB, peak {peak:.1f} MiB, holding the jobs {held:.1f} MiB "
              f"({(held - before) * 1024 * 1024 / max(r['codes']['OK'], 1):.0f} B per job), after they left {after:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
