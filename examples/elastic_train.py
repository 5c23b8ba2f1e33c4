"""Elastic data-parallel training that survives kills, hangs and replacements.

A small MLP learns a synthetic regression, data parallel over gloo or NCCL,
with SGD and momentum. Start a server and four of these; kill one, pause one
(SIGSTOP), start another: the others step on as a smaller world, and a newcomer
gets the model, the optimizer's state and the step count from a survivor
before it steps with them (commctx.elastic). Every rank prints its loss and a
checksum of its parameters, equal on every rank at every step.

    commctx-server --store memory --lease-ttl-s 4 &
    export COMMCTX_SERVER=127.0.0.1:50051 COMMCTX_JOB_ID=mlp
    for i in 1 2 3 4; do python examples/elastic_train.py & done
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from commctx import CommContext, CommMode
from commctx.elastic import Elastic, ElasticSampler


def checksum(model: torch.nn.Module) -> int:
    """CRC-32 of every parameter's bytes, in order: equal on two ranks only if the parameters are bitwise equal."""
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().cpu().numpy().tobytes(), crc)
    return crc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=4, help="the most workers (default 4)")
    p.add_argument("--min-size", type=int, default=2, help="the fewest workers it goes on with (default 2)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--step-s", type=float, default=0.0, help="sleep this long in each step (stands for GPU time)")
    p.add_argument("--json", action="store_true", help="print one JSON object a step instead of a line of text")
    args = p.parse_args()

    torch.manual_seed(0)  # the same data on every worker; the model's start is rank 0's (the first heal)
    inputs = torch.randn(4096, 32)
    targets = inputs @ torch.randn(32, 1) + 0.1 * torch.randn(4096, 1)
    torch.manual_seed(os.getpid())  # each process starts from its own weights: the heal makes them one
    model = torch.nn.Sequential(torch.nn.Linear(32, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    ctx = CommContext.join(world_size=args.world_size, spec={"elastic": {"min_size": args.min_size}})
    elastic = Elastic(ctx, state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
                      load_state_dict=lambda s: (model.load_state_dict(s["model"]), optim.load_state_dict(s["optim"])))
    sampler = ElasticSampler(len(inputs), args.global_batch)
    params = list(model.parameters())

    def train_step(step: int) -> None:
        rank, size = ctx.get_global_rank(), ctx.get_world_size(CommMode.GLOBAL)
        batch = sampler.indices(step, rank, size)
        loss = F.mse_loss(model(inputs[batch]), targets[batch], reduction="sum")
        optim.zero_grad()
        loss.backward()
        # One all_reduce of every gradient and the loss, summed over the world,
        # then divided by the global batch: the same update at any world size.
        flat = torch.cat([q.grad.flatten() for q in params] + [loss.detach().view(1)])
        dist.all_reduce(flat, group=ctx.get_group(CommMode.GLOBAL))
        flat /= args.global_batch
        offset = 0
        for q in params:
            q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
            offset += q.numel()
        optim.step()  # after the step's last collective: a step that failed changed nothing
        time.sleep(args.step_s)
        line = {"t": time.time(), "step": step, "rank": rank, "world": size, "generation": ctx.assignment.generation,
                "loss": round(flat[-1].item(), 6), "params": checksum(model), "pid": os.getpid(),
                "healed_from": elastic.last_heal.source if elastic.last_heal and elastic.last_heal.receivers else None}
        if args.json:
            print(json.dumps(line), flush=True)
        else:
            print(f"step {step} rank {rank}/{size} loss {line['loss']:.4f} params {line['params']:08x}", flush=True)

    elastic.run(train_step, args.steps)
    ctx.destroy()


if __name__ == "__main__":
    main()
