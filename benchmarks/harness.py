"""What the benchmarks share: the server as its own pinned process, a pinned
load generator, and /proc readings. Not a test helper: benchmarks only."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
from collections.abc import Iterator


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


@contextlib.contextmanager
def server(*args: str, cpu: int | None = 0) -> Iterator[tuple[subprocess.Popen, int]]:
    """`python -m commctx.server` on a free port, pinned to `cpu`; yields (process, port)."""
    argv = [sys.executable, "-m", "commctx.server", "--host", "127.0.0.1", "--port", "0", *args]
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None and CAN_PIN else None
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, preexec_fn=pin)
    try:
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"server did not start: {line!r}")
        yield proc, int(line.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(10)


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
