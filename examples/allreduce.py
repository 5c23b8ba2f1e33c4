"""Join a job and all_reduce over every group: the compose demo's worker.

    python examples/allreduce.py --server rendezvous:50051 --job demo --world-size 2

Settings may also come from COMMCTX_SERVER, COMMCTX_JOB_ID and COMMCTX_WORLD_SIZE
(COMMCTX_JOB, this example's old name for the job's variable, still works, with a warning).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from commctx import CommContext, CommMode, LauncherEnv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", default=os.environ.get("COMMCTX_SERVER", "127.0.0.1:50051"))
    p.add_argument("--job", default=None, help="the job id (default COMMCTX_JOB_ID, else 'demo')")
    p.add_argument("--world-size", type=int, default=int(os.environ.get("COMMCTX_WORLD_SIZE", "2")))
    args = p.parse_args()

    job = args.job or LauncherEnv.from_env().job_id or "demo"  # the library's reading of COMMCTX_JOB_ID
    ctx = CommContext.join(args.server, job_id=job, world_size=args.world_size, timeout=300)
    rank = ctx.get_global_rank()
    for mode in CommMode:
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x, group=ctx.get_group(mode))
        expected = sum(r + 1 for r in ctx.get_ranks_in_group(mode))
        print(f"rank {rank}: all_reduce over {mode} {ctx.get_ranks_in_group(mode)} = {x.item():g} (expected {expected})", flush=True)
        if x.item() != expected:
            raise SystemExit(f"rank {rank}: wrong sum over {mode}")
    ctx.destroy()


if __name__ == "__main__":
    main()
