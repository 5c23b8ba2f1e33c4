"""`commctx`: command-line tools around the rendezvous server.

    commctx plan     print every rank and group of a described world (dry run)
    commctx health   ask a server's grpc.health.v1 service (exit 0 when SERVING)
    commctx status   jobs, members per node, who is missing and why
    commctx events   a job's history (joined, refused, formed, lost, ...), --follow to watch it
    commctx --version

`plan` runs the server's own planning code on a world you describe, so what it
prints is what the server would assign, and it refuses, with one line, what
the server would refuse: a world the planner cannot form, and workers whose
roles the spec does not allow (a spec that declares roles, or whose groups
name roles, needs --node-roles). It imports only the server's pure planner
(`commctx.common.planning`); health and status are gRPC clients.

--addr may list the replicas of a highly available server, comma-separated.
`status` asks the leader (found as the workers find it: see
transport.Endpoints); `health` probes each address given, as given.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commctx.common.errors import Refusal
from commctx.common.planning import (
    Candidate,
    JobSpec,
    PlanError,
    RoleGroup,
    WeightTransfer,
    WorldPlan,
    check_role,
    expand,
    plan_world,
)
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .addresses import DEFAULT_PORT, host_port
from .errors import InvalidArgument, UsageError
from .transport import Endpoints, LeaderStub, Tls, channel_to, check_token, server_addresses, tls_of


def default_address(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """Where the server is when --addr is not given, and the variable that said
    so: COMMCTX_SERVER (as workers read it), else this host's 127.0.0.1 and
    COMMCTX_PORT (the server's own variable), else port 50051."""
    env = os.environ if env is None else env
    if env.get("COMMCTX_SERVER"):
        return env["COMMCTX_SERVER"], "COMMCTX_SERVER"
    return f"127.0.0.1:{env.get('COMMCTX_PORT') or DEFAULT_PORT}", "COMMCTX_PORT"


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default=None, help="host:port, or the replicas' host:port comma-separated "
                                                 "(default COMMCTX_SERVER, else 127.0.0.1 and COMMCTX_PORT, else 50051)")
    p.add_argument("--tls-ca", help="PEM CA of the server's certificate: connect with TLS (default COMMCTX_TLS_CA)")
    p.add_argument("--tls-cert", help="PEM client certificate, for a server requiring one "
                                      "(default COMMCTX_TLS_CERT, used when a CA is given)")
    p.add_argument("--tls-key", help="PEM key of --tls-cert (default COMMCTX_TLS_KEY, used when a CA is given)")
    p.add_argument("--token", help="bearer token, for a server started with --auth-tokens (default COMMCTX_TOKEN)")


def connection(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> tuple[str, Tls | None, str | None]:
    """The address (or comma-separated addresses), TLS and token the arguments and environment ask for.

    Raises:
        InvalidArgument (a UsageError): --addr is not host:port (a URL,
            a port out of range), or --token / COMMCTX_TOKEN is malformed.
        UsageError: a certificate came without its key.
    """
    env = os.environ if env is None else env
    tls = tls_of(args.tls_ca, args.tls_cert, args.tls_key,
                 env.get("COMMCTX_TLS_CA"), env.get("COMMCTX_TLS_CERT"), env.get("COMMCTX_TLS_KEY"))
    addr, source = (args.addr, "--addr") if args.addr is not None else default_address(env)
    try:
        server_addresses(addr)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{source}: {exc}") from None
    if args.token is not None:
        token = check_token(args.token, "--token")
    else:
        token = check_token(env["COMMCTX_TOKEN"], "COMMCTX_TOKEN") if env.get("COMMCTX_TOKEN") else None
    return addr, tls, token


def connect(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> tuple[str, Endpoints]:
    """The address and the server's replicas behind it, over TLS when a TLS file is given.

    Raises:
        UsageError: a TLS file cannot be read, a certificate came without
            its key, or an address is not host:port.
    """
    addr, tls, token = connection(args, env)
    try:
        return addr, Endpoints(addr, tls, token)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


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
    world = p.add_mutually_exclusive_group()  # one is needed: checked after the spec is read (plan_from_args)
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
        Candidate(f"n{n}l{l}", f"node{n}", f"10.0.{n // 250}.{n % 250 + 1}", 29500, l, n, node_roles[l] if node_roles else "")
        for n, size in enumerate(sizes)
        for l in range(size)
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
    except (Refusal, PlanError) as exc:
        print(f"commctx plan: this world cannot form: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(plan_json(plan), indent=2) if args.json else plan_text(plan))
    return 0


def add_health_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help="ask a server's gRPC health service; exit 0 when SERVING",
                       description="Calls grpc.health.v1.Health/Check. Exit status 0: SERVING; 1: anything else or no answer. "
                                   "With several addresses (--addr a:1,b:2) each is asked and gets a line; exit status 0 "
                                   "when all are SERVING. An address is asked as given: a name that resolves to several "
                                   "replicas is one probe, of whichever replica the connection reaches.")
    add_connection_arguments(p)
    p.add_argument("--service", default="", help='service name ("" = the whole server; or commctx.v1.Rendezvous)')
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    p.set_defaults(run=run_health)


def run_health(args: argparse.Namespace) -> int:
    addr, tls, token = connection(args)
    try:
        targets = [host_port(*hp) for hp in server_addresses(addr)] if "," in addr else [addr]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    serving = True
    for target in targets:
        shown = addr if len(targets) == 1 else target
        try:
            with channel_to(target, tls, token) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                                 timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{shown}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            serving = False
            continue
        print(f"{shown}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
        serving = serving and reply.status == health_pb2.HealthCheckResponse.SERVING
    return 0 if serving else 1


def add_status_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="jobs, members per node, who is missing and why",
                       description="Describes the jobs a rendezvous server holds (or one of them). With several "
                                   "replicas (--addr a:1,b:2, or a name that resolves to several) it asks the leader.")
    add_connection_arguments(p)
    p.add_argument("--job", help="describe this job in detail")
    p.add_argument("--run", type=int, default=0, metavar="N", dest="run_number",
                   help="with --job: describe run N of the job id (default: the live run, else the latest that ended)")
    p.add_argument("--all", action="store_true",
                   help="also the runs that ended (finished, failed, closed) and are kept (--retain-ended-s)")
    p.add_argument("--job-secret", default=None, help="the job's secret, if it is sealed (default COMMCTX_JOB_SECRET)")
    p.add_argument("--nodes", type=int, default=1000, metavar="N",
                   help="with --job: list at most N nodes (default 1000; 0: all, read page by page)")
    p.add_argument("--watch", action="store_true", help="repeat every --interval seconds until interrupted")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between --watch updates (default 2)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run_status)


_STATE = {pb.JobDescription.FORMING: "forming", pb.JobDescription.FORMED: "formed", pb.JobDescription.FAILED: "failed",
          pb.JobDescription.ENDED: "ended", pb.JobDescription.CLOSED: "closed"}


def _size(d: pb.JobDescription) -> str:
    """'3/4' workers, or for a job of nodes (torchrun's) '4 on 2/2 nodes': its size counts nodes."""
    if d.spec.HasField("nodes"):
        n = d.spec.nodes
        wanted = f"{n.min}..{n.max}" if n.min != n.max else str(n.max)
        return f"{d.joined} on {d.num_nodes}/{wanted} nodes"
    return f"{d.joined}/{d.spec.world_size}"


def _ended(d: pb.JobDescription) -> str:
    """How long ago the run ended ('' while it runs)."""
    return f"{max(0.0, time.time() - d.ended_at):.0f}s ago" if d.ended_at else ""


def _role_counts(n: pb.NodeDescription) -> str:
    return ",".join(f"{r.role or '-'}:{r.count}" for r in n.roles)


def job_table(jobs: Sequence[pb.JobDescription]) -> str:
    rows = [("JOB", "RUN", "STATE", "GEN", "JOINED", "MISSING", "NODES", "AGE", "ENDED", "REASON")]
    for d in jobs:
        rows.append((d.job_id, str(d.run or ""), _STATE.get(d.state, "?"), str(d.generation), _size(d), str(d.missing),
                     str(d.num_nodes), f"{d.forming_for_s:.0f}s" if not d.ended_at else "", _ended(d), d.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    if len(rows) == 1:
        return "no jobs"
    return "\n".join(("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]).rstrip() for r in rows)


def job_detail(d: pb.JobDescription) -> str:
    joined = (f"{d.joined} workers on {_size(d).split(' on ')[1]} joined" if d.spec.HasField("nodes")
              else f"{d.joined} of {d.spec.world_size} workers joined")
    head = f"job {d.job_id} (run {d.run}): {_STATE.get(d.state, '?')}, generation {d.generation}, "
    if d.ended_at:
        began = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.started_at)) if d.started_at else "?"
        lines = [head + f"ended {_ended(d)} (began {began}, ran {d.ended_at - d.started_at:.1f} s); these nodes took part:"
                 if d.started_at else head + f"ended {_ended(d)}; these nodes took part:"]
    else:
        lines = [head + f"{joined}, {d.missing} missing, "
                 f"{'forming' if d.state == pb.JobDescription.FORMING else 'since first join'} for {d.forming_for_s:.1f} s"]
    if d.other_runs:
        lines.append(f"other runs of this id kept: {', '.join(map(str, d.other_runs))} (--run N describes one)")
    if d.reason:
        lines.append(f"why: {d.reason}")
    if d.waiting:
        lines.append(f"waiting for the next generation: {d.waiting} workers")
    if d.not_ready:
        lines.append(f"survivors that have not re-armed: {d.not_ready}")
    if d.missing_nodes:
        lines.append(f"node keys that have not shown up: {', '.join(d.missing_nodes)}")
    formed = d.state == pb.JobDescription.FORMED
    rows = [("NODE_RANK" if formed or d.ended_at else "", "NODE_KEY", "ADDRESS", "WORKERS", "ROLES")]
    rows += [(str(n.node_rank) if formed or d.ended_at else "", n.node_key, ",".join(n.addresses) or n.address, str(n.workers),
              _role_counts(n)) for n in d.nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).strip() for r in rows]
    if d.num_nodes > len(d.nodes):
        lines.append(f"... {d.num_nodes - len(d.nodes)} more nodes (--nodes 0 lists them all)")
    return "\n".join(lines)


def describe_job(stub: pb_grpc.RendezvousStub | LeaderStub, job_id: str, secret: str, max_nodes: int,
                 run: int = 0) -> pb.JobDescription:
    """The job (run `run`; 0: the live one, else the latest kept) with its first `max_nodes` nodes (0: all), read page by page."""
    def page(size: int, token: str = "") -> pb.JobDescription:
        return stub.DescribeJob(pb.DescribeJobRequest(job_id=job_id, job_secret=secret, node_page_size=size,
                                                      node_page_token=token, run=run), timeout=10)

    d = page(min(max_nodes or 10_000, 10_000))
    while d.next_node_page_token and (not max_nodes or len(d.nodes) < max_nodes):
        more = page(min(max_nodes - len(d.nodes) if max_nodes else 10_000, 10_000), d.next_node_page_token)
        d.nodes.extend(more.nodes)
        d.next_node_page_token = more.next_node_page_token
    return d


def list_jobs(stub: pb_grpc.RendezvousStub | LeaderStub, ended: bool = False) -> list[pb.JobDescription]:
    """Every job, page by page (`ended`: and every kept run that ended)."""
    jobs, token = [], ""
    while True:
        page = stub.ListJobs(pb.ListJobsRequest(page_size=1000, page_token=token, include_ended=ended), timeout=5)
        jobs.extend(page.jobs)
        token = page.next_page_token
        if not token:
            return jobs


class _Stop:
    """Ctrl-C or SIGTERM for --watch: the handler marks it, and interrupts only the
    refresh's sleep, never a gRPC call in flight (whose KeyboardInterrupt grpc can swallow)."""

    def __init__(self) -> None:
        self.set = False
        self.sleeping = False

    def __call__(self, signum, frame) -> None:
        self.set = True
        if self.sleeping:
            self.sleeping = False  # once: a second signal finds the flag
            raise KeyboardInterrupt

    def wait(self, seconds: float) -> bool:
        """Sleeps `seconds` unless stopped; whether it was."""
        self.sleeping = True
        try:
            if not self.set:
                time.sleep(seconds)
        except KeyboardInterrupt:
            pass
        finally:
            self.sleeping = False
        return self.set


def run_status(args: argparse.Namespace) -> int:
    if not args.watch:
        return _status(args, None)
    stop = _Stop()
    handlers = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _status(args, stop)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def _status(args: argparse.Namespace, stop: _Stop | None) -> int:
    _, endpoints = connect(args)
    try:
        stub = LeaderStub(endpoints)  # each call goes to the leader, following a replica's hint
        while True:
            try:
                if args.job:
                    secret = args.job_secret or os.environ.get("COMMCTX_JOB_SECRET", "")
                    d = describe_job(stub, args.job, secret, max(args.nodes, 0), max(args.run_number, 0))
                    text = json_format.MessageToJson(d) if args.json else job_detail(d)
                else:
                    jobs = list_jobs(stub, args.all)
                    text = json.dumps([json_format.MessageToDict(j) for j in jobs], indent=2) if args.json else job_table(jobs)
            except grpc.RpcError as exc:
                print(f"{endpoints.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
                if stop is None:
                    return 1
                text = None
            if stop is not None and stop.set:
                return 0
            if text is not None:
                if stop is not None and sys.stdout.isatty():
                    print("\x1b[H\x1b[2J", end="")
                if stop is not None:
                    print(time.strftime("%H:%M:%S"), endpoints.address)
                print(text, flush=True)
            if stop is None:
                return 0
            if stop.wait(args.interval):  # a display refresh, not a wait for a condition
                return 0
    finally:
        endpoints.close()


class _Version(argparse.Action):
    """--version, looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace, values, option_string=None) -> None:
        print(version())  # on stdout, as argparse's own "version" action prints it
        parser.exit()


def version() -> str:
    """'commctx <version>' of the installed distribution."""
    import importlib.metadata  # only for --version: its lookup is a tenth of the CLI's start-up

    try:
        return f"commctx {importlib.metadata.version('commctx')}"
    except importlib.metadata.PackageNotFoundError:
        return "commctx (version unknown: the commctx distribution is not installed)"


def add_events_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="a job's history: joined, refused, formed, reforming, lost, left, failed, ended",
                       description="Prints a job's kept events, oldest first (ListEvents). With --follow it goes on "
                                   "printing them as they happen (WatchEvents) until the job is gone from the server "
                                   "or you interrupt it. An event whose count grew is printed again with its seq.")
    add_connection_arguments(p)
    p.add_argument("--job", required=True, help="the job")
    p.add_argument("--job-secret", default=None, help="the job's secret, if it is sealed (default COMMCTX_JOB_SECRET)")
    p.add_argument("--run", type=int, default=0, metavar="N", dest="run_number",
                   help="the events of run N of the job id (default: the live run, else the latest that ended)")
    p.add_argument("--after", type=int, default=0, metavar="SEQ", help="only events after this seq (default: all kept)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing events as they happen")
    p.add_argument("--json", action="store_true", help="one JSON object per event and line")
    p.set_defaults(run=run_events)


def event_line(e: pb.JobEvent, as_json: bool) -> str:
    if as_json:
        return json.dumps({"seq": e.seq, "time": e.time, "kind": e.kind, "generation": e.generation, "message": e.message,
                           "fields": json_format.MessageToDict(e.fields)}, separators=(",", ":"))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time)) + f".{int(e.time % 1 * 1000):03d}"
    return f"{when}  #{e.seq:<4} gen {e.generation:<3} {e.kind:<9}  {e.message}"


def run_events(args: argparse.Namespace) -> int:
    _, endpoints = connect(args)
    secret = args.job_secret or os.environ.get("COMMCTX_JOB_SECRET", "")
    last = args.after
    try:
        stub = LeaderStub(endpoints)
        token = str(last) if last else ""
        while True:
            page = stub.ListEvents(pb.ListEventsRequest(job_id=args.job, job_secret=secret, page_size=1000, page_token=token,
                                                        run=max(args.run_number, 0)), timeout=10)
            for e in page.events:
                print(event_line(e, args.json), flush=True)
                last = e.seq
            token = page.next_page_token
            if not token:
                break
        while args.follow and not args.run_number:  # a run that ended has nothing more to say
            try:
                for e in endpoints.stub.WatchEvents(pb.WatchEventsRequest(job_id=args.job, job_secret=secret, after_seq=last)):
                    print(event_line(e, args.json), flush=True)
                    last = max(last, e.seq)
                return 0  # the job is gone from the server
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:  # the leader moved, or the server restarts
                    endpoints.failed(exc)
                elif exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # else: fell behind, watch again
                    raise
                time.sleep(0.5)  # a backoff before watching again from the last seq printed
        return 0
    except grpc.RpcError as exc:
        print(f"commctx events: {endpoints.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        endpoints.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commctx", description="commctx command-line tools")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(required=True, metavar="command")
    add_plan_parser(sub)
    add_health_parser(sub)
    add_status_parser(sub)
    add_events_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"commctx {args.run.__name__.removeprefix('run_')}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
