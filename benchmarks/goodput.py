"""Goodput, side by side: what one failed worker costs a training loop (torchft, torchrun on c10d and on commctx, commctx).

Every system trains the same thing on this machine: an MLP of 1,005,392
float32 parameters (256-1024-576-256-16, ReLU), seeded identically, SGD with
momentum 0.9, 4 workers (world size 4), gloo on CPU, one process per worker,
unpinned, one thread each. A step: a global batch of 64 synthetic samples
drawn from a generator seeded by the step number (worker r of W takes samples
r, r+W, ...); the forward pass of sum((out - y)^2) / 64; a sleep until the
step has taken --step-s (default 0.2 s) of wall time, standing for the GPU's
forward and backward work, which burns no CPU; backward; the gradients
all-reduced (summed: the global batch's gradient); the optimizer step. The
sleep comes before the allreduce as GPU compute does, so that a fault, which
lands at a random point of a step, mostly meets the others in the allreduce
(--pad-at end sleeps after the optimizer step instead: there a fault mostly
lands between steps, where torchft's per-step quorum sees it before any
collective).
Each worker process appends to a file of its own: {"event": "start"} when the
process starts (before `import torch`), {"event": "imported"} once torch is
imported, and one line per COMPLETED step {"t", "system", "step", "rank",
"world", "epoch", "pid", "node", "sum"}, sum being the CRC32 of every
parameter's bytes in order (equal sums: bitwise equal parameters).

Systems (--systems), each its own run of every fault, all alternating:
  torchft        torchft's lighthouse (the torchft_lighthouse binary, 127.0.0.1, --min_replicas 2, its defaults:
                 heartbeat timeout 5 s, join timeout 60 s), 4 replica groups of one worker each (train_ddp.py's
                 layout: each its own TCPStore), its Manager (min_replica_size 2, its defaults: timeout,
                 quorum_timeout and connect_timeout 60 s), its DistributedDataParallel and OptimizerWrapper over its
                 ProcessGroupGloo (60 s). Only committed steps (should_commit() true) are logged; epoch: the quorum
                 id, world: num_participants(). A replacement is a new replica that torchft heals from a live one.
                 torchft 0.2.0's DDP comm hook raises AssertionError (`assert fut._fut`) inside backward when an
                 allreduce failed, which leaves torch's DDP reducer mid-reduction (every later backward raises): the
                 worker catches it, reports it to the Manager, wraps the model in a fresh DistributedDataParallel and
                 goes on; the errors are printed with each run.
  torchft-tuned  the same with everything set for a 4 s lease: Manager(timeout=, quorum_timeout=, connect_timeout=
                 --ft-timeout-s), ProcessGroupGloo(timeout=--ft-timeout-s), lighthouse --heartbeat_timeout_ms
                 --ft-heartbeat-ms, --join_timeout_ms --ft-join-ms.
  c10d           4 torchrun agents (`-m torch.distributed.run --nnodes=2:4 --nproc-per-node=1 --max-restarts=3
                 --local-addr=127.0.0.1 --rdzv-backend=c10d`, agent 0 hosts the store, torch's defaults otherwise:
                 last call 30 s, keep-alive 5 s x 3); workers init gloo from torchrun's env with gloo's default
                 30 min timeout, resume from the latest checkpoint (model, optimizer, step; rank 0 writes one every
                 --ckpt-every steps, torch.save then rename). epoch: TORCHELASTIC_RESTART_COUNT.
                 TORCH_DISABLE_SHARE_RDZV_TCP_STORE, if set in the environment, is passed on to the agents.
  commctx-torchrun  the same agents and workers with --rdzv-backend=commctx --rdzv-conf node_key=nodeN against a
                 commctx-server subprocess (--store memory --lease-ttl-s 4).
  commctx        CommContext workers, one connection each, against a commctx-server subprocess (--store memory
                 --lease-ttl-s 4), a job of world_size 4 with spec {"elastic": {"min_size": 2}}, the client's
                 defaults, the step run by commctx.elastic's Elastic.run (a newcomer healed from a survivor).
                 epoch: the generation; a replacement's "joined" line: its Join answered.

Faults (--faults), each a run of its own, once every node has completed step --fault-at (default 15: halfway
between two checkpoints) in the world of 4, at a random point of the next step (the same points for every
system). The victim is the highest rank that is not rank 0 and hosts no store (torchft: replica 3; torchrun: a
worker of neither node 0 nor the store's agent).
  kill     SIGKILL of the victim's worker process (torchrun: the worker, not its agent, which restarts it).
  stop     SIGSTOP of it (SIGCONT and SIGKILL at the end of the run).
  replace  SIGKILL of it (torchrun: its agent and its worker), wait until the survivors step in a world of 3 (at
           most --bound s), then start a replacement (torchrun: a new agent for that node).

Figures, per system and fault, median (range) over --repeat runs:
  recovered  from the signal to the moment EVERY survivor (every other node) has completed a step in a world that
             excludes the victim: torchft and commctx: a step line whose epoch (quorum id, generation) differs
             from the victim's last and whose world is 3; torchrun: a step line of a worker process started after
             the signal (torchrun restarts every worker), and world 3 when the whole node was killed (replace).
             Not within --bound s: "> BOUND s (no step)".
  redone     the highest step completed in the old world + 1 - the lowest step completed in the new one: steps
             computed again (0: none lost; torchrun redoes those since its last checkpoint).
  replaced   replace only: from the replacement's start (the driver's Popen; torchrun: the new agent's) to its
             first completed step in the world of 4 (its worker's step line with world 4); "import": that worker
             process's start to its "imported" line; "after import": its "imported" line to that step.
  equal      whether every rank's checksum was the same at each step number completed in the new world (--after
             steps of every survivor, and of the replacement with the others), i.e. bitwise equal parameters.

Every worker process holds its own connections (one per worker: torchft's replica to its Manager and the
lighthouse, torchrun's agent to its rendezvous, a CommContext worker to the server); the lighthouse and the
commctx-server run unpinned on the same 2 cores as everything else. Clocks: one machine's wall clock (the
driver's signal, the workers' lines). Waits are capped at --bound s (default 60). Every process is started in a
session of its own and killed (SIGKILL by pid or process group) at the end of its run, also on errors; ports come
from the OS on 127.0.0.1 (torchft's Manager and checkpoint servers bind the wildcard address themselves). Logs of
every run are kept under --logs.

    python benchmarks/goodput.py [--repeat 3] [--systems torchft,torchft-tuned,c10d,commctx-torchrun,commctx]
                                 [--faults kill,stop,replace] [--bound 60] [--step-s 0.2] [--json]
"""

from __future__ import annotations

import time

STARTED = time.time()  # the process's start, for the "start" line: before anything else is imported

import argparse
import contextlib
import gc
import importlib.metadata
import itertools
import json
import os
import pathlib
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import zlib

from detect import Server, append_line, clean_env, free_port, ours, signal_group, summary

HERE = pathlib.Path(__file__).resolve()
DIMS = (256, 1024, 576, 256, 16)
PARAMS = sum(a * b + b for a, b in itertools.pairwise(DIMS))
BATCH, WORLD = 64, 4
SYSTEMS = ("torchft", "torchft-tuned", "c10d", "commctx-torchrun", "commctx")
TORCHRUN = ("c10d", "commctx-torchrun")
FAULTS = ("kill", "stop", "replace")
LIGHTHOUSE = pathlib.Path(sys.executable).with_name("torchft_lighthouse")


def all_reduce_grads(params) -> None:
    """Sums the gradients over the workers, one flat all_reduce: the global batch's gradient."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()

def note(what: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


# -- the workers: the same model, step and log for every system -------------------------------------------------------


class Log:
    """A worker process's own file of JSON lines (one O_APPEND write each)."""

    def __init__(self, args: argparse.Namespace, node: int) -> None:
        self.system, self.node = args.system, node
        self.path = os.path.join(args.dir, f"node{node}-{os.getpid()}.jsonl")
        self.event("start", t=STARTED)

    def event(self, name: str, t: float | None = None, **fields) -> None:
        append_line(self.path, {"event": name, "t": time.time() if t is None else t, "pid": os.getpid(),
                                "node": self.node, **fields})

    def step(self, k: int, rank: int, world: int, epoch: int, model) -> None:
        crc = 0
        for p in model.parameters():
            crc = zlib.crc32(p.detach().numpy(), crc)
        append_line(self.path, {"t": time.time(), "system": self.system, "step": k, "rank": rank, "world": world,
                                "epoch": epoch, "pid": os.getpid(), "node": self.node, "sum": crc})


def build(args: argparse.Namespace):
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    layers: list = []
    for a, b in itertools.pairwise(DIMS):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def loss_of(model, args: argparse.Namespace, k: int, rank: int, world: int):
    """This worker's share of step k's global batch: its samples' squared error over the global batch size."""
    import torch

    g = torch.Generator().manual_seed(args.seed * 1_000_003 + k)
    x, y = torch.randn(BATCH, DIMS[0], generator=g), torch.randn(BATCH, DIMS[-1], generator=g)
    return ((model(x[rank::world]) - y[rank::world]) ** 2).sum() / BATCH


def pace(began: float, args: argparse.Namespace, where: str) -> None:
    """Sleeps until the step has taken --step-s, at `where` of the step (--pad-at)."""
    if where == args.pad_at:
        time.sleep(max(0.0, began + args.step_s - time.monotonic()))


def run_torchrun_worker(args: argparse.Namespace) -> None:
    """Under torchrun (c10d or commctx): gloo from torchrun's env, resume from the latest checkpoint, train."""
    log = Log(args, int(os.environ["GOODPUT_NODE"]))
    import torch
    import torch.distributed as dist

    log.event("imported")
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(minutes=30))  # what torchrun users get by default
    rank, world, epoch = dist.get_rank(), dist.get_world_size(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, opt = build(args)
    params = list(model.parameters())
    ckpt, k = os.path.join(args.dir, "ckpt.pt"), 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        k = state["step"]
    log.event("ready", rank=rank, world=world, epoch=epoch, step=k)
    deadline = time.monotonic() + args.lifetime
    while time.monotonic() < deadline:
        began = time.monotonic()
        opt.zero_grad()
        loss = loss_of(model, args, k, rank, world)
        pace(began, args, "compute")
        loss.backward()
        all_reduce_grads(params)
        opt.step()
        if rank == 0 and (k + 1) % args.ckpt_every == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": k + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        pace(began, args, "end")
        log.step(k, rank, world, epoch, model)
        k += 1


def run_torchft_worker(args: argparse.Namespace) -> None:
    """One torchft replica group of one worker (train_ddp.py's layout), defaults or tuned."""
    log = Log(args, args.node)
    import torch.distributed as dist

    log.event("imported")
    from datetime import timedelta

    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the replica group's own store
    model, inner = build(args)
    tuned = args.system == "torchft-tuned"
    timeout = timedelta(seconds=args.ft_timeout_s)
    pg = ProcessGroupGloo(timeout=timeout) if tuned else ProcessGroupGloo()
    extra = {"timeout": timeout, "quorum_timeout": timeout, "connect_timeout": timeout} if tuned else {}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(pg=pg, min_replica_size=2, load_state_dict=load_state_dict,
                      state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
                      replica_id=f"goodput_{args.node}", store_addr="127.0.0.1", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=args.lighthouse, hostname="127.0.0.1", **extra)
    ddp, opt, rewraps = DistributedDataParallel(manager, model), Optimizer(manager, inner), 0
    deadline = time.monotonic() + args.lifetime
    while time.monotonic() < deadline:
        began = time.monotonic()
        opt.zero_grad()  # starts the quorum
        k, world, rank = manager.current_step(), 0, None
        try:
            manager.wait_quorum()  # healing sets the step: read it after
            k, world, rank = manager.current_step(), manager.num_participants(), manager.participating_rank()
            # torchft's DDP averages over the participants: scaled so that the result is the global batch's gradient
            loss = loss_of(ddp, args, k, rank or 0, max(world, 1)) * max(world, 1)
            pace(began, args, "compute")
            loss.backward()  # the allreduce: torchft's comm hook
        except Exception as exc:  # noqa: BLE001
            # torchft 0.2.0: a failed allreduce makes its comm hook raise (`assert fut._fut`) inside backward, which
            # leaves torch's DDP reducer mid-reduction: every later backward fails. A fresh DDP wrapper recovers it.
            log.event("error", error=f"{type(exc).__name__}: {exc}"[:300], step=k, rewrap=rewraps + 1)
            manager.report_error(exc)
            del ddp
            gc.collect()
            ddp, rewraps = DistributedDataParallel(manager, model), rewraps + 1
        try:
            opt.step()  # should_commit(), then the inner step only if committed
        except Exception as exc:  # noqa: BLE001
            log.event("error", error=f"should_commit: {type(exc).__name__}: {exc}"[:300], step=k)
        pace(began, args, "end")
        if manager.current_step() == k + 1:
            log.step(k, rank if rank is not None else -1, world, manager._quorum_id, model)
        else:
            log.event("uncommitted", step=k)


def run_commctx_worker(args: argparse.Namespace) -> None:
    """CommContext.join with the client's defaults, and commctx.elastic: the same step as the torchrun worker's,
    run by Elastic.run, which heals a newcomer from a survivor and moves the survivors to the next world without
    a restart. epoch: the generation."""
    log = Log(args, args.node)
    import torch  # noqa: F401  (timed: the "imported" event follows it)
    import torch.distributed  # noqa: F401

    log.event("imported")
    from commctx import CommContext, CommMode
    from commctx.elastic import Elastic

    model, opt = build(args)  # first, as a training script does: a newcomer's peers need not wait for it
    params = list(model.parameters())
    ctx = CommContext.join(args.server, job_id=args.job, world_size=WORLD, spec={"elastic": {"min_size": 2}},
                           node_key=f"node{args.node}", progress_interval=0)
    log.event("joined", generation=ctx.assignment.generation)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    elastic = Elastic(ctx, state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                      load_state_dict=load_state_dict)

    def step(k: int) -> None:
        began = time.monotonic()
        rank, world = ctx.get_global_rank(), ctx.get_world_size(CommMode.GLOBAL)
        opt.zero_grad()
        loss = loss_of(model, args, k, rank, world)
        pace(began, args, "compute")
        loss.backward()
        all_reduce_grads(params)
        opt.step()  # after the step's last collective: a step that failed changed nothing
        pace(began, args, "end")
        log.step(k, rank, world, ctx.assignment.generation, model)

    elastic.run(step, steps=int(args.lifetime / args.step_s) + 1)  # the driver ends the process long before


# -- the driver --------------------------------------------------------------------------------------------------------


class Run:
    """One case's processes and log directory; every process in a session of its own."""

    def __init__(self, system: str, fault: str, k: int, args: argparse.Namespace) -> None:
        self.system, self.fault, self.args = system, fault, args
        self.dir = os.path.join(args.logs, f"{system}-{fault}-{k + 1}")
        os.makedirs(self.dir, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.nodes: dict[int, subprocess.Popen] = {}  # node -> its worker (torchft, commctx) or agent (torchrun)
        self.stopped: list[int] = []
        self.server: Server | None = None
        self.endpoint = ""
        self._offsets: dict[str, int] = {}
        self.lines: list[dict] = []

    def spawn(self, argv: list[str], name: str, **env: str) -> subprocess.Popen:
        with open(os.path.join(self.dir, f"{name}.log"), "ab") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT,
                                    env=clean_env(OMP_NUM_THREADS="1", **env), start_new_session=True)
        self.procs.append(proc)
        return proc

    def read(self) -> list[dict]:
        """Every line written so far (new ones appended), in file order."""
        for path in sorted(pathlib.Path(self.dir).glob("*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path.name, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path.name] = self._offsets.get(path.name, 0) + end
            self.lines += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        return self.lines

    def steps(self) -> list[dict]:
        return sorted((r for r in self.read() if "step" in r and "event" not in r), key=lambda r: r["t"])

    def events(self, name: str) -> dict[int, dict]:
        return {r["pid"]: r for r in self.read() if r.get("event") == name}

    def start_infra(self) -> None:
        if self.system.startswith("torchft"):
            a = self.args
            argv = [str(LIGHTHOUSE), "--bind", "127.0.0.1:0", "--min_replicas", "2"]
            if self.system == "torchft-tuned":
                argv += ["--heartbeat_timeout_ms", str(a.ft_heartbeat_ms), "--join_timeout_ms", str(a.ft_join_ms)]
            self.spawn(argv, "lighthouse")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                found = re.search(r"listening on: \S+:(\d+)", pathlib.Path(self.dir, "lighthouse.log").read_text())
                if found:
                    self.endpoint = f"http://127.0.0.1:{found.group(1)}"
                    return
                time.sleep(0.05)
            raise RuntimeError("the lighthouse did not say where it listens within 30 s")
        if self.system == "c10d":
            self.endpoint = f"127.0.0.1:{free_port()}"
        else:
            self.server = Server(os.path.join(self.dir, "server.log"), "--store", "memory", "--lease-ttl-s", "4")
            self.endpoint = self.server.address

    def start_node(self, node: int, job: str) -> subprocess.Popen:
        a = self.args
        common = ["--dir", self.dir, "--system", self.system, "--step-s", str(a.step_s), "--seed", str(a.seed),
                  "--ckpt-every", str(a.ckpt_every), "--lifetime", str(a.lifetime), "--pad-at", a.pad_at]
        if self.system in TORCHRUN:
            conf = f"node_key=node{node}" if self.system != "c10d" else f"is_host={'true' if node == 0 else 'false'}"
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:4", "--nproc-per-node=1",
                    f"--rdzv-backend={self.system.split('-')[0]}", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={job}",
                    f"--rdzv-conf={conf}", "--max-restarts=3", "--local-addr=127.0.0.1",
                    str(HERE), "--worker-torchrun", *common]
        elif self.system.startswith("torchft"):
            argv = [sys.executable, str(HERE), "--worker-torchft", "--node", str(node), "--lighthouse", self.endpoint,
                    "--ft-timeout-s", str(a.ft_timeout_s), *common]
        else:
            argv = [sys.executable, str(HERE), "--worker-commctx", "--node", str(node), "--server", self.endpoint,
                    "--job", job, *common]
        proc = self.spawn(argv, f"node{node}-{len(self.procs)}", GOODPUT_NODE=str(node))
        self.nodes[node] = proc
        return proc

    def all_exited(self) -> bool:
        return all(p.poll() is not None for p in self.nodes.values())

    def error_tail(self) -> str:
        errors = [r["error"] for r in self.read() if r.get("event") == "error"]
        if errors:
            return errors[-1]
        tails = [pathlib.Path(self.dir, f).read_text(errors="replace").strip().splitlines()[-1:]
                 for f in os.listdir(self.dir) if f.startswith("node") and f.endswith(".log")]
        return next((t[0] for t in tails if t), "")[:300]

    def stop(self) -> None:
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for proc in self.procs:
            signal_group(proc.pid, signal.SIGKILL)
        for pid in self.events("start"):  # torchrun's workers run in sessions of their own
            if ours(pid, self.dir):
                signal_group(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        if self.server is not None:
            self.server.stop()


def equal_sums(lines: list[dict]) -> tuple[bool | None, int]:
    """Whether all ranks had the same checksum at every step number two or more of them completed; how many steps."""
    by_step: dict[int, set[int]] = {}
    count: dict[int, int] = {}
    for r in lines:
        by_step.setdefault(r["step"], set()).add(r["sum"])
        count[r["step"]] = count.get(r["step"], 0) + 1
    shared = [k for k in by_step if count[k] > 1]
    return (all(len(by_step[k]) == 1 for k in shared) if shared else None), len(shared)


def wait_until(run: Run, done, bound: float) -> bool:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if done(run.steps()):
            return True
        if run.all_exited():
            return False
        time.sleep(0.05)
    return False


def case(system: str, fault: str, k: int, args: argparse.Namespace) -> dict:
    """One run: start the job, let it step to --fault-at in the world of 4, inject the fault, measure."""
    run = Run(system, fault, k, args)
    job = f"goodput-{system}-{fault}-{k + 1}-{os.getpid()}"
    in_process = not system.startswith(TORCHRUN)
    try:
        run.start_infra()
        for node in range(WORLD):
            run.start_node(node, job)
            if node == 0 and system == "c10d":
                time.sleep(0.5)  # the store's host first
        full = lambda lines: {r["node"] for r in lines if r["world"] == WORLD and r["step"] >= args.fault_at}
        if not wait_until(run, lambda lines: len(full(lines)) == WORLD, args.start_bound):
            why = "every node exited" if run.all_exited() else f"not within {args.start_bound:g} s"
            return {"error": f"no world of {WORLD} reached step {args.fault_at} ({why}): {run.error_tail()}"}
        last = {}
        for r in run.steps():
            if r["world"] == WORLD:
                last[r["node"]] = r
        # The victim: the highest rank on a node that is neither node 0 (torchrun: the store's agent) nor rank 0.
        victim = max((n for n in last if n != 0 and last[n]["rank"] != 0), key=lambda n: last[n]["rank"])
        vpid, pre_epoch = last[victim]["pid"], last[victim]["epoch"]
        survivors = set(range(WORLD)) - {victim}
        sig = signal.SIGSTOP if fault == "stop" else signal.SIGKILL
        time.sleep(random.Random(f"{fault}-{k}").uniform(0, args.step_s))  # at any point of a step, the same for every system
        t0 = time.time()
        os.kill(vpid, sig)
        if fault == "replace" and system in TORCHRUN:
            signal_group(run.nodes[victim].pid, signal.SIGKILL)  # the agent too: the whole node
            signal_group(vpid, signal.SIGKILL)
        if fault == "stop":
            run.stopped.append(vpid)
        starts = lambda: {pid: r["t"] for pid, r in run.events("start").items()}
        need = WORLD - 1 if in_process or fault == "replace" else None

        def new(r: dict, started: dict[int, float]) -> bool:
            if r["t"] <= t0 or (need is not None and r["world"] != need):
                return False
            return r["epoch"] != pre_epoch if in_process else started.get(r["pid"], 0.0) > t0

        def recovered(lines: list[dict]) -> bool:
            started = starts()
            return {r["node"] for r in lines if r["node"] in survivors and new(r, started)} == survivors

        result: dict = {"victim": victim, "victim_rank": last[victim]["rank"]}
        ok = wait_until(run, recovered, args.bound)
        lines, started = run.steps(), starts()
        fresh = [r for r in lines if r["node"] in survivors and new(r, started)]
        if ok:
            first = {}
            for r in fresh:
                first.setdefault(r["node"], r)
            t_rec = max(r["t"] for r in first.values())
            result["seconds"] = t_rec - t0
            old = [r["step"] for r in lines if r["t"] <= t_rec and not new(r, started)]
            result["redone"] = max(old) + 1 - min(r["step"] for r in fresh)
            top = max(r["step"] for r in fresh)

            def reached(lines: list[dict]) -> bool:
                started = starts()
                return {r["node"] for r in lines if r["node"] in survivors and r["step"] >= top + args.after
                        and new(r, started)} == survivors

            wait_until(run, reached, args.bound)
            lines, started = run.steps(), starts()
            result["equal"], result["equal_steps"] = equal_sums([r for r in lines if r["node"] in survivors and new(r, started)])
        result["exited"] = {n: run.nodes[n].poll() for n in sorted(survivors) if run.nodes[n].poll() is not None}
        result["errors"] = sorted({r["error"][:160] for r in run.read() if r.get("event") == "error" and r["t"] > t0})
        result["uncommitted"] = sum(1 for r in run.read() if r.get("event") == "uncommitted" and r["t"] > t0)
        if fault != "replace":
            return result
        t_spawn = time.time()
        run.start_node(victim, job)
        joined = lambda lines, born: [r for r in lines if r["node"] == victim and r["world"] == WORLD
                                      and born.get(r["pid"], 0.0) > t_spawn]
        if not wait_until(run, lambda lines: bool(joined(lines, starts())), args.bound):
            result["replaced"] = None
            return result
        mine = joined(run.steps(), starts())[0]
        born, imported = starts()[mine["pid"]], run.events("imported").get(mine["pid"], {}).get("t")
        answered = run.events("joined").get(mine["pid"], {}).get("t")  # commctx: its Join answered, world formed
        result.update(replaced=mine["t"] - t_spawn, import_s=imported - born if imported else None,
                      after_import=mine["t"] - imported if imported else None,
                      after_join=mine["t"] - answered if answered else None)
        wait_until(run, lambda ls: sum(1 for r in ls if r["pid"] == mine["pid"]) > args.after, args.bound)
        with_all = [r for r in run.steps() if r["world"] == WORLD and r["t"] >= mine["t"] - args.step_s]
        result["equal"], result["equal_steps"] = equal_sums([r for r in with_all if r["step"] >= mine["step"]])
        return result
    except Exception as exc:  # noqa: BLE001 - one failed run is reported, the others go on
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        run.stop()


# -- the report --------------------------------------------------------------------------------------------------------


def steps_text(values: list[int | None]) -> str:
    done = sorted(v for v in values if v is not None)
    if not done:
        return "-"
    text = f"{statistics.median(done):g}" + (f" ({done[0]}-{done[-1]})" if len(done) > 1 else "")
    return text + (f"; {len(values) - len(done)} none" if len(done) < len(values) else "")


def equal_text(runs: list[dict]) -> str:
    got = [r.get("equal") for r in runs]
    if any(g is False for g in got):
        return f"NO in {sum(g is False for g in got)} of {len(got)}"
    if all(g is True for g in got):
        return f"yes ({min(r['equal_steps'] for r in runs)}+ steps)"
    return "-" if not any(got) else f"yes in {sum(g is True for g in got)} of {len(got)}"


def line_of(system: str, fault: str, k: int, r: dict, bound: float) -> str:
    f = lambda v: "-" if v is None else f"{v:.2f} s"
    if r.get("error"):
        return f"  {system:<16} {fault:<7} run {k + 1}: ERROR {r['error']}"
    recovered = f(r.get("seconds")) if r.get("seconds") is not None else f"> {bound:g} s"
    text = (f"  {system:<16} {fault:<7} run {k + 1}: recovered {recovered}, redone {r.get('redone', '-')}, "
            f"equal {r.get('equal')} ({r.get('equal_steps', 0)} steps)")
    if fault == "replace":
        text += (f"; replacement stepping with the others {f(r.get('replaced'))} after its start (import torch "
                 f"{f(r.get('import_s'))}, then {f(r.get('after_import'))}"
                 + (f"; {f(r['after_join'])} after its Join was answered" if r.get("after_join") is not None else "") + ")")
    if r.get("exited"):
        text += f"; survivors whose {'agent' if system in TORCHRUN else 'process'} exited (node: code) {r['exited']}"
    if r.get("uncommitted"):
        text += f"; {r['uncommitted']} uncommitted steps"
    if r.get("errors"):
        text += f"; worker errors: {' | '.join(r['errors'])[:400]}"
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="runs of each system and fault (default 3)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"which of {', '.join(SYSTEMS)} (default all)")
    p.add_argument("--faults", default=",".join(FAULTS), help="which of kill, stop, replace (default all)")
    p.add_argument("--bound", type=float, default=60.0, help="seconds any recovery is waited for (default 60)")
    p.add_argument("--start-bound", type=float, default=240.0, help="seconds the first world of 4 is waited for (default 240)")
    p.add_argument("--step-s", type=float, default=0.2, help="wall time of a step (default 0.2)")
    p.add_argument("--pad-at", choices=("compute", "end"), default="compute",
                   help="where a step sleeps: after the forward pass, before backward and the allreduce (compute, "
                        "default), or after the optimizer step (end)")
    p.add_argument("--fault-at", type=int, default=15, help="the fault once every node completed this step (default 15)")
    p.add_argument("--after", type=int, default=3, help="steps after recovery whose checksums are compared (default 3)")
    p.add_argument("--ckpt-every", type=int, default=10, help="torchrun workers: a checkpoint every N steps (default 10)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ft-timeout-s", type=float, default=4.0,
                   help="torchft-tuned: the Manager's timeout, quorum_timeout, connect_timeout, ProcessGroupGloo's (default 4)")
    p.add_argument("--ft-heartbeat-ms", type=int, default=4000,
                   help="torchft-tuned: the lighthouse's --heartbeat_timeout_ms (default 4000)")
    p.add_argument("--ft-join-ms", type=int, default=1000, help="torchft-tuned: lighthouse --join_timeout_ms (default 1000)")
    p.add_argument("--json", action="store_true", help="also print every run and the summary as one JSON object")
    p.add_argument("--logs", help="keep every run's logs in this directory (default: a new temporary one)")
    for name in ("--worker-torchrun", "--worker-torchft", "--worker-commctx"):
        p.add_argument(name, action="store_true", help=argparse.SUPPRESS)
    for name in ("--dir", "--system", "--lighthouse", "--server", "--job"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--node", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lifetime", type=float, default=900.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker_torchrun or args.worker_torchft or args.worker_commctx:
        (run_torchrun_worker if args.worker_torchrun else run_torchft_worker if args.worker_torchft else run_commctx_worker)(args)
        return
    systems, faults = args.systems.split(","), args.faults.split(",")
    if set(systems) - set(SYSTEMS) or set(faults) - set(FAULTS):
        p.error(f"unknown: {', '.join(sorted((set(systems) - set(SYSTEMS)) | (set(faults) - set(FAULTS))))}")
    args.logs = args.logs or tempfile.mkdtemp(prefix="commctx-goodput-")
    versions = {name: importlib.metadata.version(name) for name in ("torch", "torchft", "commctx")}
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {os.cpu_count()} cores, shared by every process below; Python "
          f"{sys.version.split()[0]}, {', '.join(f'{k} {v}' for k, v in versions.items())}")
    print(f"# model: MLP {'-'.join(map(str, DIMS))}, {PARAMS:,} float32 parameters, SGD momentum 0.9; {WORLD} workers, gloo, "
          f"global batch {BATCH}, step {args.step_s:g} s of wall time, its sleep "
          f"{'after the forward pass (before backward and the allreduce)' if args.pad_at == 'compute' else 'at its end'}; "
          f"fault at a random point of the step after step {args.fault_at}; "
          f"torchrun checkpoints every {args.ckpt_every} steps")
    print(f"# torchft: lighthouse --min_replicas 2, Manager(min_replica_size=2); defaults: timeouts 60 s, heartbeat timeout "
          f"5000 ms, join timeout 60000 ms; tuned: Manager(timeout=quorum_timeout=connect_timeout={args.ft_timeout_s:g} s), "
          f"ProcessGroupGloo(timeout={args.ft_timeout_s:g} s), --heartbeat_timeout_ms {args.ft_heartbeat_ms} "
          f"--join_timeout_ms {args.ft_join_ms}")
    print(f"# {args.repeat} runs per system and fault, systems alternating; median (range); waits capped at {args.bound:g} s")
    runs: dict[tuple[str, str], list[dict]] = {}
    for k in range(args.repeat):
        for fault in faults:
            for system in systems:
                note(f"{system} {fault} run {k + 1}")
                r = case(system, fault, k, args)
                runs.setdefault((system, fault), []).append(r)
                print(line_of(system, fault, k, r, args.bound), flush=True)
    rows = []
    for fault in faults:
        for system in systems:
            rs = runs[(system, fault)]
            ok = [r for r in rs if not r.get("error")]
            errs = len(rs) - len(ok)
            rec, _ = summary([r.get("seconds") for r in ok], args.bound, "no step") if ok else ("-", None)
            rep = "" if fault != "replace" or not ok else summary([r.get("replaced") for r in ok], args.bound, "no step")[0]
            imp = [r["import_s"] for r in ok if r.get("import_s") is not None]
            if imp:
                rep += f"; import {statistics.median(imp):.2f} s"
            answered = [r["after_join"] for r in ok if r.get("after_join") is not None]
            if answered:
                rep += f"; {statistics.median(answered):.2f} s after its Join"
            rows.append((system, fault, rec, steps_text([r.get("redone") for r in ok]), rep, equal_text(ok) if ok else "-",
                         f"{errs} of {len(rs)} failed: {next(r['error'] for r in rs if r.get('error'))[:80]}" if errs else ""))
    print()
    heads = ("system", "fault", "survivors stepping in the new world", "redone", "replacement stepping with the others",
             "bitwise equal", "")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    for row in (heads, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"# logs: {args.logs}")
    if args.json:
        internal = {"dir", "system", "lighthouse", "server", "job", "node", "lifetime"}
        print(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in internal and not k.startswith("worker")},
                          "versions": versions,
                          "runs": [{"system": s, "fault": f, "run": i + 1, **r} for (s, f), rs in runs.items()
                                   for i, r in enumerate(rs)],
                          "table": [dict(zip(heads[:-1] + ("failed",), row)) for row in rows]}))


if __name__ == "__main__":
    main()
