"""Helpers for tests/test_torch_elastic.py: PyTorch's own elastic tests' worker
functions and agent harness, ported from test/distributed/elastic/agent/server/
test/local_elastic_agent_test.py and test/distributed/launcher/api_test.py
(BSD-style licence, Facebook, Inc. and its affiliates), made to run one
rendezvous backend or another: `commctx` (a commctx-server) or `c10d` (a TCPStore
on a free port, hosted by the agent given is_host).

A module of its own, importable without pytest: agent processes start from
a fork server that has imported it (agent_process); one that a test kills at
once never starts (doomed_agent). The workers are forked from their
agent ("fork", where torch's tests spawn them): each spawned worker would
import torch again, seconds of CPU each, which the suite's 2 cores cannot
give; a forked worker ends with os._exit and touches no gRPC of its agent's.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.forkserver as mp_forkserver
import os
import queue
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

import commctx.torchrun  # noqa: F401  (registers the backend, as its entry point does)

START_METHOD = "fork"  # torch's tests: "spawn" (see the module docstring)
# A forked worker must not collect its parent's objects: the garbage collector
# once freed a gRPC object the child inherited from an agent running in the test
# process, whose threads the fork left behind ("Other threads are currently
# calling into gRPC, skipping fork() handlers"), and gRPC aborted the worker
# while it wrote its error file (an empty error.json: torch's agent then failed
# on it). Frozen, they are never collected in the child.
os.register_at_fork(after_in_child=gc.freeze)
MONITOR_INTERVAL = 0.1  # torch's agent tests: 0.01, a store round trip every 10 ms per c10d agent


# -- worker functions (local_elastic_agent_test.py) -------------------------------------

def _happy_function():
    return


def _sad_function():
    raise RuntimeError("sad because i throw")


def dummy_compute() -> torch.Tensor:
    """returns a predefined size random Tensor"""
    return torch.rand(100, 100)


def dummy_compute_simulate_rank_failure() -> torch.Tensor:
    """fails rank 1 once; in other cases, returns a predefined size random Tensor"""
    if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), 9)
    return torch.rand(100, 100)


def _check_master_port_addr_override(expected_master_addr: str, expected_master_port: int):
    actual_master_addr = os.environ["MASTER_ADDR"]
    actual_master_port = int(os.environ["MASTER_PORT"])
    if expected_master_addr != actual_master_addr and expected_master_port != actual_master_port:
        raise RuntimeError(f"Expected addr: {expected_master_addr}:{expected_master_port}, "
                           f"got addr: {actual_master_addr}:{actual_master_port}")


def _bipolar_function():
    rank = int(os.environ["RANK"])
    if rank % 2 == 0:
        _happy_function()
    else:
        _sad_function()


def _bipolar_sleep_function(sleep_sec):
    rank = int(os.environ["RANK"])
    if rank % 2 == 0:
        _sleep(sleep_sec)
    else:
        _sad_function()


def _dist_sum(wait=0):
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="gloo")
    t = torch.tensor(rank)

    time.sleep(wait)  # the scenario, not a wait for something: work of `wait` s before the all_reduce
    dist.all_reduce(t, op=dist.ReduceOp.SUM)

    expected_sum = sum(range(world_size))
    actual = t.item()
    if expected_sum != actual:
        raise RuntimeError(f"Expected rank sum {expected_sum}, got {actual}")


def _sleep(sleep_sec) -> int:
    time.sleep(sleep_sec)  # the scenario, not a wait for something: a worker that works for sleep_sec
    return int(os.environ["RANK"])


@dataclass
class RankInfo:
    rank: int
    role_rank: int
    group_rank: int
    role_world_size: int
    world_size: int


def _get_role_info() -> RankInfo:
    rank = int(os.environ["RANK"])
    role_rank = int(os.environ["ROLE_RANK"])
    group_rank = int(os.environ["GROUP_RANK"])
    role_world_size = int(os.environ["ROLE_WORLD_SIZE"])
    world_size = int(os.environ["WORLD_SIZE"])
    return RankInfo(rank, role_rank, group_rank, role_world_size, world_size)


def _echo(msg):
    return msg


def _check_env_function():
    # just check these env vars exist, os.environ[...] will naturally throw
    # if the variable does not exist
    env_vars = [
        "RANK", "LOCAL_RANK", "ROLE_RANK", "ROLE_NAME", "GROUP_RANK", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE",
        "WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ]
    for var in env_vars:
        _ = os.environ[var]


def _check_env_value(key: str, expected: str):
    # checks if the env var ``key`` matches ``value``
    if key not in os.environ:
        raise RuntimeError(f"Environment variable {key} not found in os.environ")
    actual = os.getenv(key)
    if expected != actual:
        raise RuntimeError(f"os.environ['{key}']={actual} does not equal the expected value: {expected}")


def _check_local_watchdog_setup(key: str, should_exist: bool):
    if should_exist and key not in os.environ:
        raise RuntimeError(f"Environment variable {key} not found in os.environ")
    if not should_exist and key in os.environ:
        raise RuntimeError(f"Environment variable {key} found in os.environ")


# -- worker functions (launcher/api_test.py) --------------------------------------------

def simple_rank_scale():
    rank = int(os.environ["RANK"])
    return 10 + rank


# -- worker functions of the scenarios -------------------------------------------------

def env_of_worker(*keys: str) -> dict[str, str]:
    """The worker's torchrun variables (a scenario's check of ranks)."""
    return {k: os.environ[k] for k in keys or ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                               "TORCHELASTIC_RESTART_COUNT")}


def env_when_file(path: str, timeout_s: float = 60.0) -> dict[str, str]:
    """Waits until `path` exists (failing after `timeout_s`), then returns
    env_of_worker(): a worker that runs until the test lets it finish."""
    from .waiting import wait_until  # here: this module is imported without pytest (the fork server)

    wait_until(lambda: os.path.exists(path), timeout_s, f"{path} to exist", interval_s=0.05)
    return env_of_worker()


# -- the harness -------------------------------------------------------------------------

def free_port() -> int:
    """A free port on localhost (local_elastic_agent_test.acquire_available_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Backend:
    """A rendezvous backend as the tests use it: its name, endpoint and this test's run id."""
    name: str
    endpoint: str
    run_id: str
    conf: dict[str, Any] = field(default_factory=dict)  # extra rdzv_configs (both backends take them)


@dataclass
class Conf:
    """Holds arguments to launch an agent (e.g. simulates an agent run on a node)."""
    entrypoint: Callable
    local_world_size: int
    args: tuple = ()
    role: str = "default"
    redirects: Std = Std.NONE
    tee: Std = Std.NONE


def rdzv_parameters(backend: Backend, min_nodes: int, max_nodes: int, is_host: bool = True) -> RendezvousParameters:
    return RendezvousParameters(backend=backend.name, endpoint=backend.endpoint, run_id=backend.run_id,
                                min_nodes=min_nodes, max_nodes=max_nodes, is_host=is_host, **backend.conf)


def get_worker_spec(backend: Backend, node_config: Conf, min_nodes=1, max_nodes=1, max_restarts=0,
                    monitor_interval=MONITOR_INTERVAL, master_addr_override: str | None = None,
                    master_port_override: int | None = None, is_host=True) -> WorkerSpec:
    rdzv_handler = rdzv_registry.get_rendezvous_handler(rdzv_parameters(backend, min_nodes, max_nodes, is_host))
    return WorkerSpec(role=node_config.role, local_world_size=node_config.local_world_size,
                      entrypoint=node_config.entrypoint, args=node_config.args, rdzv_handler=rdzv_handler,
                      max_restarts=max_restarts, monitor_interval=monitor_interval, master_addr=master_addr_override,
                      master_port=master_port_override)


def get_agent(spec: WorkerSpec, node_config: Conf, start_method: str = START_METHOD, exit_barrier_timeout=5,
              log_line_prefix_template: str | None = None) -> LocalElasticAgent:
    return LocalElasticAgent(spec, start_method=start_method, exit_barrier_timeout=exit_barrier_timeout,
                             logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="torchelastic_"),
                                                         redirects=node_config.redirects, tee=node_config.tee),
                             log_line_prefix_template=log_line_prefix_template)


@record
def run_agent(backend: Backend, conf: Conf, agent_results=None, min_nodes=1, max_nodes=1,
              start_method: str = START_METHOD, max_restarts: int = 0, exit_barrier_timeout=5,
              master_addr_override: str | None = None, master_port_override: int | None = None, is_host=True,
              monitor_interval=MONITOR_INTERVAL, log_line_prefix_template: str | None = None) -> RunResult | None:
    """Runs a single agent (in this process, a thread of it, or a process of
    its own); with `agent_results`, puts (role, result) there, as torch's does."""
    spec = get_worker_spec(backend, node_config=conf, min_nodes=min_nodes, max_nodes=max_nodes,
                           max_restarts=max_restarts, master_addr_override=master_addr_override,
                           master_port_override=master_port_override, is_host=is_host,
                           monitor_interval=monitor_interval)
    agent = get_agent(spec=spec, node_config=conf, start_method=start_method,
                      exit_barrier_timeout=exit_barrier_timeout, log_line_prefix_template=log_line_prefix_template)

    result = agent.run()
    spec.rdzv_handler.shutdown()

    if agent_results:
        agent_results.put((conf.role, result))

    if result.is_failed():
        raise ChildFailedError(spec.get_entrypoint_name(), result.failures)
    if not agent_results:
        return result
    return None


def run_job(backend: Backend, node_configs: list[Conf], exit_barrier_timeout: int = 5,
            log_line_prefix_template: str | None = None, timeout_s: float = 90.0) -> dict[str, list[RunResult]]:
    """Simulates running a distributed job by running multiple agents, each in
    a process of its own as torch's run_job does (forked from a fork server:
    agents in threads of one process fork their workers while the others' threads
    hold locks, and c10d's then hang in gloo's connect), node 0 (the c10d host) started last."""
    nnodes = len(node_configs)
    agent_results = _fork_server().Queue()
    procs = []
    for node_idx in reversed(range(nnodes)):
        kwargs = {"conf": node_configs[node_idx], "agent_results": agent_results, "min_nodes": nnodes,
                  "max_nodes": nnodes, "max_restarts": 0, "exit_barrier_timeout": exit_barrier_timeout,
                  "is_host": node_idx == 0, "log_line_prefix_template": log_line_prefix_template}
        procs.append(agent_process(run_agent, backend, **kwargs))
    deadline = time.monotonic() + timeout_s
    results: dict[str, list[RunResult]] = {}
    try:
        for _ in range(nnodes):  # read before joining: a process does not end before what it put is read
            try:
                role, run_result = agent_results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{nnodes - sum(map(len, results.values()))} agents had no result after {timeout_s} s") from None
            results.setdefault(role, []).append(run_result)
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return results


def join_all(threads: list[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        raise AssertionError(f"{len(alive)} agents still running after {timeout_s} s")


# -- agents in processes of their own ----------------------------------------------------

def _with_env(env: dict[str, str], target: Callable, args: tuple, kwargs: dict):
    os.environ.clear()
    os.environ.update(env)
    return target(*args, **kwargs)


def _fork_server() -> mp.context.BaseContext:
    """The fork server's context, the server started once, importing this module, without
    gRPC's fork support: the agents fork their workers while their rendezvous session's
    thread is in gRPC, whose fork handlers then skip ("Other threads are currently calling
    into gRPC"), and a forked worker once died of SIGSEGV in them. The workers never use
    gRPC; gRPC's fork support is for children that do."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    saved = os.environ.get("GRPC_ENABLE_FORK_SUPPORT")
    os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"  # read by the fork server's grpc import, not by this process's
    try:
        mp_forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["GRPC_ENABLE_FORK_SUPPORT"]
        else:
            os.environ["GRPC_ENABLE_FORK_SUPPORT"] = saved
    return ctx


def agent_process(target: Callable, *args, **kwargs) -> mp.BaseProcess:
    """`target` in a process of its own, forked from a fork server that has
    imported this module (torch's tests fork the test process, which runs gRPC
    here, or spawn one that imports torch for seconds). It starts with this
    process's environment, as a forked or spawned one would."""
    ctx = _fork_server()
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "false"}  # (gRPC reads it again when it starts: see _fork_server)
    p = ctx.Process(target=_with_env, args=(env, target, args, kwargs))
    p.start()
    return p


def doomed_agent() -> mp.BaseProcess:
    """A node whose agent a test kills at once, before it reaches the rendezvous.
    torch's tests spawn a real agent and kill it while it still imports torch
    (seconds), so it never joins; this process is forked and waits to be killed,
    which is the same to the other agents and to the server, without the import."""
    return agent_process(time.sleep, 3600)


# -- launcher/api_test.py -------------------------------------------------------------------

SCRIPT = os.path.join(os.path.dirname(__file__), "elastic_script.py")


def get_test_launch_config(backend: Backend, min_nodes: int, max_nodes: int, nproc_per_node: int, run_id: str = "",
                           config: dict | None = None) -> LaunchConfig:
    rdzv_configs = dict(backend.conf)
    if config:
        rdzv_configs.update(config)
    return LaunchConfig(min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node, run_id=run_id,
                        rdzv_endpoint=backend.endpoint, monitor_interval=0.1, rdzv_backend=backend.name,
                        start_method=START_METHOD, max_restarts=0, rdzv_configs=rdzv_configs)


def elastic_launch_wrapper(backend: Backend, test_dir: str, min_nodes: int, max_nodes: int, nproc_per_node: int,
                           run_id: str):
    """A wrapper function for class `elastic_launch.` in order to make multiprocess returns correct exit code."""
    elastic_launch(get_test_launch_config(backend, min_nodes, max_nodes, nproc_per_node, run_id),
                   sys.executable)("-u", SCRIPT, f"--touch-file-dir={test_dir}")


# -- the scenarios' helpers -------------------------------------------------------------------

def handler_params(backend: Backend, min_nodes: int, max_nodes: int, is_host: bool, **conf) -> RendezvousParameters:
    """A handler's parameters without an agent: commctx then needs nproc_per_node (no WorkerSpec to read)."""
    extra = {"nproc_per_node": 1} if backend.name == "commctx" else {}
    return RendezvousParameters(backend=backend.name, endpoint=backend.endpoint, run_id=backend.run_id,
                                min_nodes=min_nodes, max_nodes=max_nodes, local_addr="127.0.0.1", is_host=is_host,
                                **extra, **backend.conf, **conf)


def node_until_killed(backend: Backend, min_nodes: int, max_nodes: int, report) -> None:
    """A node without an agent that joins, puts (rank, world size) on `report`,
    and holds its membership until its process is killed (at most 120 s)."""
    handler = rdzv_registry.get_rendezvous_handler(handler_params(backend, min_nodes, max_nodes, is_host=False))
    info = handler.next_rendezvous()
    report.put((info.rank, info.world_size))
    threading.Event().wait(120)


class AgentRunner(threading.Thread):
    """agent.run() in a thread; `result` or `error` once it ends."""

    def __init__(self, agent: LocalElasticAgent) -> None:
        super().__init__(daemon=True, name="elastic-agent")
        self.agent = agent
        self.result: RunResult | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.agent.run()
        except BaseException as exc:  # noqa: BLE001 (the test reads it)
            self.error = exc


class Call(threading.Thread):
    """fn() in a thread; `result` once it returns, `error` if it raised."""

    def __init__(self, fn: Callable) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001
            self.error = exc


def start_thread(fn: Callable) -> Call:
    t = Call(fn)
    t.start()
    return t
