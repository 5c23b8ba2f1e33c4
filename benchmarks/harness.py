"""What the benchmarks share: servers as their own processes, load generators,
and /proc readings. Not a test helper: benchmarks only."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import multiprocessing as mp
import os
import pathlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection

HERE = pathlib.Path(__file__).resolve().parent

# Decided once, before this process pins itself: afterwards its own affinity
# would say there is one CPU, and the server would inherit the client's core.
CAN_PIN = len(os.sched_getaffinity(0)) >= 2


def pin_load_generator() -> bool:
    """Moves this process to CPU 1 (the server gets CPU 0) when there are two."""
    if CAN_PIN:
        os.sched_setaffinity(0, {1})
    return CAN_PIN


def tune_gc() -> None:
    """The load generator stands for thousands of processes; keep its GC quiet."""
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


@dataclasses.dataclass
class Running:
    proc: subprocess.Popen
    port: int
    metrics_url: str | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.contextmanager
def start(argv: Sequence[str], *, cpu: int | None = None, metrics: bool = False) -> Iterator[Running]:
    """Runs a server process that prints 'listening on HOST:PORT' (and, with
    metrics, '... metrics on URL'); stops it on exit. BENCH_SERVER_ENV
    ('K=V,K=V') adds variables to the server's environment only (e.g.
    PYTHONASYNCIODEBUG=1 to log its slow callbacks)."""
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None and CAN_PIN else None
    extra = dict(kv.split("=", 1) for kv in os.environ.get("BENCH_SERVER_ENV", "").split(",") if kv)
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, text=True, preexec_fn=pin, env={**os.environ, **extra})
    try:
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"server did not start: {line!r}")
        running = Running(proc, int(line.rsplit(":", 1)[1]))
        if metrics:  # commctx: "... http on http://host:port/ (...)"; the relay: "... metrics on http://host:port/metrics"
            url = proc.stdout.readline().split(" on ", 1)[1].split()[0]
            running.metrics_url = url + "metrics" if url.endswith("/") else url
        yield running
    finally:
        proc.terminate()
        proc.wait(30)


def start_loads(target: Callable, n: int, procs: int, *args) -> tuple[list[Connection], list[mp.Process]]:
    """`procs` spawned load processes sharing `n` workers (or jobs): process k runs
    target(first, count, *args, conn) for its share; the parent talks to it over
    the returned pipe ends. Join the processes when done."""
    ctx = mp.get_context("spawn")
    pipes, processes = [], []
    share = n // procs
    for k in range(procs):
        parent, child = ctx.Pipe()
        count = share if k < procs - 1 else n - share * (procs - 1)
        process = ctx.Process(target=target, args=(k * share, count, *args, child), daemon=True)
        process.start()
        child.close()  # the child's end lives on in the child: a crashed one reads as EOFError here, not a hang
        pipes.append(parent)
        processes.append(process)
    return pipes, processes


def commctx_server(*args: str, cpu: int | None = None, metrics: bool = False) -> contextlib.AbstractContextManager[Running]:
    """`python -m commctx.server` on a free port (unpinned unless `cpu`); with
    `metrics`, its HTTP server (/metrics) on a free port too, else none."""
    extra = ["--http-port", "0" if metrics else "off"]
    return start([sys.executable, "-m", "commctx.server", "--host", "127.0.0.1", "--port", "0", *extra, *args], cpu=cpu, metrics=metrics)


def relay_server(*args: str, cpu: int | None = None, metrics: bool = False) -> contextlib.AbstractContextManager[Running]:
    """benchmarks/relay.py: the protocol without planning or store."""
    extra = ["--metrics-port", "0"] if metrics else []
    return start([sys.executable, str(HERE / "relay.py"), "--port", "0", *extra, *args], cpu=cpu, metrics=metrics)


@contextlib.contextmanager
def server(*args: str, cpu: int | None = 0) -> Iterator[tuple[subprocess.Popen, int]]:
    """`python -m commctx.server` on a free port, pinned to `cpu`; yields (process, port)."""
    with commctx_server(*args, cpu=cpu) as running:
        yield running.proc, running.port


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page as {series: value}."""
    values = {}
    for line in urllib.request.urlopen(url, timeout=30).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in KiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def receive(conn: Connection, what: str, timeout_s: float = 300.0):
    """The next message from a load process; raises if it failed (it sends ("error", traceback)) or fell silent."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"a load process said nothing for {timeout_s:g} s while {what}")
    message = conn.recv()
    if isinstance(message, tuple) and message and message[0] == "error":
        raise RuntimeError(f"a load process failed while {what}:\n{message[1]}")
    return message


async def recv_async(conn: Connection):
    """The next message from the driver, in a load process's event loop."""
    return await asyncio.to_thread(conn.recv)


def step(what: str) -> None:
    """A timestamped progress line on stderr (the results go to stdout)."""
    print(f"# {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)
