"""Failure detection, side by side: how long after a process is killed (SIGKILL) or paused (SIGSTOP) the survivors know and run on.

Three sections, all in one run, each case repeated --repeat times (median and
range printed, every run listed):

1. CommContext workers (commctx only). 4 real worker processes
   (CommContext.join, gloo, an elastic job of 4 with min_size 3, one
   connection each) against a `commctx-server` subprocess with its defaults
   (lease TTL 10 s, reconnect grace 1 s, SQLite store). (a) SIGKILL of the
   highest rank: from the kill to the moment EVERY survivor's
   `wait_world_change()` has returned (each worker prints its wall-clock
   time; they share this machine's clock). (b) SIGSTOP of the highest rank:
   the same; a paused process keeps its connection, so only its lease finds
   it (expected between 2/3 TTL and TTL + 1 s after the stop). SIGCONT and
   clean-up follow.

2. torchrun agents, commctx against torch's c10d backend, the same scenario
   for both: 3 real agents (`python -m torch.distributed.run`) on loopback,
   `--nnodes=1:3 --nproc-per-node=1 --max-restarts=3 --local-addr=127.0.0.1`,
   workers that init gloo from torchrun's environment, all_reduce every
   100 ms and append one line (wall time, TORCHELASTIC_RESTART_COUNT, commctx
   generation, rank, world size) to a file once running in a world (after
   their first all_reduce). commctx: `--rdzv-conf node_key=nodeN`, nothing
   else (its defaults). c10d: the first agent hosts the store
   (`--rdzv-endpoint` on it, is_host=true; the others is_host=false); torch's
   defaults otherwise (keep-alive 5 s x 3, last call 30 s, join timeout
   600 s). (a) SIGKILL of a whole node (its agent's process group and its
   worker's, which torchrun starts in a session of its own) that neither
   hosts the rendezvous store nor is node rank 0: from the kill until every
   surviving node's worker runs in the next world (world size 2): the time
   the job stands idle. For commctx also when every surviving agent was told
   (the first "world ... is changing" its handler logs) and when the server
   removed the node (its log), and for both when every survivor's agent
   re-formed (started new workers). (b) SIGSTOP of such a node: the same.
   Every wait is capped at --bound seconds; a backend that never moved on
   within it is printed as "> BOUND s (not detected)", one whose agents
   re-formed but whose workers never ran in a world of 2 as "> BOUND s
   (re-formed after X s but never ran)".

3. 10,000 members, one paused (commctx). A server subprocess (unpinned,
   lease TTL --scale-ttl-s, default 4 s, SQLite) and 10,000 members with a
   session each, renewing every TTL/3 as CommContext does: 9,998 in
   --procs load processes (benchmarks/harness.py's start_loads, grpc.aio as
   in reform_scale.py) over --connections connections per process, and 2 in
   a probe process of their own (one connection each), so that the two
   timed members are read by an idle event loop. Once the world has formed
   and every session has opened and renewed at least once, the probe's first
   member stops renewing right after a renewal but keeps its stream open
   (what a SIGSTOPped process looks like); the row is when the watcher (the
   probe's other member) received the world change, minus (that last
   renewal + TTL). Also printed: when the server removed the member (its
   log), and the first, median and last of all 9,999 survivors. One
   connection per member (--connections 0) could not be held at TTL 4 s on
   this machine: the load processes could not open 10,000 sessions within
   their first lease (see benchmarks/results/detect.txt).

    python benchmarks/detect.py [--repeat 3] [--sections workers,torchrun,scale] [--bound 180] [--members 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import platform
import random
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from harness import cpu_s, scrape, start_loads, tune_gc

HERE = pathlib.Path(__file__).resolve()
# Variables a launcher or the calling shell could have left; agents and workers start clean.
SCRUB = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
         "LOCAL_WORLD_SIZE", "GROUP_RANK", "COMMCTX_SERVER", "COMMCTX_JOB_ID", "COMMCTX_TORCHRUN_WORLD")
CHANGING = "is changing"
REMOVED = ("disconnected", "expiry")  # the server's log events of a member removed (session closed without a Leave; lease)  # what the commctx client logs (WARNING, logger commctx) when its world changes
WORKER_LIFETIME_S = 900.0  # a worker left behind ends by itself


def step(what: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRUB and not k.startswith("TORCHELASTIC_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def append_line(path: str, record: dict) -> None:
    """One write with O_APPEND: lines of several processes never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def read_lines(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ours(pid: int, marker: str) -> bool:
    """Whether process `pid` still runs a command line naming `marker` (not a recycled pid)."""
    try:
        return marker in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def reap(proc: subprocess.Popen, wait_s: float) -> None:
    """Waits `wait_s` for a process asked to end, then kills its process group."""
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait(10)


# -- the processes this benchmark runs ---------------------------------------------------


def cc_worker(args: argparse.Namespace) -> None:
    """Section 1's worker: joins, prints its rank, waits for a world change and
    prints when wait_world_change() returned; leaves when stdin closes."""
    from commctx import CommContext

    ctx = CommContext.join(args.server, job_id=args.job, world_size=4, spec={"elastic": {"min_size": 3}},
                           backend="gloo", timeout=120)
    print(json.dumps({"event": "joined", "rank": ctx.get_global_rank(), "pid": os.getpid(), "t": time.time()}), flush=True)
    change = ctx.wait_world_change(args.bound)
    now = time.time()
    print(json.dumps({"event": "changed", "t": now if change is not None else None, "rank": ctx.get_global_rank(),
                      "reason": change.reason if change else None, "final": change.final if change else None}), flush=True)
    select.select([sys.stdin], [], [], args.bound)  # the parent closes stdin when done
    ctx.destroy()


def train(args: argparse.Namespace) -> None:
    """Section 2's worker, started by torchrun: init gloo from torchrun's
    environment, one all_reduce, then a line; all_reduce every 100 ms after."""
    spawned = time.time()
    node = int(os.environ.get("DETECT_NODE", "-1"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    append_line(args.out, {"event": "spawned", "t": spawned, "pid": os.getpid(), "node": node, "restart": restart})
    import torch
    import torch.distributed as dist

    world_file = os.environ.get("COMMCTX_TORCHRUN_WORLD", "")
    found = re.search(r"generation-(\d+)", world_file)
    x = torch.ones(1)
    try:
        dist.init_process_group("gloo")  # env://: torchrun's RANK, WORLD_SIZE, MASTER_ADDR/PORT (the agent's store)
        dist.all_reduce(x)
        append_line(args.out, {"event": "running", "t": time.time(), "spawned": spawned, "pid": os.getpid(), "node": node,
                               "restart": restart, "generation": int(found.group(1)) if found else None,
                               "rank": dist.get_rank(), "world_size": dist.get_world_size(),
                               "group_rank": int(os.environ.get("GROUP_RANK", "-1"))})
        deadline = time.monotonic() + args.lifetime
        while time.monotonic() < deadline:
            time.sleep(0.1)
            dist.all_reduce(x)
    except Exception as exc:  # a dead peer: say when, then fail as a worker does (the agent restarts the group)
        append_line(args.out, {"event": "failed", "t": time.time(), "pid": os.getpid(), "node": node, "restart": restart,
                               "error": f"{type(exc).__name__}: {exc}"[:200]})
        raise


# -- the server --------------------------------------------------------------------------


class Server:
    """`python -m commctx.server` on a free loopback port, its log kept in a file."""

    def __init__(self, log_path: str, *args: str) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        # --metrics-port 0: its HTTP server (metrics, and the dashboard where there is one) on a free port, not a fixed one
        self.proc = subprocess.Popen([sys.executable, "-m", "commctx.server", "--host", "127.0.0.1", "--port", "0",
                                      "--metrics-port", "0", *args],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=clean_env(), start_new_session=True)
        try:
            line = self._readline(60)
            if "listening on" not in line:
                raise RuntimeError(f"server did not start: {line!r}; log: {pathlib.Path(log_path).read_text()[-2000:]}")
        except BaseException:
            self.stop()
            raise
        self.address = f"127.0.0.1:{int(line.rsplit(':', 1)[1])}"
        url = re.search(r"https?://\S+", self._readline(30))
        self.metrics_url = None if url is None else \
            url.group(0) if url.group(0).endswith("/metrics") else url.group(0).rstrip("/") + "/metrics"

    def _readline(self, timeout_s: float) -> str:
        """The server's next stdout line, or "" if none comes within `timeout_s`."""
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        return got[0] if got else ""

    def events(self, job: str) -> list[tuple[float, str, dict]]:
        """The server's log lines about `job`: (wall time, event, fields)."""
        out = []
        for line in pathlib.Path(self.log_path).read_text(errors="replace").splitlines():
            parts = line.split(" ")
            if len(parts) < 4 or f"job={job}" not in parts:
                continue
            try:
                t = time.mktime(time.strptime(f"{parts[0]} {parts[1][:8]}", "%Y-%m-%d %H:%M:%S")) + int(parts[1][9:12]) / 1000
            except ValueError:
                continue
            fields = dict(p.split("=", 1) for p in parts[4:] if "=" in p and not p.startswith('"'))
            out.append((t, parts[3], fields))
        return out

    def first(self, job: str, names: str | tuple[str, ...], after: float = 0.0, **want: str) -> float | None:
        """When the server first logged one of `names` about `job` at or after `after` (with `want` fields)."""
        return next((t for t, _ in self.first_event(job, names, after, **want)), None)

    def first_event(self, job: str, names: str | tuple[str, ...], after: float = 0.0, **want: str) -> list[tuple[float, str]]:
        names = (names,) if isinstance(names, str) else names
        return [(t, event) for t, event, fields in self.events(job)
                if event in names and t >= after - 0.002 and all(fields.get(k) == v for k, v in want.items())][:1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            reap(self.proc, 30)
        self._log.close()


# -- 1. CommContext workers ------------------------------------------------------------


class Worker:
    def __init__(self, argv: list[str], log_path: str) -> None:
        self._err = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env=clean_env(), start_new_session=True)
        self.lines: list[dict] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError), self._cv:
                self.lines.append(json.loads(line))
                self._cv.notify_all()

    def wait_for(self, event: str, deadline: float) -> dict | None:
        with self._cv:
            self._cv.wait_for(lambda: any(r["event"] == event for r in self.lines) or self.proc.poll() is not None,
                              max(0.0, deadline - time.monotonic()))
            return next((r for r in self.lines if r["event"] == event), None)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # leave (destroy) and exit
        reap(self.proc, 15)
        self._err.close()


def workers_case(server: Server, how: str, k: int, bound: float, logs: str) -> dict:
    """One run of section 1: 4 workers, the highest rank killed or stopped."""
    job = f"cc-{how}-{k}"
    argv = [sys.executable, str(HERE), "--as-worker", "--server", server.address, "--job", job, "--bound", str(bound)]
    workers = [Worker(argv, os.path.join(logs, f"{job}-w{i}.log")) for i in range(4)]
    stopped = None
    try:
        deadline = time.monotonic() + 180
        joined = [w.wait_for("joined", deadline) for w in workers]
        if any(j is None for j in joined):
            return {"error": "the 4 workers did not join within 180 s"}
        time.sleep(TTL_SETTLE_S)  # every session open and renewing, rank 0's new spare offered
        time.sleep(random.uniform(0, PHASE_S))  # the fault at any point of a renewal period
        victim = max(workers, key=lambda w: w.wait_for("joined", deadline)["rank"])
        survivors = [w for w in workers if w is not victim]
        t0 = time.time()
        os.kill(victim.proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        if how == "stop":
            stopped = victim
        deadline = time.monotonic() + bound
        changed = [w.wait_for("changed", deadline) for w in survivors]
        times = [c["t"] for c in changed if c is not None and c["t"] is not None]
        removed = server.first(job, REMOVED, t0)
        formed = server.first(job, "formed", t0, generation="2")
        return {"seconds": max(times) - t0 if len(times) == len(survivors) else None, "first": min(times) - t0 if times else None,
                "removed": removed - t0 if removed else None, "formed": formed - t0 if formed else None,
                "reason": next((c["reason"] for c in changed if c is not None and c["reason"]), None)}
    finally:
        if stopped is not None and stopped.proc.poll() is None:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        for w in workers:
            w.stop()


TTL_SETTLE_S = 4.0  # after the world formed: sessions open, renewals under way (CommContext renews every TTL/3)
PHASE_S = 10.0 / 3  # a renewal period at the default TTL (c10d's keep-alive: 5 s): the fault comes uniformly within one


# -- 2. torchrun agents ------------------------------------------------------------------


class Agent:
    """A torchrun agent in a process group of its own; its output lines kept with the wall time they arrived."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str) -> None:
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.time()
            self.lines.append((now, line))
            self._log.write(f"{now:.3f} {line}")

    def first(self, text: str, after: float) -> float | None:
        return next((t for t, line in list(self.lines) if t >= after and text in line), None)

    def close(self) -> None:
        self._reader.join(5)
        self._log.close()


def torchrun_case(backend: str, how: str, k: int, server: Server | None, bound: float, logs: str) -> dict:
    """One run of section 2: 3 agents, a whole node killed or stopped."""
    job = f"tr-{backend}-{how}-{k}"
    out = os.path.join(logs, f"{job}.jsonl")
    endpoint = server.address if backend == "commctx" else f"127.0.0.1:{free_port()}"
    agents: list[Agent] = []
    stopped: list[int] = []
    try:
        for i in range(3):
            conf = f"node_key=node{i}" if backend == "commctx" else f"is_host={'true' if i == 0 else 'false'}"
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:3", "--nproc-per-node=1",
                    f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", f"--rdzv-conf={conf}",
                    "--max-restarts=3", "--local-addr=127.0.0.1",
                    str(HERE), "--as-train", "--out", out, "--lifetime", str(WORKER_LIFETIME_S)]
            agents.append(Agent(argv, clean_env(DETECT_NODE=str(i)), os.path.join(logs, f"{job}-agent{i}.log")))
            if i == 0 and backend == "c10d":
                time.sleep(0.5)  # the store's host first (the others would retry their connection anyway)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            running = {r["node"]: r for r in read_lines(out) if r["event"] == "running" and r["world_size"] == 3}
            if len(running) == 3 or any(a.proc.poll() is not None for a in agents):
                break
            time.sleep(0.1)
        if len(running) < 3:
            return {"error": f"the first world of 3 did not run within 240 s ({len(running)} nodes)"}
        time.sleep(2.0 + random.uniform(0, PHASE_S))  # the all_reduce loop under way; the fault at any point of a renewal period
        lines = read_lines(out)
        if any(r["event"] == "failed" for r in lines):
            return {"error": "a worker failed before the fault"}
        # Neither the rendezvous store's host (agent 0) nor node rank 0 (it serves the workers' store).
        victim = max((n for n in running if n != 0), key=lambda n: running[n]["group_rank"])
        worker_pid = running[victim]["pid"]
        survivors = [n for n in range(3) if n != victim]
        sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
        t0 = time.time()
        signal_group(agents[victim].proc.pid, sig)
        signal_group(worker_pid, sig)
        if how == "stop":
            stopped += [agents[victim].proc.pid, worker_pid]
        deadline = time.monotonic() + bound
        new: dict[int, dict] = {}
        while time.monotonic() < deadline and len(new) < len(survivors):
            for r in read_lines(out):
                if r["event"] == "running" and r["t"] > t0 and r["node"] in survivors and r["world_size"] == 2:
                    new.setdefault(r["node"], r)
            time.sleep(0.02)
        lines = read_lines(out)
        result: dict = {"victim": victim, "seconds": max(r["t"] for r in new.values()) - t0 if len(new) == len(survivors) else None}
        failed = [min((r["t"] for r in lines if r["event"] == "failed" and r["t"] > t0 and r["node"] == n), default=None)
                  for n in survivors]
        result["gloo_error"] = max(failed) - t0 if all(f is not None for f in failed) else None
        spawned = [min((r["t"] for r in lines if r["event"] == "spawned" and r["t"] > t0 and r["node"] == n), default=None)
                   for n in survivors]
        result["spawned"] = max(spawned) - t0 if all(s is not None for s in spawned) else None
        result["between"] = sorted({r["world_size"] for r in lines if r["event"] == "running" and r["t"] > t0} - {2})
        # Workers started after the fault that failed (not the survivors' first, whose peer died): a next world that did not work.
        fresh = {r["pid"] for r in lines if r["event"] == "spawned" and r["t"] > t0}
        retries = [r for r in lines if r["event"] == "failed" and r["pid"] in fresh]
        result["retries"] = len(retries)
        result["retry_error"] = retries[0]["error"][:150] if retries else None
        if backend == "commctx":
            told = [agents[n].first(CHANGING, t0) for n in survivors]
            result["told"] = max(told) - t0 if all(t is not None for t in told) else None
            said = next((line for n in survivors for t, line in agents[n].lines if t >= t0 and CHANGING in line), "")
            result["told_why"] = said.split(CHANGING, 1)[1].strip(" :\n")[:160] if said else None
            removed = server.first_event(job, REMOVED, t0)
            result["removed"] = removed[0][0] - t0 if removed else None
            result["removed_why"] = removed[0][1] if removed else None
        return result
    finally:
        for pid in stopped:
            signal_group(pid, signal.SIGCONT)
        for a in agents:
            signal_group(a.proc.pid, signal.SIGKILL)
        for r in read_lines(out):  # workers run in sessions of their own: end every one this run started
            if r["event"] == "spawned" and alive(r["pid"]) and ours(r["pid"], out):
                signal_group(r["pid"], signal.SIGKILL)
        for a in agents:
            a.proc.wait(30)
            a.close()


# -- 3. 10,000 members, one paused -------------------------------------------------------


class Member:
    def __init__(self, stub, job: str, member_id: str, secret: str, rank: int, spare: int, ttl: float) -> None:
        self.stub, self.job, self.member_id, self.secret, self.rank, self.spare, self.ttl = stub, job, member_id, secret, rank, spare, ttl
        self.generation = 1
        self.call = None
        self.lock = asyncio.Lock()  # one write at a time on a stream
        self.settled = asyncio.Event()  # the session opened (its lease arrived), or failed
        self.opened = False
        self.error: str | None = None
        self.sent = 0
        self.last_renewal = (0.0, 0.0)  # (monotonic, wall) after the last write
        self.pause = False  # asked to stop renewing after its next renewal
        self.paused: asyncio.Future | None = None
        self.running = True
        self.told_at: float | None = None  # monotonic: the first world change (world_changed, assignment or gone)
        self.how: str | None = None

    def failed(self, exc: BaseException) -> None:
        if self.running and self.error is None:
            code = exc.code().name if hasattr(exc, "code") else type(exc).__name__
            details = exc.details() if hasattr(exc, "details") else str(exc)
            self.error = f"{code}: {details}"[:160]
        self.settled.set()

    async def send(self) -> None:
        from commctx.v1 import rendezvous_pb2 as pb

        async with self.lock:
            await self.call.write(pb.SessionRequest(job_id=self.job, member_id=self.member_id, member_secret=self.secret,
                                                    generation=self.generation, spare_port=self.spare))
        self.sent += 1
        self.last_renewal = (time.monotonic(), time.time())

    async def run(self, delay: float, opening: asyncio.Semaphore) -> None:
        reader = None
        try:
            async with opening:  # at most OPENING sessions of a load process opening at once
                self.call = self.stub.Session()
                reader = asyncio.ensure_future(self.read())
                await self.send()
                await self.settled.wait()
            await asyncio.sleep(delay)  # spread renewals over the period
            while self.running:
                if not self.pause:
                    await self.send()
                elif not self.paused.done():  # stopped right after a renewal: the stream stays open, silent
                    self.paused.set_result(self.last_renewal)
                await asyncio.sleep(self.ttl / 3)
        except Exception as exc:  # noqa: BLE001 - counted and reported by the load process
            self.failed(exc)
        finally:
            if self.call is not None:
                self.call.cancel()
            if reader is not None:
                reader.cancel()

    async def read(self) -> None:
        try:
            async for event in self.call:
                kind = event.WhichOneof("event")
                if kind == "lease_ttl_ms":
                    self.opened = True
                    self.settled.set()
                elif kind in ("world_changed", "assignment", "gone"):
                    if self.told_at is None:
                        self.told_at, self.how = time.monotonic(), kind
                    if kind == "assignment":
                        self.generation = event.assignment.generation
            self.failed(EOFError("the server ended the session"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            self.failed(exc)


# Sessions a load process opens at once: each then waits for its lease before the next opens. Real workers open theirs
# as their Join returns, each in its own process; one process opening thousands at one instant instead would send the
# first messages seconds after the streams start (its own event loop is the bottleneck), and the server closes a
# stream that names no member within one lease TTL.
OPENING = 200


def scale_load(first: int, count: int, address: str, total: int, ttl: float, per_process: int, probe: bool, conn) -> None:
    """A load process: `count` members from `first`, each on a connection of its own (per_process 0) or over
    `per_process`. The probe process holds the two members that are timed (the one that pauses, the watcher),
    so that their clocks are read by an idle event loop."""
    tune_gc()
    try:
        asyncio.run(_scale_load(first, count, address, total, ttl, per_process, probe, conn))
    except BaseException:
        conn.send(("error", traceback.format_exc()[-3000:]))
        raise


def errors_of(members: list[Member]) -> str:
    counts: dict[str, int] = {}
    for m in members:
        if m.error:
            counts[m.error] = counts.get(m.error, 0) + 1
    return "; ".join(f"{n} x {e}" for e, n in sorted(counts.items(), key=lambda kv: -kv[1])[:3]) or "none"


async def _scale_load(first: int, count: int, address: str, total: int, ttl: float, per_process: int, probe: bool,
                      conn) -> None:
    import grpc

    from commctx.v1 import rendezvous_pb2 as pb
    from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

    recv = lambda: asyncio.to_thread(conn.recv)  # noqa: E731
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(per_process or count)]
    tasks: list[asyncio.Task] = []
    members: list[Member] = []
    try:
        await asyncio.gather(*(asyncio.wait_for(c.channel_ready(), 300) for c in channels))
        stubs = [pb_grpc.RendezvousStub(c) for c in channels]
        conn.send("connected")
        if await recv() == "stop":  # every process connected: all Join at once
            return
        spec = pb.JobSpec(world_size=total, elastic=pb.Elastic(min_size=total - 1, last_call_ms=600_000))
        requests = [pb.JoinRequest(job_id="scale", spec=spec, node_key=f"probe{i}" if probe else f"node{(first + i) // 8}",
                                   address="127.0.0.1", master_port=(60000 + i) if probe else 20000 + (first + i) % 40000,
                                   wait_timeout_ms=600_000) for i in range(count)]
        joined = await asyncio.gather(*(stubs[i % len(stubs)].Join(r, timeout=660) for i, r in enumerate(requests)))
        # Rank 0's spare serves the store now: it offers another, as CommContext does, so the next world can form at once.
        members = [Member(stubs[i % len(stubs)], "scale", r.member_id, r.member_secret, r.assignment.rank,
                          50000 + (first + i) % 10000 if r.assignment.rank == 0 else requests[i].master_port, ttl)
                   for i, r in enumerate(joined)]
        conn.send("joined")
        if await recv() == "stop":
            return
        opening = time.monotonic()
        gate = asyncio.Semaphore(OPENING)
        tasks = [asyncio.ensure_future(m.run(ttl / 3 * (first + i) / total, gate)) for i, m in enumerate(members)]
        await asyncio.wait_for(asyncio.gather(*(m.settled.wait() for m in members)), 300)
        opened = sum(m.opened for m in members)
        if opened < count:
            conn.send(("error", f"{opened} of {count} sessions opened in {time.monotonic() - opening:.1f} s; errors: {errors_of(members)}"))
            return
        conn.send(("open", time.monotonic() - opening))
        deadline = time.monotonic() + 300
        while any(m.sent < 2 for m in members) and time.monotonic() < deadline:  # opened, then renewed at least once
            await asyncio.sleep(0.05)
        conn.send(("renewed", sum(m.sent >= 2 and m.error is None for m in members), errors_of(members)))
        order = await recv()
        if order == "stop":
            return
        victim_at, watcher_at, bound = order  # indices into this process's members, or None
        victim = members[victim_at] if victim_at is not None else None
        if victim is not None:
            victim.paused = asyncio.get_running_loop().create_future()
            victim.pause = True
            conn.send(("paused", *await asyncio.wait_for(victim.paused, 60)))
        others = [m for m in members if m is not victim]
        deadline = time.monotonic() + ttl + bound
        while any(m.told_at is None for m in others) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        watcher = members[watcher_at] if watcher_at is not None else None
        conn.send(("told", [m.told_at for m in others if m.told_at is not None], len(others),
                   watcher.told_at if watcher is not None else None, sorted({m.how for m in others if m.how}),
                   victim.told_at if victim is not None else None, errors_of(members),
                   (victim.rank, watcher.rank) if probe else None))
        await recv()
    finally:
        for m in members:
            m.running = False
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in channels:
            await c.close()
    conn.send("closed")


def collect(pipes: list, what: str, timeout_s: float) -> list:
    """One message from every load process, waiting on all at once; raises at the first failure."""
    from multiprocessing.connection import wait

    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(pipes):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(pipes) - len(got)} load process(es) said nothing for {timeout_s:g} s while {what}")
        for c in wait([c for i, c in enumerate(pipes) if i not in got], left):
            i = pipes.index(c)
            try:
                message = c.recv()
            except EOFError:
                raise RuntimeError(f"a load process exited while {what}") from None
            if isinstance(message, tuple) and message and message[0] == "error":
                raise RuntimeError(f"a load process failed while {what}: {message[1]}")
            got[i] = message
    return [got[i] for i in range(len(pipes))]


def scale_case(k: int, args: argparse.Namespace, logs: str) -> dict:
    n, ttl = args.members, args.scale_ttl_s
    with tempfile.TemporaryDirectory() as state:
        server = Server(os.path.join(logs, f"scale-{k}-server.log"), "--lease-ttl-s", str(ttl), "--state-dir", state)
        pipes, procs = [], []
        try:
            pipes, procs = start_loads(scale_load, n - 2, args.procs, server.address, n, ttl, args.connections, False)
            probe_pipes, probe_procs = start_loads(scale_load, 2, 1, server.address, n, ttl, 2, True)
            pipes, procs = pipes + probe_pipes, procs + probe_procs  # the probe last
            collect(pipes, "connecting", 600)
            for c in pipes:
                c.send("join")
            step(f"scale {k}: {n if args.connections == 0 else args.connections * args.procs} connections ready; joining")
            collect(pipes, "joining", 600)
            step(f"scale {k}: world formed; opening sessions")
            for c in pipes:
                c.send("sessions")
            opened = collect(pipes, "opening sessions", 600)
            renewed = collect(pipes, "renewing", 600)
            step(f"scale {k}: every session open (the slowest load process took {max(o[1] for o in opened):.1f} s); "
                 f"{sum(r[1] for r in renewed)} of {n} renewed since; errors: {', '.join(r[2] for r in renewed)}")
            time.sleep(ttl / 2)  # a steady state: renewals spread over the period, the opening burst over
            c0, m0, t0 = cpu_s(server.proc.pid), machine_busy(), time.monotonic()
            time.sleep(ttl)  # the steady window: the server's share of the CPU, and the machine's
            c1, m1, t1 = cpu_s(server.proc.pid), machine_busy(), time.monotonic()
            server_cpu, busy = (c1 - c0) / (t1 - t0), (m1[0] - m0[0]) / max(1e-9, m1[1] - m0[1])
            for c in pipes[:-1]:
                c.send((None, None, args.bound))
            pipes[-1].send((0, 1, args.bound))  # the probe: its first member pauses, its second watches
            paused = collect(pipes[-1:], "pausing a member", 60)[0][1:]
            reports = collect(pipes, "waiting for the world change", ttl + args.bound + 60)
            step(f"scale {k}: reported")
            gauges = scrape(server.metrics_url)
            for c in pipes:
                c.send("stop")
            collect(pipes, "closing", 120)
            last_mono, last_wall = paused
            lease_end = last_mono + ttl
            told = sorted(t for r in reports for t in r[1])
            watcher = reports[-1][3]
            removed = server.first("scale", REMOVED, last_wall)
            formed = server.first("scale", "formed", last_wall, generation="2")
            return {"watcher": watcher - lease_end if watcher is not None else None,
                    "first": told[0] - lease_end if told else None,
                    "median": statistics.median(told) - lease_end if told else None,
                    "last": told[-1] - lease_end if len(told) == sum(r[2] for r in reports) else None,
                    "told": len(told), "survivors": sum(r[2] for r in reports), "how": sorted({h for r in reports for h in r[4]}),
                    "removed": removed - (last_wall + ttl) if removed else None,
                    "formed": formed - (last_wall + ttl) if formed else None,
                    "victim_gone": next((r[5] - lease_end for r in reports if r[5] is not None), None),
                    "per_process": [(min(r[1]) - lease_end, max(r[1]) - lease_end) if r[1] else None for r in reports],
                    "errors": ", ".join(r[6] for r in reports), "server_cpu": server_cpu, "busy": busy,
                    "lag": gauges.get("commctx_event_loop_lag_max_seconds"), "ranks": reports[-1][7]}
        except (RuntimeError, TimeoutError) as exc:
            return {"error": f"{exc}"[:600] + f"; server: {server_metrics(server)}"}
        finally:
            for c in pipes:
                with contextlib.suppress(OSError):
                    c.send("stop")
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join(10)
            server.stop()


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat, in clock ticks."""
    fields = [int(v) for v in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def server_metrics(server: Server) -> str:
    """The server's session and error counters (how sessions ended, RPC errors by code), for a run that failed."""
    try:
        values = scrape(server.metrics_url)
    except OSError as exc:
        return f"metrics unavailable ({exc})"
    keep = {k: v for k, v in values.items() if v and (k.startswith("commctx_session_ends_total") or k.startswith("commctx_rpc_errors_total")
                                                      or k.startswith("commctx_members_removed_total"))}
    return ", ".join(f"{k.replace('commctx_', '')}={v:g}" for k, v in sorted(keep.items())) or "no errors counted"


# -- the report --------------------------------------------------------------------------


def not_done(runs: list[dict], key: str, bound: float) -> str:
    """What a run that never got there did instead: nothing (not detected), or re-formed but never ran."""
    missing = [r for r in runs if r.get(key) is None]
    reformed = [r["spawned"] for r in missing if r.get("spawned") is not None]
    if key != "seconds" or not reformed:
        return "not detected"
    if len(reformed) < len(missing):
        return "not detected, or re-formed but never ran"
    return f"re-formed after {min(reformed):.0f}-{max(reformed):.0f} s but never ran" if len(reformed) > 1 else \
        f"re-formed after {reformed[0]:.0f} s but never ran"


def summary(values: list[float | None], bound: float, not_done: str = "not detected") -> tuple[str, float | None]:
    """'median (min-max)' of a case's runs; a run that never finished counts as over the bound."""
    if not values:
        return "not run", None
    done = sorted(v for v in values if v is not None)
    missing = len(values) - len(done)
    ordered = done + [float("inf")] * missing
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else statistics.median(ordered)
    if missing == len(values):
        return f"> {bound:g} s ({not_done}, {missing} of {len(values)})", None
    high = f"over {bound:g}" if missing else f"{done[-1]:.2f}"
    if median == float("inf"):
        return f"> {bound:g} s ({not_done} in {missing} of {len(values)}; others {done[0]:.2f}-{done[-1]:.2f})", None
    note = f"; {missing} of {len(values)} {not_done}" if missing else ""
    return f"{median:.2f} s ({done[0]:.2f}-{high}{note})", median


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.3f} {unit}"


def header(args: argparse.Namespace) -> None:
    import commctx
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {os.cpu_count()} cores ({cpu}), shared with the server and every "
          f"process below; Python {platform.python_version()}, torch {torch.__version__}; commctx from "
          f"{pathlib.Path(commctx.__file__).resolve().parent}")
    print(f"# {args.repeat} runs per case, cases alternating; median (range) over the runs; waits capped at {args.bound:g} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="runs of each case (default 3)")
    p.add_argument("--sections", default="workers,torchrun,scale", help="which of workers, torchrun, scale to run")
    p.add_argument("--bound", type=float, default=180.0, help="seconds any detection is waited for (default 180)")
    p.add_argument("--backends", default="commctx,c10d", help="torchrun rendezvous backends to compare (default commctx,c10d)")
    p.add_argument("--cases", default="kill,stop", help="faults to inject: kill (SIGKILL), stop (SIGSTOP); default both")
    p.add_argument("--members", type=int, default=10_000, help="members of the paused-member world (default 10,000)")
    p.add_argument("--procs", type=int, default=4, help="load processes holding them (default 4)")
    p.add_argument("--connections", type=int, default=25,
                   help="connections per load process (default 25); 0: one per member")
    p.add_argument("--scale-ttl-s", type=float, default=4.0, help="lease TTL of the paused-member world (default 4)")
    p.add_argument("--logs", help="keep every log (server, agents, workers) in this directory")
    p.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--as-train", action="store_true", help=argparse.SUPPRESS)
    for name in ("--server", "--job", "--out"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--lifetime", type=float, default=WORKER_LIFETIME_S, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.as_worker:
        cc_worker(args)
        return
    if args.as_train:
        train(args)
        return
    sections = args.sections.split(",")
    unknown = set(sections) - {"workers", "torchrun", "scale"}
    if unknown:
        p.error(f"unknown sections: {', '.join(sorted(unknown))}")
    logs_dir = args.logs or tempfile.mkdtemp(prefix="commctx-detect-")
    os.makedirs(logs_dir, exist_ok=True)
    header(args)
    rows: list[tuple[str, str, str, str]] = []

    if "workers" in sections:
        print("# 1. CommContext workers: 4 processes, CommContext.join(gloo, spec elastic min_size 3), one connection each; "
              "commctx-server with its defaults (--lease-ttl-s 10, --reconnect-grace-s 1, SQLite). The highest rank is "
              "SIGKILLed or SIGSTOPped, 4 s after the world formed plus a random 0-3.33 s (any point of a renewal period); the "
              "clock runs from the signal to the last survivor's wait_world_change() returning "
              "(wall clocks of one machine). removed / formed: the server's log (ms), from the signal.")
        runs: dict[str, list[dict]] = {"kill": [], "stop": []}
        with tempfile.TemporaryDirectory() as state:
            server = Server(os.path.join(logs_dir, "workers-server.log"), "--state-dir", state)
            try:
                for k in range(args.repeat):
                    for how in args.cases.split(","):
                        step(f"workers {how} {k}")
                        r = workers_case(server, how, k, args.bound, logs_dir)
                        runs.setdefault(how, []).append(r)
                        print(f"  workers SIG{how.upper():<4} run {k + 1}: every survivor told {fmt(r.get('seconds'))} "
                              f"(first {fmt(r.get('first'))}); server removed {fmt(r.get('removed'))}, formed generation 2 "
                              f"{fmt(r.get('formed'))}; reason: {r.get('reason') or r.get('error')}", flush=True)
            finally:
                server.stop()
        for how, name in (("kill", "1a CommContext workers, SIGKILL: every survivor's wait_world_change() (target <= 1.5 s)"),
                          ("stop", "1b CommContext workers, SIGSTOP: every survivor's wait_world_change() (window 6.67-11 s)")):
            text, _ = summary([r.get("seconds") for r in runs.get(how, [])], args.bound)
            rows.append((name, text, "", ""))

    if "torchrun" in sections:
        print("# 2. torchrun: 3 agents `python -m torch.distributed.run --nnodes=1:3 --nproc-per-node=1 --max-restarts=3 "
              "--local-addr=127.0.0.1` on loopback (monitor interval: torch's default 0.1 s); workers init gloo from "
              "torchrun's env (init_process_group('gloo'), the same script for both), all_reduce every 100 ms, gloo's default "
              "30 min timeout.")
        print("#    commctx: --rdzv-endpoint=<commctx-server, its defaults: TTL 10 s, grace 1 s> --rdzv-conf=node_key=nodeN (nothing else).")
        print("#    c10d: --rdzv-endpoint=127.0.0.1:<free port> on agent 0, --rdzv-conf=is_host=true (agent 0) / is_host=false; "
              "torch's defaults: keep-alive 5 s x 3, last call 30 s, join timeout 600 s, the rendezvous TCPStore shared "
              "with the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset).")
        print("#    A whole node (agent + its worker, neither the store's host nor node rank 0) is SIGKILLed or SIGSTOPped, 2 s "
              "after all 3 workers ran plus a random 0-3.33 s; the "
              "clock runs to the moment every surviving node's worker runs in the world of 2 (after its first all_reduce). "
              "gloo error: the survivors' all_reduce failed; re-formed: every survivor's agent started new workers; told: "
              "every surviving commctx agent logged the change (and why); removed: the server's log; failed restarts: new "
              "workers that failed before one world of 2 ran.")
        runs2: dict[tuple[str, str], list[dict]] = {}
        with tempfile.TemporaryDirectory() as state:
            server = Server(os.path.join(logs_dir, "torchrun-server.log"), "--state-dir", state)
            try:
                for k in range(args.repeat):
                    for how in args.cases.split(","):
                        for backend in args.backends.split(","):
                            step(f"torchrun {backend} {how} {k}")
                            r = torchrun_case(backend, how, k, server, args.bound, logs_dir)
                            runs2.setdefault((backend, how), []).append(r)
                            extra = ""
                            if backend == "commctx":
                                extra = (f"; told {fmt(r.get('told'))} ({r.get('told_why')}); server removed {fmt(r.get('removed'))} "
                                         f"({r.get('removed_why')})")
                            seconds = fmt(r.get("seconds")) if r.get("seconds") is not None else f"> {args.bound:g} s"
                            retries = f"; {r['retries']} failed restarts ({r['retry_error']})" if r.get("retries") else ""
                            print(f"  torchrun {backend:<7} SIG{how.upper():<4} run {k + 1}: survivors running in the world of 2 "
                                  f"{seconds}; gloo error {fmt(r.get('gloo_error'))}, re-formed {fmt(r.get('spawned'))}"
                                  f"{extra}{retries}{'; worlds between: ' + str(r['between']) if r.get('between') else ''}"
                                  f"{'; ERROR ' + r['error'] if r.get('error') else ''}", flush=True)
            finally:
                server.stop()
        for how, sig in (("kill", "SIGKILL"), ("stop", "SIGSTOP")):
            if not any((b, how) in runs2 for b in ("commctx", "c10d")):
                continue
            cc_runs, c10d_runs = runs2.get(("commctx", how), []), runs2.get(("c10d", how), [])
            for key, name in (("seconds", f"2{'a' if how == 'kill' else 'b'} torchrun, {sig} of a node: survivors running in the next world"),
                              ("spawned", "   the survivors' agents re-formed (new workers started)")):
                cc_text, cc = summary([r.get(key) for r in cc_runs], args.bound)
                c10d_text, c10d = summary([r.get(key) for r in c10d_runs], args.bound, not_done=not_done(c10d_runs, key, args.bound))
                if cc and c10d:
                    ratio = f"{c10d / cc:.1f}x"
                elif cc and c10d_runs:
                    ratio = f"> {args.bound / cc:.0f}x"
                else:
                    ratio = ""
                rows.append((name, cc_text, c10d_text, ratio))
            told_text, _ = summary([r.get("told") for r in cc_runs], args.bound)
            removed_text, _ = summary([r.get("removed") for r in cc_runs], args.bound)
            rows.append(("   commctx: every surviving agent told / the server removed the node",
                         f"{told_text.split(' (')[0]} / {removed_text.split(' (')[0]}", "", ""))

    if "scale" in sections:
        how = "one connection per member" if args.connections == 0 else \
            f"{args.connections} connections per load process ({args.connections * args.procs} in all)"
        print(f"# 3. {args.members} members with sessions: {args.members - 2} in {args.procs} load processes over {how}, "
              f"and 2 (the one that pauses, the watcher) in a probe process of their own, one connection each, so that "
              f"their times are read by an idle event loop; grpc.aio clients renewing every TTL/3 on their sessions. "
              f"commctx-server unpinned, --lease-ttl-s {args.scale_ttl_s:g}, SQLite; elastic (min {args.members - 1}). Once "
              f"every session has opened and renewed, the probe's first member stops renewing right after a renewal (its "
              f"stream kept open) and the clock starts at that renewal + TTL (monotonic clock, read after the write). "
              f"watcher: the probe's other member; first / median / last: over all {args.members - 1} survivors (the load "
              f"processes read late when busy); removed / formed: the server's log (ms, wall clock). A run whose "
              f"{args.members} sessions cannot be opened within their first lease (TTL + 1 ms per member) is retried, "
              f"at most twice, and shown.")
        runs3 = []
        for k in range(args.repeat):
            for attempt in range(3):
                step(f"scale {k}" + (f" (attempt {attempt + 1})" if attempt else ""))
                r = scale_case(k, args, logs_dir)
                if r.get("error") and "opening sessions" in r["error"] and attempt < 2:
                    print(f"  scale run {k + 1}, attempt {attempt + 1}: the world could not be held: {r['error']}; again", flush=True)
                    continue
                break
            runs3.append(r)
            ranks = r.get("ranks") or ("-", "-")
            print(f"  scale run {k + 1}: watcher (rank {ranks[1]}; the paused member: rank {ranks[0]}) told "
                  f"{fmt(r.get('watcher'))} after the lease end; all survivors: first {fmt(r.get('first'))}, median "
                  f"{fmt(r.get('median'))}, last {fmt(r.get('last'))} ({r.get('told')}/{r.get('survivors')} told, by "
                  f"{r.get('how')}); server removed {fmt(r.get('removed'))}, formed generation 2 {fmt(r.get('formed'))}; the "
                  f"paused member told gone {fmt(r.get('victim_gone'))}; first-last by process: "
                  f"{', '.join(f'{a:.2f}-{b:.2f}' for a, b in filter(None, r.get('per_process') or []))}; session errors: "
                  f"{r.get('errors')}; steady window before the pause: server {pct(r.get('server_cpu'))} of one core, machine "
                  f"{pct(r.get('busy'))} busy; server's worst loop lag (last 10 s) {fmt(r.get('lag'))}"
                  f"{'; ERROR ' + r['error'] if r.get('error') else ''}", flush=True)
        text, _ = summary([r.get("watcher") for r in runs3], args.bound)
        rows.append((f"3 {args.members} members, one paused: watcher told - (last renewal + TTL) (target <= 0.3 s)", text, "", ""))
        for key, name in (("removed", "   the server removed it (its log)"),
                          ("last", f"   the last of all {args.members - 1} survivors told")):
            text, _ = summary([r.get(key) for r in runs3], args.bound)
            rows.append((name, text, "", ""))

    print()
    width = max(len(r[0]) for r in rows) if rows else 10
    print(f"{'scenario':<{width}}  {'commctx median (range)':<34}  {'c10d median (range)':<40}  ratio c10d/commctx")
    for name, cc, c10d, ratio in rows:
        print(f"{name:<{width}}  {cc:<34}  {c10d:<40}  {ratio}")
    print(f"# logs: {logs_dir}")


if __name__ == "__main__":
    main()
