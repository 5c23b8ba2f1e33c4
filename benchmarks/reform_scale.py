"""A world of N members re-forms after one expires: how long until every
survivor holds generation 2, how late the server's event loop ran meanwhile,
and how long a health Check waited. The commctx server against the relay
(benchmarks/relay.py: the same protocol, no planning, no store), driven by
the same load generator in the same run.

Each server runs as its own process, unpinned, with its defaults (commctx:
SQLite store). The members are grpc.aio clients in --procs processes, spread
over --channels connections per process; each holds a Session stream and
renews every TTL/3, renewals spread over the period, as CommContext does
(rank 0 offers a new spare port on its session). One member (rank N/2) stops
renewing and hangs, its stream open (a hung process, found by its lease). The clock starts when its lease runs out (its last renewal + TTL)
and stops when the last survivor has its generation-2 assignment. Meanwhile
a prober calls grpc.health.v1 Check every 20 ms; the loop lag is the
server's own gauge (the worst lateness of a 50 ms timer over the last 10 s).

Each server is measured --repeat times, alternating; every run is printed.

    python benchmarks/reform_scale.py [--members 10000] [--procs 4] [--channels 25] [--lease-ttl-s 10] [--repeat 2] [--servers commctx,relay]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import commctx_server, receive, recv_async, relay_server, scrape, start_loads, step, tune_gc

JOB = "reform"


class Member:
    def __init__(self, stub, member_id: str, secret: str, rank: int, spare: int, ttl: float) -> None:
        self.stub, self.member_id, self.secret, self.rank, self.spare, self.ttl = stub, member_id, secret, rank, spare, ttl
        self.generation = 1
        self.call = None
        self.lock = asyncio.Lock()  # one write at a time on a stream
        self.opened = asyncio.Event()
        self.alive = True
        self.last_renewal = 0.0
        self.gen2_at: float | None = None
        self.hung = asyncio.Event()  # it stopped renewing
        self.release = asyncio.Event()  # the run is over: end the stream

    async def send(self) -> None:
        async with self.lock:
            await self.call.write(pb.SessionRequest(job_id=JOB, member_id=self.member_id, member_secret=self.secret, generation=self.generation,
                                                    spare_port=self.spare))
        self.last_renewal = time.monotonic()

    async def run(self, delay: float) -> None:
        self.call = self.stub.Session()
        await self.send()
        reader = asyncio.ensure_future(self.read())
        await asyncio.sleep(delay)  # spread renewals over the period
        while self.alive:
            await self.send()
            await asyncio.sleep(self.ttl / 3)
        # A member that stops renewing hangs, its stream left open, as a hung process
        # does: both servers find it by its lease. (One that ended its stream would be
        # removed by commctx at --reconnect-grace-s, by the relay at its lease.)
        self.hung.set()
        await self.release.wait()
        self.call.cancel()
        reader.cancel()

    async def read(self) -> None:
        async for event in self.call:
            kind = event.WhichOneof("event")
            if kind == "lease_ttl_ms":
                self.opened.set()
            elif kind == "assignment":
                self.gen2_at = time.monotonic()
                self.generation = event.assignment.generation


def load(first: int, count: int, address: str, total: int, ttl: float, channels: int, conn: Connection) -> None:
    """A load process (harness.start_loads' target): `count` members from `first` on."""
    tune_gc()
    try:
        asyncio.run(_load(address, first, count, total, ttl, channels, conn))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise






async def _load(address: str, first: int, count: int, total: int, ttl: float, channels: int, conn: Connection) -> None:
    chans = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(channels)]
    stubs = [pb_grpc.RendezvousStub(c) for c in chans]
    spec = pb.JobSpec(world_size=total, elastic=pb.Elastic(min_size=total - 1, last_call_ms=600_000))
    requests = [pb.JoinRequest(job_id=JOB, spec=spec, node_key=f"node{(first + i) // 8}", address="127.0.0.1",
                               master_port=20000 + (first + i) % 40000, wait_timeout_ms=600_000) for i in range(count)]
    joined = await asyncio.gather(*(stubs[i % channels].Join(r) for i, r in enumerate(requests)))
    members = [Member(stubs[i % channels], r.member_id, r.member_secret, r.assignment.rank,
                      50000 + (first + i) % 10000 if r.assignment.rank == 0 else requests[i].master_port, ttl)
               for i, r in enumerate(joined)]
    conn.send("joined")
    await recv_async(conn)
    tasks = [asyncio.ensure_future(m.run(ttl / 3 * (first + i) / total)) for i, m in enumerate(members)]
    # Within two leases, or the run is void (a machine so busy that leases ran out before the sessions opened).
    await asyncio.wait_for(asyncio.gather(*(m.opened.wait() for m in members)), 2 * ttl)
    conn.send("open")
    victim_rank = await recv_async(conn)
    victim = next((m for m in members if m.rank == victim_rank), None)
    if victim is not None:
        victim.alive = False
        await victim.hung.wait()
        conn.send(victim.last_renewal)
    survivors = [m for m in members if m is not victim]
    deadline = time.monotonic() + ttl + 120
    while any(m.gen2_at is None for m in survivors) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    done = [m.gen2_at for m in survivors if m.gen2_at is not None]
    conn.send((max(done, default=0.0), len(done), len(survivors), min(done, default=0.0)))
    await recv_async(conn)
    for m in members:
        m.alive = False
        m.release.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in chans:
        await c.close()


class Prober:
    """Health Check every 20 ms; keeps (start, seconds) of each."""

    def __init__(self, address: str) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address,), daemon=True)
        self._thread.start()

    def _run(self, address: str) -> None:
        with grpc.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not self._stop.is_set():
                t0 = time.monotonic()
                stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=60)
                self.samples.append((t0, time.monotonic() - t0))
                self._stop.wait(0.02)

    def worst(self, since: float, until: float) -> float:
        return max((dt for t0, dt in self.samples if since <= t0 <= until), default=0.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(90)




def reform(pipes: list[Connection], n: int, ttl: float, settled: Callable[[], object]) -> tuple[float, float, list]:
    """Drives the load processes through one run: the Joins, the sessions, a
    wait until every member has renewed on its own schedule and the expiry comes
    over 10 s after the sessions opened (so the lag gauge's window, the last
    10 s, holds the re-form, not the burst of opening), `settled()`, then member
    N/2 hangs. Returns (its lease's end, the last survivor at generation 2, each
    load process's result: (its last survivor at generation 2, how many got
    there, its survivors, its first survivor at generation 2))."""
    for c in pipes:
        assert receive(c, "joining") == "joined"
    step("joined; opening sessions")
    for c in pipes:
        c.send("sessions")
    for c in pipes:
        assert receive(c, "opening sessions") == "open"
    step("sessions open")
    time.sleep(max(ttl / 3 + 1, 11 - ttl))
    settled()
    for c in pipes:
        c.send(n // 2)
    step("one member stops renewing")
    ready = wait(pipes, timeout=300)
    last_renewal = next(receive(c, "stopping a member") for c in ready if c.poll())
    results = [receive(c, "re-forming", ttl + 180) for c in pipes]
    step("re-formed")
    return last_renewal + ttl, max(r[0] for r in results), results


def measure(kind: str, n: int, procs: int, channels: int, ttl: float) -> dict:
    with tempfile.TemporaryDirectory() as state:
        make = commctx_server("--log-level", "warning", "--lease-ttl-s", str(ttl), "--state-dir", state, metrics=True) \
            if kind == "commctx" else relay_server("--lease-ttl-s", str(ttl), metrics=True)
        with make as server:
            pipes, workers = start_loads(load, n, procs, server.address, n, ttl, channels)
            step(f"{kind}: {n} joining")
            probed: list = []
            expired, finished, results = reform(pipes, n, ttl, lambda: probed.extend(
                [Prober(server.address), scrape(server.metrics_url)]))
            prober, before = probed
            metrics = scrape(server.metrics_url)
            lag = metrics["commctx_event_loop_lag_max_seconds"]
            gc_s = sum(metrics[k] - before.get(k, 0.0) for k in metrics if k.startswith("commctx_gc_pause_seconds_sum"))
            step(f"loop lag before the stop {before.get('commctx_event_loop_lag_max_seconds', 0) * 1000:.1f} ms; "
                 f"GC from the stop to the re-form: {gc_s * 1000:.0f} ms")
            prober.stop()
            held = sum(r[1] for r in results)
            joined = None
            if kind == "commctx":
                with grpc.insecure_channel(server.address) as ch:
                    d = pb_grpc.RendezvousStub(ch).DescribeJob(pb.DescribeJobRequest(job_id=JOB), timeout=30)
                    joined = (d.joined, d.generation)
            for c in pipes:
                c.send("stop")
            for w in workers:
                w.join(60)
            return {"kind": kind, "seconds": finished - expired, "held": held, "survivors": sum(r[2] for r in results),
                    "lag": lag, "health": prober.worst(expired - 1.0, finished), "joined": joined}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, default=10_000)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--channels", type=int, default=25, help="connections per load process")
    p.add_argument("--lease-ttl-s", type=float, default=10.0)
    p.add_argument("--servers", default="commctx,relay")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    print(f"# {args.members} members with sessions from {args.procs} processes x {args.channels} connections; "
          f"lease TTL {args.lease_ttl_s:g} s; servers unpinned")
    print(f"{'server':<8} {'expiry -> all survivors at gen 2':>33} {'survivors at gen 2':>19} {'worst loop lag':>15} {'worst health Check':>19}")
    rows: dict[str, list[dict]] = {}
    for _ in range(args.repeat):
        for kind in args.servers.split(","):
            r = measure(kind, args.members, args.procs, args.channels, args.lease_ttl_s)
            rows.setdefault(kind, []).append(r)
            extra = f"  (server: {r['joined'][0]} members, generation {r['joined'][1]})" if r["joined"] else ""
            print(f"{kind:<8} {r['seconds']:>31.3f} s {r['held']:>9}/{r['survivors']:<9} {r['lag'] * 1000:>12.1f} ms "
                  f"{r['health'] * 1000:>16.1f} ms{extra}", flush=True)
    if "commctx" in rows and "relay" in rows:
        def mean(kind: str, key: str) -> float:
            return sum(r[key] for r in rows[kind]) / len(rows[kind])

        print(f"mean ratio commctx/relay: re-form {mean('commctx', 'seconds') / mean('relay', 'seconds'):.2f}x, "
              f"worst health Check {mean('commctx', 'health') / max(mean('relay', 'health'), 1e-9):.2f}x")


if __name__ == "__main__":
    main()
