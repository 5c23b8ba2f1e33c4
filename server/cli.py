"""`commctx`: command-line tools around the rendezvous server.

    commctx plan   print every rank and group of a described world (dry run)

`plan` runs the server's own planning code on a world you describe, so what it
prints is what the server would assign.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from google.protobuf import json_format

from commctx.v1 import rendezvous_pb2 as pb

from .assignment import MemberSpec, WorldPlan, plan_world
from .errors import RendezvousError
from .groups import PlanError, expand
from .spec import spec_from_proto


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every node needs at least one worker")
    return sizes


def _roles(text: str) -> list[tuple[str, int]]:
    out = []
    for part in text.split(","):
        name, _, count = part.partition(":")
        if not name or not count.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r} is not role:count")
        out.append((name, int(count)))
    return out


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="print every rank and group of a described world",
        description="Dry run: plan a world with the server's own code and print every rank and group.",
    )
    world = p.add_mutually_exclusive_group(required=True)
    world.add_argument("--nodes", type=int, help="number of nodes (with --per-node)")
    world.add_argument("--local-sizes", type=_sizes, help="workers per node, e.g. 8,8,4")
    p.add_argument("--per-node", type=int, default=1, help="workers per node with --nodes (default 1)")
    p.add_argument("--spec", help="a JobSpec in JSON (file name, or - for stdin); world_size may be left out")
    for dim, what in (("tp", "tensor"), ("cp", "context"), ("ep", "expert"), ("dp", "data"), ("pp", "pipeline")):
        p.add_argument(f"--{dim}", type=int, help=f"{what} parallel size")
    p.add_argument("--order", help="dimension order, default tp-cp-ep-dp-pp")
    p.add_argument("--within-node", default="", help="dimensions that must stay inside a node, e.g. tp")
    p.add_argument("--roles", type=_roles, help="role counts, e.g. trainer:2,rollout:4")
    p.add_argument("--node-roles", help="roles of each node's workers by local rank, e.g. trainer,rollout,rollout")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run_plan)


def build_spec(args: argparse.Namespace, world_size: int) -> pb.JobSpec:
    spec = pb.JobSpec()
    if args.spec:
        text = sys.stdin.read() if args.spec == "-" else open(args.spec).read()
        json_format.Parse(text, spec)
    if spec.world_size and spec.world_size != world_size:
        raise SystemExit(f"commctx plan: the spec says world_size {spec.world_size} but the world has {world_size} workers")
    spec.world_size = world_size
    dims = {d: getattr(args, d) for d in ("tp", "cp", "ep", "dp", "pp") if getattr(args, d)}
    if dims or args.order or args.within_node:
        spec.layout.CopyFrom(pb.ParallelLayout(order=args.order or "", within_node=[d for d in args.within_node.split(",") if d], **dims))
    if args.roles:
        del spec.roles[:]
        spec.roles.extend(pb.RoleCount(role=r, count=c) for r, c in args.roles)
    return spec


def plan_from_args(args: argparse.Namespace) -> WorldPlan:
    """Raises RendezvousError or PlanError when the world cannot satisfy the spec."""
    sizes = args.local_sizes or [args.per_node] * args.nodes
    if not args.local_sizes and (args.nodes < 1 or args.per_node < 1):
        raise SystemExit("commctx plan: --nodes and --per-node must be at least 1")
    node_roles = args.node_roles.split(",") if args.node_roles else []
    if node_roles and len(node_roles) < max(sizes):
        raise SystemExit(f"commctx plan: --node-roles names {len(node_roles)} roles but a node has {max(sizes)} workers")
    spec = spec_from_proto(build_spec(args, sum(sizes)))
    members = [
        MemberSpec(f"n{n}l{l}", f"node{n}", f"10.0.{n // 250}.{n % 250 + 1}", 29500, l, n, node_roles[l] if node_roles else "")
        for n, size in enumerate(sizes)
        for l in range(size)
    ]
    return plan_world(members, spec)


def plan_json(plan: WorldPlan) -> dict:
    return {
        "world_size": plan.world_size,
        "nodes": [{"node_rank": n.node_rank, "node_key": n.node_key, "first_rank": n.first_rank, "size": n.size} for n in plan.nodes],
        "ranks": [
            {"rank": p.rank, "node_rank": p.node_rank, "node_key": plan.nodes[p.node_rank].node_key,
             "local_rank": p.local_rank, "role": plan.roles[p.rank] if plan.roles else ""}
            for p in sorted(plan.placements(), key=lambda p: p.rank)
        ],
        "groups": {mode: [expand(g.ranks) for g in groups] for mode, groups in plan.all_groups().items()},
        "roots": {mode: [g.root for g in groups] for mode, groups in plan.all_groups().items() if any(g.root is not None for g in groups)},
    }


def plan_text(plan: WorldPlan) -> str:
    data = plan_json(plan)
    sizes = ", ".join(str(n["size"]) for n in data["nodes"])
    lines = [f"world: {plan.world_size} workers on {plan.num_nodes} nodes ({sizes})"]
    if plan.spec.layout is not None:
        lines.append(f"layout: {plan.spec.layout}")
    lines += ["", f"{'rank':>5} {'node':>5} {'node_key':<12} {'local':>5}  role"]
    for r in data["ranks"]:
        lines.append(f"{r['rank']:>5} {r['node_rank']:>5} {r['node_key']:<12} {r['local_rank']:>5}  {r['role']}".rstrip())
    lines.append("")
    width = max(len(m) for m in data["groups"])
    for mode, groups in data["groups"].items():
        roots = data["roots"].get(mode, [None] * len(groups))
        shown = (str(g) if root is None else f"{g} (root {root})" for g, root in zip(groups, roots))
        lines.append(f"{mode:<{width}}  {' '.join(shown)}")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
    except (RendezvousError, PlanError) as exc:
        print(f"commctx plan: this world cannot form: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(plan_json(plan), indent=2) if args.json else plan_text(plan))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commctx", description="commctx command-line tools")
    sub = parser.add_subparsers(required=True, metavar="command")
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
