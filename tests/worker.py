"""A real worker process for the end-to-end tests.

Joins a job through CommContext.join, runs all_reduce on every group and prints
one JSON line per command read from stdin:
  (start)   -> {"event": "joined", ...ranks, groups, sums, exported env...}
  reduce    -> {"event": "reduced", "sums": {...}}
  rejoin    -> waits for the server to announce a world change, then rejoin():
               {"event": "rejoined", "changed_at": wall time the change arrived, ...as joined}
  ended     -> waits for a world change; the job cannot go on for this worker:
               {"event": "ended", "final", "reason", "callbacks", "rejoin_error"}
  destroy   -> {"event": "destroyed", "seconds": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from commctx import CommContext, CommMode, ParallelMode


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def modes(ctx: CommContext) -> list[str]:
    """Every mode this worker has a group of, twins included, in plan order."""
    out = []
    for g in ctx.assignment.groups:
        out += [g.mode, f"{g.mode}_CPU"] if g.cpu_twin else [g.mode]
    return out


def tensor(ctx: CommContext, mode: str, value: float) -> torch.Tensor:
    """On this rank's GPU for an NCCL group, on the CPU for a gloo one."""
    on_gpu = dist.get_backend(ctx.get_group(mode)) == "nccl"
    return torch.tensor([value], device=f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu")


def reduce_all(ctx: CommContext) -> dict[str, float]:
    sums = {}
    for mode in modes(ctx):
        x = tensor(ctx, mode, float(ctx.get_global_rank() + 1))
        dist.all_reduce(x, group=ctx.get_group(mode))
        sums[mode] = x.item()
    return sums


def broadcasts(ctx: CommContext) -> dict[str, float]:
    """From the root of each group that has one (weight transfer): 1000 + root's rank."""
    out = {}
    for g in ctx.assignment.groups:
        if g.root is not None:
            x = tensor(ctx, g.mode, 1000.0 + ctx.get_global_rank())
            dist.broadcast(x, src=g.root, group=ctx.get_group(g.mode))
            out[g.mode] = x.item()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--node-key")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--role")
    p.add_argument("--spec", type=json.loads, help="JobSpec as JSON")
    args = p.parse_args()

    changed_at = []
    changed = threading.Event()  # set by the world-change callback, which runs on the session thread

    def on_world_changed(change) -> None:
        changed_at.append(time.time())
        changed.set()

    start = time.perf_counter()
    ctx = CommContext.join(
        args.server, job_id=args.job, world_size=args.world_size, node_key=args.node_key, timeout=args.timeout,
        role=args.role, spec=args.spec, on_world_changed=on_world_changed,
    )
    report(ctx, "joined", seconds=time.perf_counter() - start)
    for line in sys.stdin:
        command = line.strip()
        if command == "reduce":
            emit(event="reduced", sums=reduce_all(ctx))
        elif command == "rejoin":
            change = ctx.wait_world_change(120)
            ctx.rejoin(timeout=120)
            report(ctx, "rejoined", changed_at=changed_at[-1], reason=change.reason)
        elif command == "ended":
            change = ctx.wait_world_change(120)
            try:
                ctx.rejoin(timeout=5)
                error = None
            except Exception as exc:  # noqa: BLE001 - reported for the test to check
                error = f"{type(exc).__name__}: {exc}"
            changed.wait(5)  # the callback, on the session thread, may run after wait_world_change returns
            emit(event="ended", final=change.final, reason=change.reason, same=ctx.world_change == change,
                 callbacks=len(changed_at), rejoin_error=error)
        elif command == "destroy":
            t = time.perf_counter()
            ctx.destroy()
            emit(event="destroyed", seconds=time.perf_counter() - t, fresh=CommContext() is not ctx, initialized=CommContext().is_initialized())
            return


def report(ctx: CommContext, event: str, **extra) -> None:
    a = ctx.assignment
    emit(
        event=event,
        **extra,
        rank=ctx.get_global_rank(),
        is_main=ctx.is_main_rank(),
        in_node_rank=ctx.get_in_node_rank(),
        local_world_size=ctx.get_local_world_size(),
        node_rank=a.node_rank,
        num_nodes=a.num_nodes,
        generation=a.generation,
        dist_url=a.dist_url,
        world_size=ctx.get_world_size(CommMode.GLOBAL),
        same_singleton=CommContext() is ctx,
        role=a.role,
        groups={m: ctx.get_ranks_in_group(m) for m in modes(ctx)},
        group_ranks={m.value: ctx.get_local_rank(ParallelMode(m.value)) for m in CommMode},
        group_sizes={m.value: ctx.get_world_size(m.value) for m in CommMode},
        roots={g.mode: g.root for g in a.groups if g.root is not None},
        broadcasts=broadcasts(ctx),
        intra_is_group=ctx.get_intra_node_process_group() is ctx.get_group("INTRA_NODE"),
        inter_is_group=ctx.get_inter_node_process_group() is ctx.get_group(CommMode.INTER_NODE),
        sums=reduce_all(ctx),
        env={k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                            "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")},
        backend=dist.get_backend(),
        group_backends={m: dist.get_backend(ctx.get_group(m)) for m in modes(ctx)},
        previous_rank=a.previous_rank,
        changed_groups=list(a.changed_groups),
    )


if __name__ == "__main__":
    main()
