"""A Ray driver whose trainer and rollout actors form one job through commctx.

    commctx-server --port 50051 --store memory &
    python examples/ray_rl.py --server 127.0.0.1:50051

The shape of RLightning's policy group: two nodes, each with one trainer and
two rollout workers; here all six actors run on this host and the two nodes
are fake (node keys "node0" and "node1"). Every actor calls
`CommContext.join(..., role=..., spec=SPEC)`; the trainers all_reduce their
gradients over TRAIN_DATA_PARALLEL, then each trainer broadcasts its weights
over its node's WEIGHT_TRANSFER group to that node's two rollout workers.
Each trainer's weights carry its rank (1000 * (rank + 1)), so the output
shows which trainer every rollout worker got its weights from.

On a real Ray cluster, place the actors of a node on one Ray node (e.g. a
placement group with STRICT_SPREAD bundles) and leave node_key out: it
defaults to the hostname. The server may also come from COMMCTX_SERVER.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import uuid

os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")  # before Ray is imported: the demo stays offline

import ray  # noqa: E402

NODES = ("node0", "node1")
ROLES_PER_NODE = ("trainer", "rollout", "rollout")
WORLD_SIZE = len(NODES) * len(ROLES_PER_NODE)

# The JobSpec of the job, in its JSON form (proto/commctx/v1/rendezvous.proto): the
# roles, TRAIN_DATA_PARALLEL over both trainers, and per node a WEIGHT_TRANSFER group
# of its trainer (the sender, the group's root) and its rollout workers. Every actor
# passes the same.
SPEC = json.loads(pathlib.Path(__file__).with_name("rl.json").read_text())


@ray.remote(num_cpus=0)  # six actors on a box with few CPUs: they wait on each other more than they compute
class Worker:
    """One worker process of the job: a trainer or a rollout worker."""

    def __init__(self, node_key: str, role: str) -> None:
        self.node_key = node_key
        self.role = role

    def run(self, server: str, job_id: str, advertise_addr: str | None = None, timeout: float = 120.0) -> dict:
        import torch
        import torch.distributed as dist

        from commctx import CommContext

        ctx = CommContext.join(
            server, job_id=job_id, world_size=WORLD_SIZE, node_key=self.node_key, role=self.role, spec=SPEC,
            advertise_addr=advertise_addr, backend="gloo", timeout=timeout,
        )
        try:
            rank = ctx.get_global_rank()
            a = ctx.assignment
            report = {
                "node_key": self.node_key, "role": a.role, "rank": rank, "node_rank": a.node_rank,
                "local_rank": ctx.get_in_node_rank(), "pid": os.getpid(),
                "groups": {g.mode: ctx.get_ranks_in_group(g.mode) for g in a.groups},
                "roots": {g.mode: g.root for g in a.groups if g.root is not None},
            }
            weights = torch.zeros(4)
            if self.role == "trainer":
                grad = torch.full((4,), float(rank + 1))
                dist.all_reduce(grad, group=ctx.get_group("TRAIN_DATA_PARALLEL"))
                report["reduced"] = grad.tolist()
                weights = grad + 1000.0 * (rank + 1)  # this trainer's "updated" weights, tagged with its rank
                report["sent"] = weights.tolist()
            root = a.group("WEIGHT_TRANSFER").root  # the sender: this node's trainer
            dist.broadcast(weights, src=root, group=ctx.get_group("WEIGHT_TRANSFER"))
            if self.role == "rollout":
                report["received"] = weights.tolist()
            dist.barrier()  # nobody tears its groups down while a peer still reads from them
        finally:
            ctx.destroy()
        report["destroyed"] = not dist.is_initialized()
        return report


def run(server: str, job_id: str | None = None, advertise_addr: str | None = None, timeout: float = 120.0,
        num_cpus: int = 2) -> list[dict]:
    """Starts a local Ray instance and the six actors, waits for their reports
    (in the order NODES x ROLES_PER_NODE) and shuts Ray down."""
    job_id = job_id or f"ray-rl-{uuid.uuid4().hex[:8]}"
    ray.init(num_cpus=num_cpus, include_dashboard=False)
    try:
        actors = [Worker.remote(node, role) for node in NODES for role in ROLES_PER_NODE]
        # All at once: join returns only when all six have joined.
        return ray.get([w.run.remote(server, job_id, advertise_addr, timeout) for w in actors], timeout=timeout + 60)
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", default=os.environ.get("COMMCTX_SERVER", "127.0.0.1:50051"), help="host:port of commctx-server")
    p.add_argument("--job", help="job id (default: a fresh one)")
    p.add_argument("--advertise-addr", help="the IP peers reach the actors on (default: the route to the server)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the world to form")
    p.add_argument("--json", action="store_true", help="print the actors' reports as one JSON list instead")
    args = p.parse_args()

    reports = run(args.server, args.job, args.advertise_addr, args.timeout)
    if args.json:
        print(json.dumps(reports), flush=True)
        return
    sent = {r["node_key"]: r["sent"] for r in reports if r["role"] == "trainer"}
    ok = True
    for r in sorted(reports, key=lambda r: r["rank"]):
        wt = r["groups"]["WEIGHT_TRANSFER"]
        line = f"rank {r['rank']} {r['role']:7} on {r['node_key']}: WEIGHT_TRANSFER {wt} root {r['roots']['WEIGHT_TRANSFER']}"
        if r["role"] == "trainer":
            line += f", all_reduce over TRAIN_DATA_PARALLEL {r['groups']['TRAIN_DATA_PARALLEL']} = {r['reduced'][0]:g}, sent {r['sent']}"
        else:
            line += f", received {r['received']}"
            ok &= r["received"] == sent[r["node_key"]]
        print(line, flush=True)
    if not ok:
        sys.exit("a rollout worker did not receive its own node's trainer's weights")


if __name__ == "__main__":
    main()
