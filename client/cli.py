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
channels.Endpoints); `health` probes each address given, as given.
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
from commctx.common.planning import PlanError
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .addresses import DEFAULT_PORT, host_port, server_addresses
from .channels import Endpoints, LeaderStub, channel_to
from .cli_plan import plan_from_args
from .cli_render import event_line, job_detail, job_table, plan_json, plan_text
from .credentials import Tls, check_token, tls_of
from .errors import InvalidArgument, UsageError


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
    import importlib.metadata  # only for --version: its lookup would slow every command's start-up

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
