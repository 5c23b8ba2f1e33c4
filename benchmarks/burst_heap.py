"""Where the memory a burst of waiting Joins leaves behind sits: RSS growth per
member against CPython's object allocator (pymalloc), as the server's own
sys._debugmallocstats() reports it.

N workers (default 10,000) join one job, as `join_scale.py --shared` does: 4
load processes, one connection each, the server unpinned with its SQLite
store. The world forms when the last one arrives, so all N calls wait in the
server together. Read before the burst and once the clients have closed
their connections and the server has idled 8 s (it collects its garbage and
trims glibc's heap once calm). The server is `python -m commctx.server`
started through a wrapper that only adds a SIGUSR1 handler writing the
statistics to a file.

    python benchmarks/burst_heap.py [N]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import time

from harness import memory_kib, start, start_loads
from join_scale import load, settled_rss

WRAPPER = """
import os, runpy, signal, sys
def stats(*_):
    fd = os.open(os.environ["BURST_HEAP_STATS"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
signal.signal(signal.SIGUSR1, stats)
sys.argv[0] = "commctx-server"
runpy.run_module("commctx.server", run_name="__main__", alter_sys=True)
"""

FIELDS = {
    "arenas": r"# arenas allocated current\s*=\s*([\d,]+)",
    "live": r"# bytes in allocated blocks\s*=\s*([\d,]+)",
    "free_in_pools": r"# bytes in available blocks\s*=\s*([\d,]+)",
    "empty_pools": r"(\d+) unused pools \* \d+ bytes",
}


def heap_stats(pid: int, path: str) -> dict[str, int]:
    """The server's pymalloc statistics (bytes; arenas as a count)."""
    os.unlink(path) if os.path.exists(path) else None
    os.kill(pid, signal.SIGUSR1)
    for _ in range(100):
        time.sleep(0.1)
        if os.path.exists(path) and "Total" in open(path).read():
            break
    text = open(path).read()
    out = {k: int(re.search(p, text).group(1).replace(",", "")) for k, p in FIELDS.items()}
    out["empty_pools"] *= 16384
    out["rss"] = memory_kib(pid)["VmRSS"] * 1024
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("n", nargs="?", type=int, default=10_000, metavar="N", help="workers that join the one job (default 10,000)")
    n = p.parse_args().n
    with tempfile.TemporaryDirectory() as state:
        stats_path = os.path.join(state, "heap.txt")
        os.environ["BURST_HEAP_STATS"] = stats_path
        argv = [sys.executable, "-c", WRAPPER, "--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
                "--lease-ttl-s", "600", "--state-dir", state]
        with start(argv) as server:
            pid = server.proc.pid
            settled_rss(pid)
            before = heap_stats(pid, stats_path)
            pipes, workers = start_loads(load, n, 4, server.address, "burst", n, True, 1)
            for c in pipes:
                assert c.poll(300) and c.recv() == "connected"
            for c in pipes:
                c.send("go")
            ranks = sorted(r for c in pipes for r in c.recv()[2])
            assert ranks == list(range(n)), "ranks are not a permutation"
            for c in pipes:
                c.send("close")
            for c in pipes:
                assert c.recv() == "closed"
            time.sleep(8)
            settled_rss(pid)
            after = heap_stats(pid, stats_path)
            for w in workers:
                w.join(60)
    grow = {k: after[k] - before[k] for k in after}
    arena_bytes = grow["arenas"] * 1024 * 1024
    print(f"# {n:,} workers joined one job, all waiting together (4 load processes, one connection each); "
          f"read 8 s after the clients closed")
    print(f"{'':<46} {'growth':>10} {'per member':>11}")
    rows = [
        ("RSS", grow["rss"]),
        (f"pymalloc arenas ({before['arenas']} -> {after['arenas']}, 1 MiB each)", arena_bytes),
        ("  in live objects", grow["live"]),
        ("  free in pools that hold live objects", grow["free_in_pools"]),
        ("  in empty pools of arenas kept", grow["empty_pools"]),
        ("RSS outside pymalloc arenas (C heap, grpc)", grow["rss"] - arena_bytes),
    ]
    for name, b in rows:
        print(f"{name:<46} {b / 2**20:>6.1f} MiB {b / n / 1024:>7.2f} KiB")


if __name__ == "__main__":
    main()
