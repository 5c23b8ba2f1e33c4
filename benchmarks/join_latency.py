"""How long CommContext.join takes for 4 real local processes, against a bare
init_process_group('gloo', 'tcp://...') + barrier of the same 4.

Clocks start once every process has finished `import torch` (a barrier), since
imports cost about 2 CPU-seconds per process here and would hide the rest. The
time of a round is from that barrier until the last process is done; the
join rounds include the rendezvous RPC, the TCPStore, init_process_group and
building the INTRA_NODE and INTER_NODE groups (2 nodes x 2 workers). One
round of each runs first as a warm-up (gloo's one-time set-up) and is not counted.

    python benchmarks/join_latency.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

from harness import server

WORLD = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(index: int, server: str, ports: list[int], rounds: int, barrier, results) -> None:
    import torch  # noqa: F401  (the import is what the barrier waits for)
    import torch.distributed as dist

    from commctx import CommContext

    for r in range(rounds + 1):  # round 0 warms up
        barrier.wait()
        start = time.perf_counter()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[r]}", rank=index, world_size=WORLD)
        dist.barrier()
        results.put(("bare", r, start, time.perf_counter()))
        dist.destroy_process_group()

        barrier.wait()
        start = time.perf_counter()
        ctx = CommContext.join(server, job_id=f"latency-{r}", world_size=WORLD, node_key=f"node{index // 2}", timeout=30)
        results.put(("join", r, start, time.perf_counter()))
        ctx.destroy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    with server("--log-level", "warning", "--store", "memory", cpu=None) as (_, port):
        address = f"127.0.0.1:{port}"
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(WORLD), ctx.Queue()
        ports = [free_port() for _ in range(args.rounds + 1)]
        procs = [ctx.Process(target=worker, args=(i, address, ports, args.rounds, barrier, results)) for i in range(WORLD)]
        for proc in procs:
            proc.start()
        rows = [results.get(timeout=120) for _ in range(2 * WORLD * (args.rounds + 1))]
        for proc in procs:
            proc.join(60)
    for kind in ("bare", "join"):
        per_round = []
        for r in range(1, args.rounds + 1):
            mine = [(s, e) for k, rr, s, e in rows if k == kind and rr == r]
            per_round.append(max(e for _, e in mine) - min(s for s, _ in mine))
        label = "init_process_group + barrier" if kind == "bare" else "CommContext.join (groups included)"
        print(f"{label:>36}: median {statistics.median(per_round) * 1000:6.1f} ms, "
              f"min {min(per_round) * 1000:6.1f} ms, max {max(per_round) * 1000:6.1f} ms  ({args.rounds} rounds, {WORLD} processes)")


if __name__ == "__main__":
    main()
