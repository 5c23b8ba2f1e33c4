"""The world `commctx plan` describes: its JobSpec (from --spec and the flags),
its workers, and the roles checked as the server checks them at a join."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from google.protobuf import json_format

from commctx.common.planning import (
    Candidate,
    JobSpec,
    PlanError,
    RoleGroup,
    WeightTransfer,
    WorldPlan,
    check_role,
    plan_world,
)
from commctx.v1 import rendezvous_pb2 as pb


def read_spec(path: str) -> pb.JobSpec:
    """The JobSpec in JSON file `path` ("-": stdin).

    Raises:
        SystemExit: one line naming the file and what is wrong with it (cannot
            be read, not JSON, not a JobSpec).
    """
    shown = "stdin" if path == "-" else path
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as exc:
        raise SystemExit(f"commctx plan: cannot read --spec {shown}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise SystemExit(f"commctx plan: --spec {shown} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"commctx plan: --spec {shown} is not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise SystemExit(f"commctx plan: --spec {shown} is not a JobSpec: a JSON object is needed, not {type(data).__name__}")
    try:
        return json_format.ParseDict(data, pb.JobSpec())
    except json_format.ParseError as exc:
        why = str(exc).strip().splitlines()[0].rstrip(".")[:300]
        raise SystemExit(f"commctx plan: --spec {shown} is not a JobSpec: {why}") from None


def build_spec(args: argparse.Namespace, world_size: int, spec: pb.JobSpec) -> pb.JobSpec:
    """`spec` (read from --spec, or empty) completed by the command line's options."""
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
    """Raises Refusal or PlanError when the world cannot satisfy the spec."""
    given = read_spec(args.spec) if args.spec else pb.JobSpec()  # first: a spec that cannot be read is the one line to see
    if not args.local_sizes and args.nodes is None:
        raise SystemExit("commctx plan: give the world's shape: --nodes N [--per-node M], or --local-sizes 8,8,4")
    sizes = args.local_sizes or [args.per_node] * args.nodes
    if not args.local_sizes and (args.nodes < 1 or args.per_node < 1):
        raise SystemExit("commctx plan: --nodes and --per-node must be at least 1")
    node_roles = args.node_roles.split(",") if args.node_roles else []
    if node_roles and len(node_roles) < max(sizes):
        raise SystemExit(f"commctx plan: --node-roles names {len(node_roles)} roles but a node has {max(sizes)} workers")
    spec = JobSpec.from_json(json_format.MessageToDict(build_spec(args, sum(sizes), given), preserving_proto_field_name=True))
    members = [
        Candidate(f"n{n}l{local}", f"node{n}", f"10.0.{n // 250}.{n % 250 + 1}", 29500, local, n,
                  node_roles[local] if node_roles else "")
        for n, size in enumerate(sizes)
        for local in range(size)
    ]
    check_roles(spec, sizes, node_roles)
    return plan_world(members, spec)


def check_roles(spec: JobSpec, sizes: Sequence[int], node_roles: Sequence[str]) -> None:
    """Refuses what the server would refuse when these workers join: roles
    the spec does not allow. `node_roles` (--node-roles) gives each node's
    workers their roles by local rank; [] when not given.

    Raises:
        SystemExit: the spec declares roles, or its groups name roles, and
            --node-roles is missing (the plan would hold empty groups).
        Refusal: a role name is malformed (the server's own check).
        PlanError: a worker has a role the spec does not declare (the server
            refuses its join: JobConflict), or more workers have a role than
            the spec declares (the server refuses the extra ones: JobFull).
    """
    for role in dict.fromkeys(node_roles):
        if role:
            check_role(role)
    if not spec.roles:  # undeclared roles are free: the server takes any
        named = [r for rule in spec.rules for r in _roles_named(rule)]
        if named and not node_roles:
            raise SystemExit(f"commctx plan: the spec's groups name roles {', '.join(dict.fromkeys(named))} but no "
                             f"worker has a role, so those groups would be empty: give --node-roles, the roles of "
                             f"each node's workers by local rank")
        return
    declared = ", ".join(f"{r}:{c}" for r, c in spec.roles)
    if not node_roles:
        raise SystemExit(f"commctx plan: the spec declares roles {declared}, so every worker needs one: give "
                         f"--node-roles, the roles of each node's workers by local rank{_node_roles_example(spec, sizes)}")
    for local_rank, role in enumerate(node_roles[:max(sizes)]):
        if spec.role_count(role) == 0:
            raise PlanError(f"the spec declares roles {declared} but --node-roles gives local rank {local_rank} "
                            f"role {role!r}; the server refuses such a worker's join")
    counts: dict[str, int] = {}
    for size in sizes:
        for role in node_roles[:size]:
            counts[role] = counts.get(role, 0) + 1
    for role, count in spec.roles:
        if counts.get(role, 0) > count:
            got = ", ".join(f"{r}:{counts.get(r, 0)}" for r, _ in spec.roles)
            raise PlanError(f"the spec declares roles {declared} but --node-roles makes {got}; the server refuses "
                            f"the workers of role {role!r} beyond its {count}")


def _roles_named(rule: object) -> tuple[str, ...]:
    if isinstance(rule, RoleGroup):
        return rule.roles
    if isinstance(rule, WeightTransfer):
        return (rule.sender, *rule.receivers)
    return ()


def _node_roles_example(spec: JobSpec, sizes: Sequence[int]) -> str:
    """' (e.g. --node-roles trainer,rollout,rollout)' when every node can hold the same roles, else ''."""
    nodes = len(sizes)
    if len(set(sizes)) != 1 or any(c % nodes for _, c in spec.roles):
        return ""
    example = [r for r, c in spec.roles for _ in range(c // nodes)]
    return f" (e.g. --node-roles {','.join(example)})" if len(example) == sizes[0] else ""
