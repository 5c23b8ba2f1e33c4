"""A training script for `torchrun --rdzv-backend=commctx` tests.

It joins with no arguments, checks that its ranks are torchrun's, all-reduces
over GLOBAL, INTRA_NODE and INTER_NODE, and prints one JSON line. With
--hold it then keeps all-reducing until the agent stops it (a world change)
or `--hold` seconds pass.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before torch is imported: when the agent started this worker

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from commctx import CommContext, CommMode


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold", type=float, default=0.0)
    args = parser.parse_args()
    ctx = CommContext.join()
    a = ctx.assignment
    sums = {}
    for mode in (CommMode.GLOBAL, CommMode.INTRA_NODE, CommMode.INTER_NODE):
        x = torch.tensor([float(ctx.get_global_rank() + 1)])
        dist.all_reduce(x, group=ctx.get_group(mode))
        sums[mode.name] = x.item()
    line = json.dumps({
        "event": "ready", "pid": os.getpid(), "started": STARTED, "generation": a.generation, "node_key": os.environ.get("COMMCTX_NODE"),
        "rank": ctx.get_global_rank(), "node_rank": a.node_rank, "local_rank": ctx.get_in_node_rank(),
        "world_size": ctx.get_world_size(CommMode.GLOBAL), "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "env": {k: os.environ[k] for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")},
        "groups": {m.name: ctx.get_ranks_in_group(m) for m in (CommMode.GLOBAL, CommMode.INTRA_NODE, CommMode.INTER_NODE)},
        "sums": sums,
    })
    os.write(1, (line + "\n").encode())  # one write: the node's workers share torchrun's stdout
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline:  # keep the world busy: a dead peer fails the next all_reduce
        dist.all_reduce(torch.ones(1))
        time.sleep(0.2)  # the scenario, not a wait for something: a training step every 0.2 s
    ctx.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
