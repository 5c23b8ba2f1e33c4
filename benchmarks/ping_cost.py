"""What the client's keepalive pings cost the server: N idle connections, each
with a Join waiting (a job that never forms, so nothing else is read or
written), dialled with the client library's channel options (a ping every
3 s with nothing to read: client/channels.py) or without its ping options.
Prints the server's CPU over --seconds once every connection waits, for each.

As a real fleet: one TCP connection per worker (grpc.use_local_subchannel_pool),
from --procs load processes; the server is its own process, unpinned, with its
defaults. Each setting is measured --repeat times, alternating.

    python benchmarks/ping_cost.py [--procs 2] [--seconds 20] [--repeat 2] [N]   (default N: 2000)
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc

from commctx.channels import CHANNEL_OPTIONS
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import commctx_server, cpu_s, receive, start_loads, tune_gc

PING_OPTIONS = {"grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms", "grpc.http2.ping_timeout_ms",
                "grpc.http2.max_pings_without_data"}


def load(first: int, count: int, address: str, total: int, pings: bool, seconds: float, conn) -> None:
    tune_gc()
    asyncio.run(_load(address, first, count, total, pings, seconds, conn))


async def _load(address: str, first: int, count: int, total: int, pings: bool, seconds: float, conn) -> None:
    options = [o for o in CHANNEL_OPTIONS if pings or o[0] not in PING_OPTIONS] + [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(count)]
    await asyncio.gather(*(asyncio.wait_for(c.channel_ready(), 120) for c in channels))
    calls = [pb_grpc.RendezvousStub(c).Join(pb.JoinRequest(
        job_id="idle", spec=pb.JobSpec(world_size=total + 1), node_key=f"n{first + i}", address="127.0.0.1",
        master_port=20000 + first + i, wait_timeout_ms=round((seconds + 60) * 1000))) for i, c in enumerate(channels)]
    conn.send("waiting")
    await asyncio.to_thread(conn.recv)
    for call in calls:
        call.cancel()
    for c in channels:
        await c.close()
    conn.send("closed")


def measure(n: int, procs: int, pings: bool, seconds: float) -> float:
    """Server CPU seconds per second while n Joins wait on n connections."""
    with commctx_server() as server:
        pipes, processes = start_loads(load, n, procs, server.address, n, pings, seconds)
        for p in pipes:
            receive(p, "the load's connections")
        time.sleep(3.0)  # every Join registered and the burst's work done
        before, t0 = cpu_s(server.proc.pid), time.monotonic()
        time.sleep(seconds)
        used = (cpu_s(server.proc.pid) - before) / (time.monotonic() - t0)
        for p in pipes:
            p.send("stop")
        for p in pipes:
            receive(p, "the load's close")
        for process in processes:
            process.join(30)
    return used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=2000)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    print(f"# {args.n} idle connections, a Join waiting on each, from {args.procs} load processes; server unpinned; "
          f"its CPU over {args.seconds:g} s")
    results: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeat):
        for pings in (False, True):
            results[pings].append(measure(args.n, args.procs, pings, args.seconds))
            print(f"{'pings every 3 s' if pings else 'no pings':>16}: {100 * results[pings][-1]:5.1f} % of a core",
                  flush=True)
    for pings in (False, True):
        runs = sorted(results[pings])
        print(f"{'pings every 3 s' if pings else 'no pings':>16}: median {100 * runs[len(runs) // 2]:5.1f} % of a core "
              f"({', '.join(f'{100 * r:.1f}' for r in results[pings])})")


if __name__ == "__main__":
    main()
