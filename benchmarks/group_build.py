"""Time to build the tensor-, data- and pipeline-parallel groups of
tp=2, pp=2, dp=2 for 8 local processes with gloo, three ways:

  every-rank loop   every rank calls new_group for every group of every family
                    (Megatron's parallel_state; what torch requires by default)
  by_enumeration    torch's new_subgroups_by_enumeration, once per family
  member-only       what commctx does (commctx._torch.new_member_group): each rank
                    creates only its own groups, in the plan's canonical order,
                    named after the plan

(split_group would be a fourth, but torch 2.13 refuses it unless the default
group is bound to an accelerator device, so it has no gloo/CPU variant.)

Each round starts from a fresh default group (not timed) and a barrier; its
time is from the barrier until the last process has all its groups and has
run one all_reduce in each. The group plan comes from the server's own code.

    python benchmarks/group_build.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

WORLD = 8
METHODS = ("every-rank loop", "by_enumeration", "member-only")


def plan() -> dict[str, list[list[int]]]:
    from commctx.common.planning import JobSpec, expand, layout_groups

    spec = JobSpec.build(WORLD, layout={"tp": 2, "pp": 2, "dp": 2})
    return {d: [expand(g.ranks) for g in layout_groups(spec.layout, d)] for d in ("tp", "dp", "pp")}


def worker(rank: int, ports: list[int], rounds: int, barrier, results) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from commctx._torch import new_member_group as member_group

    families = plan()
    port = iter(ports)
    for r in range(rounds + 1):  # round 0 warms up
        for method in METHODS:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{next(port)}", rank=rank, world_size=WORLD)
            barrier.wait()
            start = time.perf_counter()
            mine = []
            for groups in families.values():
                if method == "every-rank loop":
                    for ranks in groups:
                        g = dist.new_group(ranks)
                        if rank in ranks:
                            mine.append(g)
                elif method == "by_enumeration":
                    g, _ = dist.new_subgroups_by_enumeration(groups)
                    mine.append(g)
                else:
                    i, ranks = next((i, x) for i, x in enumerate(groups) if rank in x)
                    mine.append(member_group(ranks, "gloo", f"bench/{r}/{len(mine)}/{i}", datetime.timedelta(seconds=60)))
            for g in mine:
                x = torch.ones(1)
                dist.all_reduce(x, group=g)
                assert x.item() == 2.0
            results.put((method, r, start, time.perf_counter()))
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(WORLD), ctx.Queue()
    ports = [free_port() for _ in range((args.rounds + 1) * len(METHODS))]
    procs = [ctx.Process(target=worker, args=(i, ports, args.rounds, barrier, results)) for i in range(WORLD)]
    for proc in procs:
        proc.start()
    rows = [results.get(timeout=300) for _ in range(WORLD * len(METHODS) * (args.rounds + 1))]
    for proc in procs:
        proc.join(60)
    print(f"# {WORLD} processes, gloo, tp=2 pp=2 dp=2: 12 groups, 3 per rank; {args.rounds} rounds after a warm-up")
    for method in METHODS:
        times = []
        for r in range(1, args.rounds + 1):
            mine = [(s, e) for m, rr, s, e in rows if m == method and rr == r]
            times.append(max(e for _, e in mine) - min(s for s, _ in mine))
        print(f"{method:>16}: median {statistics.median(times) * 1000:6.1f} ms, min {min(times) * 1000:6.1f} ms, max {max(times) * 1000:6.1f} ms")


if __name__ == "__main__":
    main()
