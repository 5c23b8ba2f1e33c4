"""A task of tests/test_slurm.py's srun steps: joins with the server address
only (everything else from Slurm, or from torchrun when srun started torchrun),
all-reduces its rank over gloo and prints one JSON line: what the server
assigned, the job's node keys as the server holds them, what Slurm said, and
the sum.

Usage: python slurm_train.py [SERVER] [--job-id J] [--world-size N] [--node-key K]
(no SERVER: COMMCTX_SERVER, or torchrun's; the options are join()'s arguments)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
import torch
import torch.distributed as dist

from commctx import CommContext
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("server", nargs="?")
    parser.add_argument("--job-id")
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--node-key")
    args = parser.parse_args()
    ctx = CommContext.join(args.server, job_id=args.job_id, world_size=args.world_size, node_key=args.node_key,
                           backend="gloo", timeout=60)
    a = ctx.assignment
    x = torch.tensor([float(ctx.get_global_rank())])
    dist.all_reduce(x)  # every task is in the world now: the server describes all its nodes
    nodes = {}
    if args.server:
        with grpc.insecure_channel(args.server) as channel:
            job = pb_grpc.RendezvousStub(channel).DescribeJob(pb.DescribeJobRequest(job_id=a.job_id), timeout=10)
        nodes = {n.node_key: n.node_rank for n in job.nodes}
    line = json.dumps({
        "rank": ctx.get_global_rank(), "node_rank": a.node_rank, "local_rank": a.local_rank,
        "world_size": a.world_size, "local_world_size": a.local_world_size, "job": a.job_id, "sum": x.item(),
        "nodes": nodes, "torchrun": os.environ.get("TORCHELASTIC_RUN_ID"),
        "slurm": {k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURMD_NODENAME")},
    })
    os.write(1, (line + "\n").encode())  # one write: the tasks of a step share srun's stdout
    dist.barrier()  # nobody leaves before every task described the job
    ctx.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
