"""Health Checks during a re-form at 10,000 members: how long the re-form
takes, and how long the slowest grpc.health.v1 Check waited meanwhile, on the
main port and on the health-only port (--health-port, what Kubernetes probes).
The commctx server against the relay (benchmarks/relay.py: the same protocol,
no planning, no store, health on its one port, as a trivial grpc.aio server
has it), alternating, in one run.

Each server runs as its own process, unpinned, with its defaults (commctx:
SQLite store, GC pacing; --health-port 0 and --metrics-port 0). The members
are those of benchmarks/reform_scale.py: grpc.aio clients in --procs load
processes over --channels connections each, every member with a Session
stream renewing every TTL/3 (renewals spread over the period). Once the
sessions are open, one member (rank N/2) stops renewing and hangs, its stream
left open (a hung process: both servers find it by its lease); the re-form
runs from its lease running out (last renewal + TTL) to the last survivor
holding its generation-2 assignment. Meanwhile one prober per port (a thread
of this process, a sync gRPC channel of its own) calls Check(service="")
every 20 ms with a 60 s deadline and keeps every call's start and latency; the worst is
the longest Check that overlapped the re-form, and "> 1 s" counts those that a
probe with Kubernetes' default timeout (1 s) would have failed. The loop lag
is the server's own gauge (the worst lateness of a 50 ms timer over 10 s);
"load" is the machine's 1-minute load average as the run began (the machine
is shared: a busy one stretches every number).

Each server is measured --repeat times, alternating; every run is printed,
then per server the median and range.

    python benchmarks/reform_health.py [--members 10000] [--procs 1] [--channels 32] [--lease-ttl-s 10] [--repeat 3] [--servers commctx,relay] [--samples FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import reform_scale
from reform_scale import step
from harness import Running, relay_server, scrape, start, start_loads

PROBE_EVERY_S = 0.02
PROBE_TIMEOUT_S = 1.0  # Kubernetes' default probe timeout


class Prober:
    """Check(service="") every 20 ms on one address; keeps (start, seconds) of each."""

    def __init__(self, address: str, name: str) -> None:
        self.name = name
        self._metadata = (("x-prober", name),)  # which prober, for a server traced with BENCH_SERVER_ENV
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address,), name=f"prober-{name}", daemon=True)
        self._thread.start()

    def _run(self, address: str) -> None:
        with grpc.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=60, wait_for_ready=True)  # connected first
            while not self._stop.is_set():
                t0 = time.monotonic()
                stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=60, metadata=self._metadata)
                self.samples.append((t0, time.monotonic() - t0))
                self._stop.wait(PROBE_EVERY_S)

    def during(self, since: float, until: float) -> list[tuple[float, float]]:
        """The Checks that overlapped [since, until]."""
        return [(t0, dt) for t0, dt in self.samples if t0 <= until and t0 + dt >= since]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(90)


@contextlib.contextmanager
def commctx_server(ttl: float, state: str) -> Iterator[tuple[Running, str]]:
    """commctx-server with a health-only port and metrics on free ports; yields (server, health address)."""
    argv = [sys.executable, "-m", "commctx.server", "--host", "127.0.0.1", "--port", "0", "--health-port", "0",
            "--metrics-port", "0", "--log-level", "warning", "--lease-ttl-s", str(ttl), "--state-dir", state]
    with start(argv) as running:
        health = None
        while health is None or running.metrics_url is None:
            line = running.proc.stdout.readline()
            if not line:
                raise RuntimeError("the server ended before naming its health and metrics ports")
            where = line.split(" on ", 1)[1].split()[0] if " on " in line else ""
            if " health on " in line:
                health = where
            elif " metrics on " in line or " http on " in line:  # "metrics on URL", or "http on http://host:port/ (...)"
                running.metrics_url = where + "metrics" if where.endswith("/") else where
        yield running, health


def measure(kind: str, n: int, procs: int, channels: int, ttl: float) -> dict:
    load_average = os.getloadavg()[0]  # others' work on the machine, before this run's
    with tempfile.TemporaryDirectory() as state, contextlib.ExitStack() as stack:
        if kind == "commctx":
            server, health_address = stack.enter_context(commctx_server(ttl, state))
        else:
            server, health_address = stack.enter_context(relay_server("--lease-ttl-s", str(ttl), metrics=True)), None
        pipes, workers = start_loads(reform_scale.load, n, procs, server.address, n, ttl, channels)
        try:
            step(f"{kind}: {n} joining")
            probers: list[Prober] = []

            def settled() -> None:
                probers.append(Prober(server.address, "main"))
                if health_address:
                    probers.append(Prober(health_address, "health-port"))
                time.sleep(0.5)

            expired, finished, results = reform_scale.reform(pipes, n, ttl, settled)
            time.sleep(0.2)  # a Check still in flight at the end is counted whole
            metrics = scrape(server.metrics_url)
            for p in probers:
                p.stop()
            for c in pipes:
                c.send("stop")
            for w in workers:
                w.join(60)
        finally:
            for w in workers:
                if w.is_alive():
                    w.kill()
        row = {"kind": kind, "seconds": finished - expired, "held": sum(r[1] for r in results),
               "survivors": sum(r[2] for r in results), "lag": metrics["commctx_event_loop_lag_max_seconds"],
               "expired": expired, "finished": finished, "load": load_average,
               "first": min(r[3] for r in results) - expired}
        for p in probers:
            during = p.during(expired, finished)
            row[p.name] = max((dt for _, dt in during), default=float("nan"))
            row[p.name + " >1s"] = sum(dt > PROBE_TIMEOUT_S for _, dt in during)
            row[p.name + " samples"] = p.samples
        return row


def summary(values: list[float], scale: float = 1.0, unit: str = "s", digits: int = 2) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    return (f"{statistics.median(values) * scale:.{digits}f} {unit} "
            f"({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, default=10_000)
    p.add_argument("--procs", type=int, default=1, help="load processes")
    p.add_argument("--channels", type=int, default=32, help="connections per load process")
    p.add_argument("--lease-ttl-s", type=float, default=10.0)
    p.add_argument("--servers", default="commctx,relay")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--samples", help="also write every Check (start relative to the expiry, seconds) as JSON here")
    args = p.parse_args()
    print(f"$ python benchmarks/reform_health.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"# {time.strftime('%Y-%m-%d %H:%M %Z')}; {os.cpu_count()} cores, Python {sys.version.split()[0]}, "
          f"grpcio {grpc.__version__}; load average {os.getloadavg()[0]:.2f} at the start")
    print(f"# {args.members} members with sessions from {args.procs} load process(es) x {args.channels} connections; "
          f"lease TTL {args.lease_ttl_s:g} s; servers unpinned; Check every {PROBE_EVERY_S * 1000:g} ms per port")
    print("# re-form: the hung member's lease out (last renewal + TTL) -> the last survivor holds generation 2; worst Check:"
          " the longest Check(\"\") that overlapped the re-form, per port, from a prober thread of this process with a"
          " connection of its own (60 s deadline); > 1 s: how many of those a 1 s probe timeout would have failed; first:"
          " the first survivor at generation 2, after the lease ran out (the server's removal, plan and commit; the"
          " sends follow)")
    print(f"{'server':<8} {'re-form':>9} {'first':>8} {'at gen 2':>11} {'loop lag':>9} {'worst Check main':>17} {'> 1 s':>6} "
          f"{'worst Check health-port':>24} {'> 1 s':>6} {'load':>5}")
    rows: dict[str, list[dict]] = {}
    dump = []
    for _ in range(args.repeat):
        for kind in args.servers.split(","):
            try:
                r = measure(kind, args.members, args.procs, args.channels, args.lease_ttl_s)
            except (RuntimeError, TimeoutError, AssertionError) as exc:  # one void run does not end the others
                print(f"{kind:<8} void run: {str(exc).strip().splitlines()[-1]}", flush=True)
                continue
            rows.setdefault(kind, []).append(r)
            hp = (f"{r['health-port'] * 1000:>21.1f} ms {r['health-port >1s']:>6}" if "health-port" in r
                  else f"{'-':>24} {'-':>6}")
            print(f"{kind:<8} {r['seconds']:>7.3f} s {r['first']:>6.3f} s {r['held']:>5}/{r['survivors']:<5} "
                  f"{r['lag'] * 1000:>6.1f} ms "
                  f"{r['main'] * 1000:>14.1f} ms {r['main >1s']:>6} {hp} {r['load']:>5.2f}", flush=True)
            dump.append({"kind": kind, "seconds": r["seconds"], "expired": r["expired"], "finished": r["finished"], **{
                name: [(round(t0 - r["expired"], 4), round(dt, 4)) for t0, dt in r[name + " samples"]
                       if r["expired"] - 2 <= t0 <= r["finished"] + 1]
                for name in ("main", "health-port") if name in r}})
    print("median (range) per server:")
    print(f"{'server':<8} {'re-form':>20} {'first':>20} {'worst Check main':>22} {'worst Check health-port':>24}")
    for kind, rs in rows.items():
        print(f"{kind:<8} {summary([r['seconds'] for r in rs]):>20} {summary([r['first'] for r in rs], 1, 's', 3):>20} "
              f"{summary([r['main'] for r in rs], 1000, 'ms', 0):>22} "
              f"{summary([r.get('health-port', float('nan')) for r in rs], 1000, 'ms', 0):>24}")
    if "commctx" in rows and "relay" in rows:
        def median(kind: str, key: str) -> float:
            return statistics.median(r[key] for r in rows[kind])

        relay_health = median("relay", "main")
        print(f"commctx/relay, medians: re-form {median('commctx', 'seconds') / median('relay', 'seconds'):.2f}x; "
              f"worst Check main port {median('commctx', 'main') / relay_health:.2f}x, "
              f"health-only port {median('commctx', 'health-port') / relay_health:.2f}x (of the relay's main port)")
    if args.samples:
        with open(args.samples, "w") as f:
            json.dump(dump, f)


if __name__ == "__main__":
    main()
