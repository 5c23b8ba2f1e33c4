"""torchrun's rendezvous on commctx: `torchrun --rdzv-backend=commctx`.

torch finds this handler through the `torchrun.handlers` entry point. The job
is a *job of nodes*, as c10d's rendezvous is: it forms from --nnodes=MIN:MAX
agents, each of its own size. Each torchrun agent joins as one node
membership: a single Join carries the node's workers (its --nproc-per-node,
read from the agent's own WorkerSpec, so nodes may differ), and the server
seats them as local ranks 0..n-1 of that node, so ranks come out exactly as
torchrun computes them (global rank = workers of lower node ranks + local
rank). An agent is a node: two agents on one host are two nodes (the default
node key is the host name and the agent's pid). The agent's lease is renewed
on one session stream; on it the server pushes the next world when a node
dies, leaves or arrives, and `num_nodes_waiting` turns positive so that the
agent restarts its workers into it. No polling of the server. A node that
arrives at a job at its maximum waits as a standby (c10d's redundancy list)
and is seated when the world re-forms: a node lost, or the agents restarting.
`shutdown()` closes the run for every node: `is_closed()` turns true on the
others, and later joins are refused (RendezvousClosedError).

The store torchrun's agents and workers share is a TCPStore that node rank 0
serves on its pre-bound spare port (the master port the server handed out),
fresh for each generation. A restart after a worker failure asks the server
for the next generation of the same world, so every node restarts together.

Inside a worker, `CommContext.join()` needs no arguments: the handler writes
each generation's assignments to a file (COMMCTX_TORCHRUN_WORLD) and the
worker takes its own (launched.py), without a second wait on the server.

Configuration (`--rdzv-conf key=value,...`), under torch's names and with
torch's defaults:
    join_timeout       seconds to wait for the world (default 600)
    last_call_timeout  seconds an elastic job waits for more nodes once
                       --nnodes' minimum is present (default 30)
    close_timeout      seconds shutdown() waits for the server to close the run
                       (default 30)
    progress_interval  while waiting, say every this many seconds how many nodes
                       are there and who is missing (default COMMCTX_PROGRESS_S,
                       else 10; 0: silent)
    spec               a JSON file of the job's JobSpec (layout, groups); the
                       sizes are --nnodes', so it gives no world_size, elastic
                       or role counts
    node_key           this node's key (default: host name and agent pid, and
                       from a process's second handler on its number: agents
                       in threads of one process are nodes of their own, as
                       c10d's (host, pid, local id) makes them)
    role               the role of this node's workers
    nproc_per_node     this node's workers, when the agent's WorkerSpec cannot
                       be read (a handler used without torch's agent)
Accepted and ignored: the keys torch's launcher puts there itself (`timeout`,
from --rdzv-timeout or its default 900; `rank`, with --rdzv-backend=static
only) and those of torch's own c10d backend, so that a command line moved from
c10d runs unchanged: read_timeout, keep_alive_interval, keep_alive_max_attempt,
heartbeat (commctx's lease and session stand for them), is_host, store_type,
use_libuv (node rank 0's agent always serves the store, a TCPStore). Any other key is a RendezvousError when the handler is
created, naming the key and the closest known one (`join_timout` -> "did you
mean join_timeout?"): a misspelt key is never silently ignored. Quotes that no
shell removed (`--rdzv-conf='a=1,b=2'` given to torch.distributed.run.main as
a list, as torch's own tests do; torch's parser keeps them: keys "'a", values
"2'") are removed, as a shell would have.
Environment: COMMCTX_TOKEN, COMMCTX_JOB_SECRET, COMMCTX_TLS_* as for workers.
"""

from __future__ import annotations


def handler():
    """The `torchrun.handlers` entry point: returns the handler's creator.

    Defined before the torch imports below: importing torch's rendezvous
    package loads every entry point of that group, this one included, so a
    process that imports this module first finds `handler` already here, and
    the creator it returns looks up `create_handler` when called, once this
    module is whole."""
    return lambda params: create_handler(params)


import contextlib
import datetime
import difflib
import itertools
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from commctx.v1 import rendezvous_pb2 as pb

from . import _torch, errors
from .arguments import job_spec_of, progress_seconds
from .credentials import tls_of
from .errors import InvalidArgument, InvalidRequest, JobClosed, MemberNotFound, RendezvousTimeout, ServerUnavailable, UsageError
from .launched import WORLD_ENV
from .launcher import LauncherEnv
from .netif import advertised_address, interface_of, listen_on
from .progress import describe_wait, say
from .session import Session

log = logging.getLogger("commctx")



def create_handler(params: RendezvousParameters) -> CommctxRendezvousHandler:
    return CommctxRendezvousHandler(params)


_HANDLERS = itertools.count()  # handlers made in this process with the default node key


def default_node_key() -> str:
    """This agent's node: the host name and pid, and from the second handler made
    in the process on, its number (several agents in one process, as torch's own
    tests run them in threads, are nodes of their own, as c10d's local id makes
    them; sharing a key, the second would wait for a node already joined)."""
    key = f"{socket.gethostname()}-{os.getpid()}"
    n = next(_HANDLERS)
    return f"{key}-{n}" if n else key


# --rdzv-conf keys commctx reads (see the module docstring).
CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "spec", "node_key", "role", "nproc_per_node",
             "progress_interval")
# Keys accepted and ignored: torch's launcher's own, and those of torch's c10d backend.
TORCH_CONF_KEYS = ("timeout", "rank")
IGNORED_CONF_KEYS = (*TORCH_CONF_KEYS, "read_timeout", "keep_alive_interval", "keep_alive_max_attempt",
                     "heartbeat", "is_host", "store_type", "use_libuv")


def unquoted(params: RendezvousParameters) -> RendezvousParameters:
    """`params` without the quotes a shell would have removed from --rdzv-conf
    (torch's parser keeps them when no shell ran: "'join_timeout" = "5"), which
    c10d, ignoring keys it does not know, lets pass unread."""
    def bare(v):
        return v.strip("'\"") if isinstance(v, str) else v

    config = {bare(k): bare(v) for k, v in params.config.items()}
    if config == params.config:
        return params
    return RendezvousParameters(params.backend, params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
                                params.local_addr, **config)


def check_conf(params: RendezvousParameters) -> None:
    """Refuses a --rdzv-conf key that commctx neither reads nor knows to ignore.

    Raises:
        RendezvousError: one line naming the key and the closest known one.
    """
    for key in params.config:
        if key in CONF_KEYS or key in IGNORED_CONF_KEYS:
            continue
        close = difflib.get_close_matches(str(key).lower().replace("-", "_"), [*CONF_KEYS, *IGNORED_CONF_KEYS], n=1)
        hint = f": did you mean {close[0]}?" if close else ""
        raise RendezvousError(f"commctx: unknown --rdzv-conf key {str(key)[:64]!r}{hint} (commctx reads "
                              f"{', '.join(CONF_KEYS)}; it ignores {', '.join(IGNORED_CONF_KEYS)})")


def local_world_size(params: RendezvousParameters) -> int | None:
    """`nproc_per_node` from --rdzv-conf, or None when it is not there (then the
    agent's own WorkerSpec tells, at the first rendezvous: agent_local_world_size).

    Raises:
        RendezvousError: it is there but not a positive integer.
    """
    value = params.get("nproc_per_node")
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise RendezvousError(f"commctx: nproc_per_node {value!r} is not a positive integer")
    return n


def agent_local_world_size() -> int | None:
    """The local world size of the torch elastic agent asking for a rendezvous:
    torch passes its handlers no worker count, but every launcher (the torchrun
    CLI, elastic_launch, run.main) runs a SimpleElasticAgent, whose
    `_rendezvous(worker_group)` calls next_rendezvous with the WorkerSpec in
    hand. Read from that caller's frame; None when no agent is calling (none
    can be where torch's agent module was never imported)."""
    api = sys.modules.get("torch.distributed.elastic.agent.server.api")
    if api is None:
        return None
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        spec = frame.f_locals.get("spec")
        if isinstance(spec, api.WorkerSpec):
            return spec.local_world_size
        frame = frame.f_back
    return None


def _seconds(params: RendezvousParameters, key: str, default: float) -> float:
    """A --rdzv-conf duration in seconds."""
    value = params.get(key, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0:
        raise RendezvousError(f"commctx: {key} {value!r} is not a number of seconds")
    return seconds


class CommctxRendezvousHandler(RendezvousHandler):
    """One torchrun agent's membership: its node and its workers."""

    def __init__(self, params: RendezvousParameters, env: Mapping[str, str] | None = None) -> None:
        params = unquoted(params)
        check_conf(params)  # first: a misspelt key is the one line to see
        if not params.endpoint:
            raise RendezvousError("commctx: give the rendezvous server as --rdzv-endpoint=HOST:PORT")
        self._server = params.endpoint
        self._run_id = params.run_id
        self._nproc = local_world_size(params)  # None: the agent's WorkerSpec says, at the first rendezvous
        self._min_nodes, self._max_nodes = params.min_nodes, params.max_nodes
        self._join_timeout = _seconds(params, "join_timeout", 600)
        self._close_timeout = _seconds(params, "close_timeout", 30)
        launcher = LauncherEnv.from_env(env)
        try:
            self._progress_s = progress_seconds(
                None if params.get("progress_interval") is None else _seconds(params, "progress_interval", 0), launcher)
        except InvalidArgument as exc:
            raise RendezvousError(f"commctx: {exc}") from None
        self._local_addr = params.local_addr
        self._tls = tls_of(None, None, None, launcher.tls_ca, launcher.tls_cert, launcher.tls_key)
        self._token = launcher.token
        spec = self._spec(params)
        self._request = pb.JoinRequest(
            job_id=self._run_id, spec=spec, node_key=params.get("node_key") or default_node_key(),
            role=params.get("role") or "", workers=self._nproc or 0, job_secret=launcher.job_secret or "",
        )
        self._timeout = datetime.timedelta(seconds=self._join_timeout)
        # Connected now, as torchrun's own c10d handler connects its store when it
        # is created: the rendezvous then costs one call on a ready connection.
        self._session = Session(self._server, self._tls, self._token)
        self._session.connect()
        self._joined = False
        self._spare: socket.socket | None = None
        self._store: dist.Store | None = None
        self._generation = 0
        self._closed = False
        # Named with the run id's safe characters only: the server checks the id itself, at the Join.
        self._dir = tempfile.mkdtemp(prefix=f"commctx-{re.sub(r'[^A-Za-z0-9._-]', '_', self._run_id)[:64]}-")
        # Removed at shutdown(), or when the agent exits without one (torch's launcher
        # skips it on SIGTERM; so does a program that drops its handler).
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self._dir, True)
        self.world_file = ""  # this generation's assignments, for the workers (COMMCTX_TORCHRUN_WORLD)

    def _spec(self, params: RendezvousParameters) -> pb.JobSpec:
        """A job of nodes, --nnodes=MIN:MAX, with the layout and groups of --rdzv-conf spec=FILE."""
        raw: dict = {}
        path = params.get("spec")
        if path:
            try:
                with open(path, encoding="utf-8") as f:
                    raw = json.load(f)
            except (OSError, ValueError) as exc:
                raise RendezvousError(f"commctx: cannot read the spec {path}: {exc}") from None
            if not isinstance(raw, dict):
                raise RendezvousError(f"commctx: the spec {path} is not a JSON object (a JobSpec)")
            for key in ("world_size", "elastic", "nodes", "roles"):
                if key in raw:
                    raise RendezvousError(f"commctx: the spec {path} gives {key}, but under torchrun the job's size is "
                                          f"--nnodes, in nodes of any size; leave {key} out (a node's role: --rdzv-conf role=)")
        last_call = _seconds(params, "last_call_timeout", 30)
        raw["nodes"] = {"min": self._min_nodes, "max": self._max_nodes, "last_call_ms": round(last_call * 1000)}
        try:
            return job_spec_of(raw, 0)
        except InvalidRequest as exc:  # naming the bad key or value
            raise RendezvousError(f"commctx: {exc.details}") from None

    # -- RendezvousHandler -----------------------------------------------------------

    def get_backend(self) -> str:
        return "commctx"

    @property
    def use_agent_store(self) -> bool:
        return True  # workers reach the store node rank 0's agent serves (TORCHELASTIC_USE_AGENT_STORE)

    def get_run_id(self) -> str:
        return self._run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Joins (first call) or moves into the next world: the one the server
        pushed, or, after a worker failure, a re-form of the current one."""
        if self._closed:
            raise RendezvousClosedError(f"commctx: the rendezvous of job {self._run_id!r} is closed")
        if not self._joined:
            self._request.workers = self._workers()
        try:
            if not self._joined:
                assignments = self._join()
            else:
                session = self._session
                change = session.world_change
                if change is None or change.generation < self._generation:
                    session.request_restart()  # a worker failed: everyone restarts into a fresh world
                session.next_assignment(self._join_timeout)
                assignments = session.current_world(self._request, self._join_timeout).worker_assignments
        except (MemberNotFound, JobClosed) as exc:  # the job cannot go on, or was closed: the run is over for this node
            self._closed = True
            raise RendezvousClosedError(f"commctx: job {self._run_id!r} cannot go on: {exc.details}") from None
        except RendezvousTimeout as exc:
            raise RendezvousTimeoutError(f"commctx: {exc.details}") from None
        except ServerUnavailable as exc:
            raise RendezvousConnectionError(f"commctx: {exc.details}") from None
        except (UsageError, errors.RendezvousError) as exc:  # e.g. a conflicting spec, a sealed job
            raise RendezvousError(f"commctx: {exc}") from None
        return self._enter(assignments)

    def _workers(self) -> int:
        """This node's workers: the agent's own WorkerSpec's, else --rdzv-conf nproc_per_node.

        Raises:
            RendezvousError: neither tells (a handler used without torch's agent).
        """
        n = agent_local_world_size() or self._nproc
        if n is None:
            raise RendezvousError("commctx: cannot tell how many workers this node runs: no torch elastic agent asked "
                                  "for this rendezvous; give --rdzv-conf nproc_per_node=N")
        self._nproc = n
        return n

    def _join(self) -> Sequence[pb.Assignment]:
        started = time.monotonic()
        address = advertised_address(self._server, self._local_addr, self._join_timeout)  # a late name is waited for
        # As CommContext.join does: gloo and NCCL use the interface that carries the
        # advertised address, unless the user chose one (workers inherit this).
        ifname = interface_of(address)
        if ifname is not None:
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                os.environ.setdefault(name, ifname)
        if self._spare is not None:  # an earlier try that failed
            self._spare.close()
        self._spare = listen_on(address)
        self._request.address = address
        self._request.master_port = self._spare.getsockname()[1]
        deadline = started + self._join_timeout
        while True:
            try:  # one Join: it answers with every worker's assignment
                self._session.join(self._request, max(1.0, deadline - time.monotonic()), self._progress_s,
                                   lambda job, d: describe_wait(job, d, nodes_wanted=(self._min_nodes, self._max_nodes)))
                break
            except RendezvousTimeout:
                if not self._standby():  # a standby waits on, as c10d's redundant nodes do; else it is a timeout
                    raise
                deadline = time.monotonic() + self._join_timeout
        self._joined = True
        return self._session.worker_assignments

    def _standby(self) -> bool:
        """Whether this node waits as a standby: the job runs a world at its maximum of nodes."""
        try:
            d = self._session.describe(self._join_timeout)
        except errors.RendezvousError:
            return False
        if d.state == pb.JobDescription.FORMED:  # below its maximum this node would have grown the world, not waited
            say("job %s runs %d nodes, its maximum: this node waits as a standby for the next world", self._run_id,
                self._max_nodes)
            return True
        return False

    def _enter(self, assignments: Sequence[pb.Assignment]) -> RendezvousInfo:
        """Serves (node rank 0) or opens this generation's store, and writes the workers' assignments."""
        first = assignments[0]
        self._generation = first.generation
        self._session.settle(first.generation)  # a change pushed while we asked is spent if this is it
        self._store = None  # the previous generation's store goes (rank 0: its server closes)
        if first.node_rank == 0:
            spare, self._spare = self._spare, None
            if spare is None or spare.getsockname()[1] != first.master_port:
                raise RendezvousError(f"commctx: the server made this node rank 0 on port {first.master_port}, "
                                      f"which it does not hold")
            self._store = _torch.store_on_socket(first.master_addr, first.master_port, first.num_nodes, self._timeout, spare)
            self._spare = listen_on(self._request.address)  # the next world's
            self._session.offer_spare(self._spare.getsockname()[1])
        else:
            self._store = dist.TCPStore(first.master_addr, first.master_port, first.num_nodes, False, timeout=self._timeout)
        path = os.path.join(self._dir, f"generation-{first.generation}.pb")
        world = pb.JoinResponse(worker_assignments=assignments)  # no member id or secret
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(world.SerializeToString())
        if self.world_file and self.world_file != path:  # the previous generation's workers are gone
            with contextlib.suppress(OSError):
                os.unlink(self.world_file)
        self.world_file = path
        os.environ.update({"COMMCTX_SERVER": self._server, "COMMCTX_JOB_ID": self._run_id, WORLD_ENV: path})
        say("job %s generation %d: node rank %d of %d, ranks %d..%d of %d, master %s:%d",
                 self._run_id, first.generation, first.node_rank, first.num_nodes, first.rank,
                 first.rank + first.local_world_size - 1, first.world_size, first.master_addr, first.master_port)
        return RendezvousInfo(self._store, first.node_rank, first.num_nodes,
                              RendezvousStoreInfo(first.master_addr, first.master_port))

    def is_closed(self) -> bool:
        """True once the run was closed (a node's shutdown), or cannot go on for this node."""
        if self._closed:
            return True
        change = self._session.world_change
        return change is not None and change.final

    def set_closed(self) -> None:
        """Closes the run for every node (torch's API): they see is_closed(), later joins are refused."""
        self._closed = True
        self._session.close(leave=True, close_job=True, leave_timeout_s=self._close_timeout)

    def num_nodes_waiting(self) -> int:
        """Positive when the server pushed a change of this world: the agent then
        restarts its workers (next_rendezvous). Read from the session, no RPC."""
        change = self._session.world_change
        return 1 if change is not None and not change.final and change.generation >= self._generation else 0

    def shutdown(self) -> bool:
        """Closes the run for every node, as torch's launcher expects when an agent
        finishes (c10d does the same), and releases what this agent holds."""
        self._closed = True
        self._session.close(leave=True, close_job=True, leave_timeout_s=self._close_timeout)
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        self._store = None
        self._remove_dir()
        return True

