"""CommContext: the seed API, a small façade over a group registry (one map from
mode to group record) and, once joined, a membership (join, rejoin, destroy).

A process-wide singleton (`CommContext()` always returns the same object until
`destroy()` resets it). `CommContext.join(...)` joins a job on a rendezvous
server, initialises torch.distributed through the tcp:// URL it was given and
builds every group of the plan; `init_distributed_env(...)` works alone too,
without a server, as the seed API's. CUDA is touched only when the backend is NCCL.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch.distributed as dist

from commctx.common.modes import GLOBAL, INTER_NODE, INTRA_NODE, Mode, mode_key
from commctx.v1 import rendezvous_pb2 as pb

from .arguments import check_count, check_seconds, progress_seconds, share_host_of
from .assignment import Assignment
from .backends import check_backend, resolve_backend
from .errors import GroupNotFound, InvalidArgument, MemberNotFound, UsageError
from .join_request import join_arguments
from .launched import LaunchedWorker
from .launcher import LauncherEnv
from .lifecycle import Membership
from .news import WorldChange
from .process_groups import destroy_all, init_world
from .registry import GroupRecord, GroupRegistry
from .world import DESTROY_TIMEOUT_S

DEFAULT_JOIN_TIMEOUT_S = 600.0

__all__ = ["CommContext", "LauncherEnv"]


class CommContext:
    """Singleton communication context for PyTorch distributed.

    The seed's attributes are read-only views of the group registry:

    Attributes:
        _local_ranks: mode -> this rank's position in the mode's group.
        _global_ranks: mode -> global rank (GLOBAL only).
        _world_sizes: mode -> size of the mode's group.
        _ranks_in_group: mode -> global ranks of the mode's group.
        _groups: mode -> ProcessGroup.
    """

    _instance: ClassVar[CommContext | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    def __new__(cls, *args: Any, **kwargs: Any) -> CommContext:
        with cls._instance_lock:
            if cls._instance is None:
                instance = super().__new__(cls)
                instance._registry = GroupRegistry()
                instance._membership = None
                cls._instance = instance
            return cls._instance

    _registry: GroupRegistry
    _membership: Membership | LaunchedWorker | None

    # -- joining a rendezvous ------------------------------------------------------

    @classmethod
    def join(
        cls,
        server_addr: str | None = None,
        *,
        job_id: str | None = None,
        world_size: int | None = None,
        node_key: str | None = None,
        local_rank: int | None = None,
        node_rank: int | None = None,
        role: str | None = None,
        spec: Mapping[str, Any] | pb.JobSpec | None = None,
        advertise_addr: str | None = None,
        backend: str = "auto",
        timeout: float = DEFAULT_JOIN_TIMEOUT_S,
        collective_timeout: int = 1800,
        on_world_changed: Callable[[WorldChange], None] | None = None,
        abort_on_change: bool = True,
        share_host: bool | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        token: str | None = None,
        job_secret: str | None = None,
        progress_interval: float | None = None,
    ) -> CommContext:
        """Joins `job_id` on the rendezvous server and returns the ready context.

        Blocks until `world_size` workers have joined, then initialises
        torch.distributed through the assigned tcp:// URL and builds the
        GLOBAL, INTRA_NODE and INTER_NODE groups and every group of `spec`.

        In a task of an srun step (SLURM_STEP_ID and SLURM_PROCID set) that
        torchrun did not start (under torchrun its variables win), what the
        arguments and COMMCTX_* leave open comes from Slurm: the job
        'slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>' (each srun of an allocation
        is a job of its own), world_size SLURM_NTASKS, node_key
        SLURMD_NODENAME and, when the world is the whole step (world_size
        SLURM_NTASKS, no elastic spec), node_rank SLURM_NODEID and local_rank
        SLURM_LOCALID. The server's assignment is then checked against
        those values; a global rank other than SLURM_PROCID only warns (a
        step laid out other than block-wise: the server numbers node by node).

        Args:
            server_addr: 'host:port' of the rendezvous server (port defaults to 50051),
                or of its HA replicas: a comma-separated list, or one DNS name
                that resolves to several addresses; the leader is found and
                followed across failovers. Default: COMMCTX_SERVER.
            job_id: The job to join; workers with the same id form one world.
                Default: COMMCTX_JOB_ID, else under srun the step's.
            world_size: Number of workers in the job; under srun, default
                SLURM_NTASKS.
            node_key: Identifies this worker's node; default: under srun the
                Slurm node's name (SLURMD_NODENAME), else the hostname and a
                digest of /etc/machine-id ('gpu7_3f2a9c1e'), so that two hosts
                of one name stay two nodes. The server refuses a default key
                (Slurm's included) that arrives from two machines; a key given
                here is trusted.
            local_rank: This worker's rank in its node, if the launcher knows it
                (under srun, default SLURM_LOCALID).
            node_rank: This node's rank, if the launcher knows it (under srun,
                default SLURM_NODEID).
            role: This worker's role (e.g. "trainer"), for role-based groups.
            spec: The job's layout, roles and group rules, as the JobSpec
                message or its JSON form as a dict (see proto/commctx/v1);
                every worker of the job passes the same.
            advertise_addr: IP peers reach this worker on; default: the local
                address of the route to the server.
            backend: 'auto' (NCCL with CUDA, else gloo), 'nccl', 'gloo', or
                another backend of torch.distributed.Backend.
            timeout: Seconds to wait for the world to form (positive).
            collective_timeout: torch.distributed timeout in seconds (positive).
            on_world_changed: Called (from the thread that brings the server's
                news; keep it quick) when the server re-forms the world; see rejoin().
            abort_on_change: When the server says members of the current
                world went without a Leave (a lease expired: a hung process or
                a dead host; a session closed: a killed process), or the job
                cannot go on for this worker, abort the world's process groups
                at once, so that a collective blocked on them raises (torch's
                RuntimeError; commctx.elastic's guard makes it a WorldChanged)
                instead of waiting out `collective_timeout`. Members that
                left, or a world that grows, abort nothing. A collective that
                completed is not affected. False: the old world's collectives
                run on until they complete or time out.
            share_host: The workers of this job and node key on this machine
                share one membership, one lease and one session with the
                server: the first to join holds them for all, and if its
                process dies another takes over. False: a membership of its
                own. Default: COMMCTX_SHARE_HOST ("0" off), else True.
            tls_ca: PEM file of the CA that signed the server's certificate:
                talk TLS (default: COMMCTX_TLS_CA; neither: plaintext).
            tls_cert, tls_key: PEM files of this worker's certificate and key,
                for a server that requires client certificates (default:
                COMMCTX_TLS_CERT, COMMCTX_TLS_KEY).
            token: The bearer token of a server started with --auth-tokens
                (default: COMMCTX_TOKEN): printable ASCII without spaces.
            job_secret: Seals the job (the first worker's join) so that only
                workers with the same secret can join or describe it
                (default: COMMCTX_JOB_SECRET; neither: an open job): 16-256
                printable ASCII characters without spaces.
            progress_interval: While it waits, every this many seconds the
                join says on stderr (the `commctx` logger, or stderr itself
                when the application configured no logging) who it waits for:
                "waiting for job 'ppo': 1 of 3 workers (nodes: vm×1); 2
                missing". 0 silences it. Default: COMMCTX_PROGRESS_S, else 10.

        Raises:
            InvalidArgument (a UsageError and a ValueError): an argument,
                or the variable standing for it, cannot be right: a backend
                torch does not have, a timeout or collective_timeout that is
                not a positive number of seconds, a world_size that is not a
                positive integer, a server address that is not host:port (a
                URL, a port out of range), a malformed token or job secret.
                Raised before any wait or network call.
            UsageError: this process is already initialised, no server
                or job is given, NCCL without a CUDA device, or a TLS file
                cannot be read; under srun, a Slurm variable is malformed, or
                the server assigned another world size, node rank, local rank
                or node size than Slurm's (after the join; the message names
                both).
            InvalidRequest: a `spec` dict that is not a JobSpec (before any call).
            RendezvousError: the server refused the join or the world did not
                form in time (subclasses say which; see commctx.errors).
        """
        ctx = cls()
        if ctx._membership is not None or ctx.is_initialized():
            raise UsageError("CommContext is already initialised in this process; call destroy() first")
        # Arguments that cannot be right fail here, at the call: before any wait or network call.
        backend = resolve_backend(backend)
        check_seconds("timeout", timeout, "how long to wait for the world to form")
        check_seconds("collective_timeout", collective_timeout, "torch.distributed's timeout")
        check_count("local_rank", local_rank, "this worker's rank in its node", minimum=0, optional=True)
        check_count("node_rank", node_rank, "this node's rank", minimum=0, optional=True)
        if not isinstance(abort_on_change, bool):
            raise InvalidArgument(f"abort_on_change must be True or False, not {abort_on_change!r:.64}")
        launcher = LauncherEnv.from_env()
        share_host = share_host_of(share_host, launcher)
        progress_s = progress_seconds(progress_interval, launcher)
        if launcher.torchrun_world:  # torchrun --rdzv-backend=commctx: the agent joined for this worker
            check_count("world_size", world_size, "the number of workers in the job", optional=True)
            if on_world_changed is not None:
                raise UsageError("on_world_changed is not available under torchrun: its agent restarts the "
                                       "workers into the next world")
            try:
                ctx._membership = LaunchedWorker.from_launcher(
                    launcher, job_id=job_id, world_size=world_size, backend=backend,
                    collective_timeout_s=collective_timeout)
                ctx._membership.enter(ctx._registry)
            except BaseException:
                ctx.destroy()
                raise
            return ctx
        join = join_arguments(launcher, server_addr=server_addr, job_id=job_id, world_size=world_size,
                              node_key=node_key, local_rank=local_rank, node_rank=node_rank, role=role, spec=spec,
                              tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token, job_secret=job_secret)
        try:
            membership = ctx._membership = Membership.join(
                join.server_addr, join.request, advertise_addr=advertise_addr, backend=backend, timeout_s=timeout,
                collective_timeout_s=collective_timeout, tls=join.tls, token=join.token, progress_s=progress_s,
                abort_on_change=abort_on_change, share_host=share_host)
            if join.from_slurm:
                join.slurm.check(membership.assignment, join.from_slurm)
            if on_world_changed is not None:
                membership.session.on_world_changed(on_world_changed)
            membership.enter(ctx._registry, timeout)
        except BaseException:
            ctx.destroy()
            raise
        return ctx

    @property
    def assignment(self) -> Assignment | None:
        """What the rendezvous server assigned to this worker (None without a join)."""
        return self._membership.assignment if self._membership is not None else None

    # -- when the world changes ------------------------------------------------------

    @property
    def world_change(self) -> WorldChange | None:
        """The pending change of the world (the server is re-forming it), or None."""
        m = self._membership
        return m.session.world_change if m is not None and m.session is not None else None

    def wait_world_change(self, timeout: float | None = None) -> WorldChange | None:
        """Blocks until the server announces a change of the world (or `timeout`)."""
        return self._joined().session.wait_world_change(timeout)

    def rejoin(self, timeout: float = DEFAULT_JOIN_TIMEOUT_S) -> CommContext:
        """Moves this worker into the next generation of its world.

        Tears down the old process groups (in bounded time, even with dead
        peers), waits for the new assignment the server pushes, then
        initialises torch.distributed and builds the new groups. Ranks follow
        the server's rule: survivors keep their node and local ranks where
        possible.

        Raises:
            InvalidArgument: `timeout` is not a positive number of seconds.
            UsageError: this process did not join, or no change is pending.
            MemberNotFound: the server says this member is gone or the job
                cannot continue (the message says why).
            RendezvousTimeout: no new world within `timeout`.
        """
        check_seconds("timeout", timeout, "how long to wait for the next world")
        membership = self._joined()
        change = membership.session.world_change
        if change is None:
            raise UsageError("the world has not changed; rejoin() follows a world change")
        if change.final:
            raise MemberNotFound("NOT_FOUND", change.reason)
        membership.rejoin(self._registry, timeout)
        return self

    def _joined(self) -> Membership:
        if self._membership is None:
            raise UsageError("not a member of a job: this process did not join (use CommContext.join)")
        if self._membership.session is None:
            raise UsageError("this worker was started by torchrun --rdzv-backend=commctx: its agent holds the "
                                   "membership and restarts the workers into the next world")
        return self._membership

    # -- the seed API -----------------------------------------------------------------

    def is_initialized(self) -> bool:
        """True once the GLOBAL group exists."""
        return self._registry.initialized

    def init_distributed_env(
        self,
        world_size: int | None = None,
        rank: int | None = None,
        backend: str = "nccl",
        dist_url: str = "env://",
        timeout: int = 1800,
    ) -> None:
        """Initialises the default process group and registers it as GLOBAL.

        Args:
            world_size: Global world size (None: from the init method).
            rank: Global rank of this process (None: from the init method).
            backend: 'nccl', 'gloo', 'auto', or another backend of torch.distributed.Backend.
            dist_url: torch init method, e.g. 'env://' or 'tcp://host:port'.
            timeout: Timeout in seconds for initialisation and collectives (positive).

        Raises:
            InvalidArgument: a backend torch does not have, or a timeout that
                is not a positive number of seconds (before anything starts).
            UsageError: already initialised, or NCCL without a usable GPU.
        """
        if self.is_initialized():
            raise UsageError("torch.distributed is already initialised by CommContext; call destroy() first")
        backend = resolve_backend(backend)
        check_seconds("timeout", timeout, "torch.distributed's timeout")
        local_rank = self.get_in_node_rank() if backend == "nccl" else None
        self._registry.register(init_world(world_size, rank, backend, dist_url, datetime.timedelta(seconds=timeout), local_rank))

    def init_group(
        self,
        ranks: list[int],
        mode: Mode | None = None,
        backend: str = "nccl",
        use_cpu: bool = False,
    ) -> None:
        """Creates a group of `ranks` and registers it under `mode` on its members.

        As in torch's `new_group`, every rank of the world calls this, members
        or not, in the same order.

        Args:
            ranks: Global ranks in the group.
            mode: The name to register the group under (any CommMode,
                ParallelMode or non-empty string).
            backend: 'nccl', 'gloo' or 'auto'.
            use_cpu: Use gloo, for CPU tensors, whatever `backend` says.

        Raises:
            InvalidArgument: a backend torch does not have.
            UsageError: not initialised.
            ValueError: `mode` is missing, or `ranks` is empty, repeats a rank or
                names one outside the world.
        """
        check_backend(backend)
        key = mode_key(mode)
        world_size = self.get_world_size(GLOBAL)
        members = sorted({int(r) for r in ranks})
        if not members or len(members) != len(ranks):
            raise ValueError(f"ranks {list(ranks)!r} must be non-empty and without repeats")
        if members[0] < 0 or members[-1] >= world_size:
            raise ValueError(f"ranks {list(ranks)!r} must lie in 0..{world_size - 1}")
        group = dist.new_group(members, backend="gloo" if use_cpu else resolve_backend(backend))
        rank = self.get_global_rank()
        if rank in members:
            self._registry.register(GroupRecord(key, group, tuple(members), members.index(rank)))

    def get_group(self, comm_mode: Mode) -> dist.ProcessGroup:
        """The process group of `comm_mode` on this rank.

        Raises:
            GroupNotFound: this rank has no group of that mode.
        """
        return self._record(comm_mode).group

    def get_world_size(self, comm_mode: Mode) -> int:
        """The size of this rank's `comm_mode` group."""
        return self._record(comm_mode).size

    def get_local_rank(self, comm_mode: Mode) -> int:
        """This rank's position in its `comm_mode` group."""
        return self._record(comm_mode).group_rank

    def get_ranks_in_group(self, comm_mode: Mode) -> list[int]:
        """The global ranks of this rank's `comm_mode` group."""
        return list(self._record(comm_mode).ranks)

    def get_global_rank(self) -> int:
        """The global rank of this process.

        Raises:
            UsageError: not initialised.
        """
        return self._record(GLOBAL).group_rank

    def get_in_node_rank(self) -> int:
        """This worker's rank within its node: from the assignment when joined,
        else from LOCAL_RANK.

        Raises:
            UsageError: neither is available.
        """
        if self.assignment is not None:
            return self.assignment.local_rank
        value = LauncherEnv.from_env().local_rank
        if value is None:
            raise UsageError("local rank unknown: join a rendezvous or set LOCAL_RANK")
        return value

    def get_local_world_size(self) -> int:
        """Workers on this node: from the assignment when joined, else LOCAL_WORLD_SIZE.

        Raises:
            UsageError: neither is available.
        """
        if self.assignment is not None:
            return self.assignment.local_world_size
        value = LauncherEnv.from_env().local_world_size
        if value is None:
            raise UsageError("local world size unknown: join a rendezvous or set LOCAL_WORLD_SIZE")
        return value

    def get_intra_node_process_group(self) -> dist.ProcessGroup:
        """The group of the workers on this node."""
        return self.get_group(INTRA_NODE)

    def get_inter_node_process_group(self) -> dist.ProcessGroup:
        """The group of the workers with this local rank on every node."""
        return self.get_group(INTER_NODE)

    def is_main_rank(self) -> bool:
        """True on global rank 0."""
        return self.get_global_rank() == 0

    def destroy(self) -> None:
        """Leaves the job, destroys the process groups and resets the singleton.

        Finishes in bounded time even when peers are dead: there is no barrier.
        Safe to call more than once.
        """
        if self._membership is not None:
            self._membership.close(self._registry)
            self._membership = None
        elif self.is_initialized() and dist.is_initialized():
            destroy_all(DESTROY_TIMEOUT_S)
        self._registry.clear()
        with CommContext._instance_lock:
            if CommContext._instance is self:
                CommContext._instance = None

    def _record(self, comm_mode: Mode) -> GroupRecord:
        key = mode_key(comm_mode)
        record = self._registry.get(key)
        if record is not None:
            return record
        if not self.is_initialized():
            raise UsageError("CommContext is not initialised: call CommContext.join() or init_distributed_env()")
        raise GroupNotFound(
            f"rank {self._registry.get(GLOBAL).group_rank} has no {key} group; it has: {', '.join(self._registry.modes())}"
        )

    # -- the seed's attributes, as views of the registry --------------------------------

    @property
    def _groups(self) -> dict[str, dist.ProcessGroup]:
        return {r.mode: r.group for r in self._registry}

    @property
    def _local_ranks(self) -> dict[str, int]:
        return {r.mode: r.group_rank for r in self._registry}

    @property
    def _world_sizes(self) -> dict[str, int]:
        return {r.mode: r.size for r in self._registry}

    @property
    def _ranks_in_group(self) -> dict[str, list[int]]:
        return {r.mode: list(r.ranks) for r in self._registry}

    @property
    def _global_ranks(self) -> dict[str, int]:
        world = self._registry.get(GLOBAL)
        return {GLOBAL: world.group_rank} if world is not None else {}
