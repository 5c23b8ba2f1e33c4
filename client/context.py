"""CommContext: the seed API over the rendezvous server's assignment.

A process-wide singleton (`CommContext()` always returns the same object until
`destroy()` resets it). `CommContext.join(...)` joins a job on a rendezvous
server, initialises torch.distributed through the tcp:// URL it was given and
builds every group of the plan; `init_distributed_env(...)` still works alone,
as in the seed. CUDA is touched only when the backend is NCCL.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from google.protobuf import json_format

from commctx.v1 import rendezvous_pb2 as pb

from .assignment import Assignment
from .errors import CommContextError, GroupNotFound
from .groups import build_groups
from .modes import CommMode, Mode, mode_key
from .netif import interface_of, listen_socket, route_source_address
from .session import Session, WorldChange
from .transport import split_address

log = logging.getLogger("commctx")

DEFAULT_JOIN_TIMEOUT_S = 600.0
DESTROY_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class LauncherEnv:
    """What a launcher (torchrun, Slurm scripts, the user) put in the environment.

    The only place commctx reads environment variables.
    """

    local_rank: int | None = None
    local_world_size: int | None = None
    gloo_socket_ifname: str | None = None
    nccl_socket_ifname: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LauncherEnv:
        """Reads the launcher variables.

        Raises:
            CommContextError: LOCAL_RANK or LOCAL_WORLD_SIZE is set but not a
                non-negative integer.
        """
        env = os.environ if env is None else env

        def number(name: str) -> int | None:
            raw = env.get(name)
            if raw is None or raw == "":
                return None
            try:
                value = int(raw)
            except ValueError:
                value = -1
            if value < 0:
                raise CommContextError(f"{name}={raw!r} is not a non-negative integer")
            return value

        return cls(
            local_rank=number("LOCAL_RANK"),
            local_world_size=number("LOCAL_WORLD_SIZE"),
            gloo_socket_ifname=env.get("GLOO_SOCKET_IFNAME") or None,
            nccl_socket_ifname=env.get("NCCL_SOCKET_IFNAME") or None,
        )


def job_spec_of(spec: Mapping[str, Any] | pb.JobSpec | None, world_size: int) -> pb.JobSpec:
    """The wire JobSpec for `spec` (a message, its JSON form as a dict, or None).

    Raises:
        ValueError: the dict is not a JobSpec, or its world_size disagrees.
    """
    if spec is None:
        out = pb.JobSpec()
    elif isinstance(spec, pb.JobSpec):
        out = pb.JobSpec()
        out.CopyFrom(spec)
    else:
        try:
            out = json_format.ParseDict(dict(spec), pb.JobSpec())
        except json_format.ParseError as exc:
            raise ValueError(f"spec is not a JobSpec: {exc}") from exc
    if out.world_size and out.world_size != world_size:
        raise ValueError(f"spec.world_size {out.world_size} disagrees with world_size {world_size}")
    out.world_size = world_size
    return out


def resolve_backend(backend: str | None) -> str:
    """'auto' (or None) -> 'nccl' when CUDA is available, else 'gloo'.

    Raises:
        CommContextError: 'nccl' was asked for but no CUDA device is visible.
    """
    name = (backend or "auto").lower()
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise CommContextError("backend 'nccl' needs a CUDA device and none is visible; use 'gloo' or 'auto'")
    return name


class CommContext:
    """Singleton communication context for PyTorch distributed.

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
                instance._clear()
                cls._instance = instance
            return cls._instance

    def _clear(self) -> None:
        self._local_ranks: dict[str, int] = {}
        self._global_ranks: dict[str, int] = {}
        self._world_sizes: dict[str, int] = {}
        self._ranks_in_group: dict[str, list[int]] = {}
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._backend: str | None = None
        self._assignment: Assignment | None = None
        self._session: Session | None = None
        self._store: dist.TCPStore | None = None
        self._address = ""
        self._collective_timeout = 1800
        self._env_saved: dict[str, str | None] = {}

    # -- joining a rendezvous ------------------------------------------------------

    @classmethod
    def join(
        cls,
        server_addr: str,
        *,
        job_id: str,
        world_size: int,
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
    ) -> CommContext:
        """Joins `job_id` on the rendezvous server and returns the ready context.

        Blocks until `world_size` workers have joined, then initialises
        torch.distributed through the assigned tcp:// URL and builds the
        GLOBAL, INTRA_NODE and INTER_NODE groups and every group of `spec`.

        Args:
            server_addr: 'host:port' of the rendezvous server (port defaults to 50051).
            job_id: The job to join; workers with the same id form one world.
            world_size: Number of workers in the job.
            node_key: Identifies this worker's node; default: the hostname.
            local_rank: This worker's rank in its node, if the launcher knows it.
            node_rank: This node's rank, if the launcher knows it.
            role: This worker's role (e.g. "trainer"), for role-based groups.
            spec: The job's layout, roles and group rules, as the JobSpec
                message or its JSON form as a dict (see proto/commctx/v1);
                every worker of the job passes the same.
            advertise_addr: IP peers reach this worker on; default: the local
                address of the route to the server.
            backend: 'auto' (NCCL with CUDA, else gloo), 'nccl' or 'gloo'.
            timeout: Seconds to wait for the world to form.
            collective_timeout: torch.distributed timeout in seconds.
            on_world_changed: Called (from the session thread; keep it quick)
                when the server starts re-forming the world; see rejoin().

        Raises:
            CommContextError: this process is already initialised.
            RendezvousError: the server refused the join or the world did not
                form in time (subclasses say which; see commctx.errors).
        """
        ctx = cls()
        if ctx._session is not None or ctx.is_initialized():
            raise CommContextError("CommContext is already initialised in this process; call destroy() first")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, not {world_size!r}")
        backend = resolve_backend(backend)
        job_spec = job_spec_of(spec, world_size)
        host, port = split_address(server_addr)
        address = str(ipaddress.ip_address(advertise_addr or route_source_address(host, port)))
        sock = _listen_on(address)
        session = Session(server_addr)
        try:
            request = pb.JoinRequest(
                job_id=job_id,
                spec=job_spec,
                role=role or "",
                node_key=node_key or socket.gethostname(),
                address=address,
                master_port=sock.getsockname()[1],
                local_rank=local_rank,
                node_rank=node_rank,
            )
            a = session.join(request, timeout)
            ctx._session, ctx._address, ctx._backend, ctx._collective_timeout = session, address, backend, collective_timeout
            if on_world_changed is not None:
                session.on_world_changed(on_world_changed)
            ctx._enter_world(a, sock)
        except BaseException:
            sock.close()
            if ctx._session is None:
                session.close(leave=False)
            ctx.destroy()
            raise
        return ctx

    def _enter_world(self, a: Assignment, sock: socket.socket) -> None:
        """Initialises torch.distributed for assignment `a` and builds its groups.

        `sock` is the listening socket whose port this worker offered: rank 0
        serves the TCPStore on it; everyone else closes it.
        """
        self._assignment = a
        self._export_env(a, self._address, self._backend)
        if a.rank == 0:
            # Serve the job's store on the port this process has held since it
            # offered it; init_process_group(tcp://...) finds this server
            # through multi_tenant instead of binding a new one.
            self._store = dist.TCPStore(
                a.master_addr, a.master_port, a.world_size, True,
                timeout=datetime.timedelta(seconds=self._collective_timeout),
                wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.detach(),
            )
        sock.close()
        self.init_distributed_env(a.world_size, a.rank, self._backend, a.dist_url, self._collective_timeout)
        built = build_groups(
            a.groups, job_id=a.job_id, generation=a.generation, world_size=a.world_size, backend=self._backend,
            timeout=datetime.timedelta(seconds=self._collective_timeout),
        )
        for g in built:
            self._register(g.mode, g.group, list(g.ranks), g.group_rank)
        log.info(
            "joined job=%s generation=%d rank=%d/%d node_rank=%d local_rank=%d master=%s",
            a.job_id, a.generation, a.rank, a.world_size, a.node_rank, a.local_rank, a.dist_url,
        )

    # -- when the world changes ------------------------------------------------------

    @property
    def world_change(self) -> WorldChange | None:
        """The pending change of the world (the server is re-forming it), or None."""
        return self._session.world_change if self._session is not None else None

    def wait_world_change(self, timeout: float | None = None) -> WorldChange | None:
        """Blocks until the server announces a change of the world (or `timeout`)."""
        if self._session is None:
            raise CommContextError("no rendezvous session: this process did not join")
        return self._session.wait_world_change(timeout)

    def rejoin(self, timeout: float = DEFAULT_JOIN_TIMEOUT_S) -> CommContext:
        """Moves this worker into the next generation of its world.

        Tears down the old process groups (in bounded time, even with dead
        peers), offers a fresh listening port, waits for the new assignment
        the server pushes once every survivor is ready, then initialises
        torch.distributed and builds the new groups. Ranks follow the server's
        rule: survivors keep their node and local ranks where possible.

        Raises:
            CommContextError: this process did not join, or no change is pending.
            MemberNotFound: the server says this member is gone or the job
                cannot continue (the message says why).
            RendezvousTimeout: no new world within `timeout`.
        """
        session = self._session
        if session is None:
            raise CommContextError("rejoin() needs a context made by CommContext.join")
        if session.world_change is None:
            raise CommContextError("the world has not changed; rejoin() follows a world change")
        self._leave_world()
        sock = _listen_on(self._address)
        try:
            a = session.next_assignment(sock.getsockname()[1], timeout)
            self._enter_world(a, sock)
        except BaseException:
            sock.close()
            raise
        return self

    def _leave_world(self) -> None:
        """Destroys this context's process groups (no barrier) and forgets them."""
        if self.is_initialized() and dist.is_initialized():
            _destroy_process_group(DESTROY_TIMEOUT_S)
        self._store = None
        for table in (self._local_ranks, self._global_ranks, self._world_sizes, self._ranks_in_group, self._groups):
            table.clear()

    def _export_env(self, a: Assignment, address: str, backend: str, env: MutableMapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        values = a.torch_env()
        launcher = LauncherEnv.from_env(env)
        ifname = interface_of(address)
        # gloo and NCCL pick the interface that carries our advertised address,
        # unless the user chose one. Without this, gloo resolves the hostname,
        # which in containers and namespaces often means 127.0.0.1.
        if ifname is not None:
            if launcher.gloo_socket_ifname is None:
                values["GLOO_SOCKET_IFNAME"] = ifname
            if backend == "nccl" and launcher.nccl_socket_ifname is None:
                values["NCCL_SOCKET_IFNAME"] = ifname
        for key, value in values.items():
            self._env_saved.setdefault(key, env.get(key))
            env[key] = value

    def _restore_env(self) -> None:
        for key, value in self._env_saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._env_saved.clear()

    @property
    def assignment(self) -> Assignment | None:
        """What the rendezvous server assigned to this worker (None without a join)."""
        return self._assignment

    # -- the seed API -----------------------------------------------------------------

    def is_initialized(self) -> bool:
        """True once the GLOBAL group exists."""
        return CommMode.GLOBAL.value in self._groups

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
            backend: 'nccl', 'gloo' or 'auto'.
            dist_url: torch init method, e.g. 'env://' or 'tcp://host:port'.
            timeout: Timeout in seconds for initialisation and collectives.

        Raises:
            CommContextError: already initialised, or NCCL without a usable GPU.
        """
        if self.is_initialized():
            raise CommContextError("torch.distributed is already initialised by CommContext; call destroy() first")
        backend = resolve_backend(backend)
        if backend == "nccl":
            self._set_cuda_device()
        dist.init_process_group(
            backend=backend,
            init_method=dist_url,
            world_size=-1 if world_size is None else world_size,
            rank=-1 if rank is None else rank,
            timeout=datetime.timedelta(seconds=timeout),
        )
        self._backend = backend
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self._global_ranks[CommMode.GLOBAL.value] = rank
        self._register(CommMode.GLOBAL.value, dist.group.WORLD, list(range(world_size)), rank)

    def _set_cuda_device(self) -> None:
        local_rank = self.get_in_node_rank()
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise CommContextError(f"local rank {local_rank} has no GPU of its own: this node has {count}")
        torch.cuda.set_device(local_rank)

    def _register(self, mode: str, group: dist.ProcessGroup, ranks: list[int], group_rank: int) -> None:
        self._local_ranks[mode] = group_rank
        self._world_sizes[mode] = len(ranks)
        self._groups[mode] = group
        self._ranks_in_group[mode] = ranks

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
            CommContextError: not initialised.
            ValueError: `mode` is missing, or `ranks` is empty, repeats a rank or
                names one outside the world.
        """
        key = mode_key(mode)
        world_size = self.get_world_size(CommMode.GLOBAL)
        members = sorted({int(r) for r in ranks})
        if not members or len(members) != len(ranks):
            raise ValueError(f"ranks {list(ranks)!r} must be non-empty and without repeats")
        if members[0] < 0 or members[-1] >= world_size:
            raise ValueError(f"ranks {list(ranks)!r} must lie in 0..{world_size - 1}")
        group = dist.new_group(members, backend="gloo" if use_cpu else resolve_backend(backend))
        rank = self.get_global_rank()
        if rank in members:
            self._register(key, group, members, members.index(rank))

    def get_group(self, comm_mode: Mode) -> dist.ProcessGroup:
        """The process group of `comm_mode` on this rank.

        Raises:
            GroupNotFound: this rank has no group of that mode.
        """
        return self._lookup(self._groups, comm_mode)

    def get_world_size(self, comm_mode: Mode) -> int:
        """The size of this rank's `comm_mode` group."""
        return self._lookup(self._world_sizes, comm_mode)

    def get_local_rank(self, comm_mode: Mode) -> int:
        """This rank's position in its `comm_mode` group."""
        return self._lookup(self._local_ranks, comm_mode)

    def get_ranks_in_group(self, comm_mode: Mode) -> list[int]:
        """The global ranks of this rank's `comm_mode` group."""
        return list(self._lookup(self._ranks_in_group, comm_mode))

    def get_global_rank(self) -> int:
        """The global rank of this process.

        Raises:
            CommContextError: not initialised.
        """
        if not self.is_initialized():
            raise CommContextError("CommContext is not initialised: call CommContext.join() or init_distributed_env()")
        return self._global_ranks[CommMode.GLOBAL.value]

    def get_in_node_rank(self) -> int:
        """This worker's rank within its node: from the assignment when joined,
        else from LOCAL_RANK.

        Raises:
            CommContextError: neither is available.
        """
        if self._assignment is not None:
            return self._assignment.local_rank
        value = LauncherEnv.from_env().local_rank
        if value is None:
            raise CommContextError("local rank unknown: join a rendezvous or set LOCAL_RANK")
        return value

    def get_local_world_size(self) -> int:
        """Workers on this node: from the assignment when joined, else LOCAL_WORLD_SIZE.

        Raises:
            CommContextError: neither is available.
        """
        if self._assignment is not None:
            return self._assignment.local_world_size
        value = LauncherEnv.from_env().local_world_size
        if value is None:
            raise CommContextError("local world size unknown: join a rendezvous or set LOCAL_WORLD_SIZE")
        return value

    def get_intra_node_process_group(self) -> dist.ProcessGroup:
        """The group of the workers on this node."""
        return self.get_group(CommMode.INTRA_NODE)

    def get_inter_node_process_group(self) -> dist.ProcessGroup:
        """The group of the workers with this local rank on every node."""
        return self.get_group(CommMode.INTER_NODE)

    def is_main_rank(self) -> bool:
        """True on global rank 0."""
        return self.get_global_rank() == 0

    def destroy(self) -> None:
        """Leaves the job, destroys the process groups and resets the singleton.

        Finishes in bounded time even when peers are dead: there is no barrier.
        Safe to call more than once.
        """
        if self._session is not None:
            self._session.close()
        self._leave_world()
        self._restore_env()
        self._clear()
        with CommContext._instance_lock:
            if CommContext._instance is self:
                CommContext._instance = None

    def _lookup(self, table: dict[str, Any], comm_mode: Mode) -> Any:
        key = mode_key(comm_mode)
        try:
            return table[key]
        except KeyError:
            if not self.is_initialized():
                raise CommContextError(
                    "CommContext is not initialised: call CommContext.join() or init_distributed_env()"
                ) from None
            raise GroupNotFound(
                f"rank {self._global_ranks.get(CommMode.GLOBAL.value)} has no {key} group; "
                f"it has: {', '.join(self._groups) or 'none'}"
            ) from None


def _listen_on(address: str) -> socket.socket:
    try:
        return listen_socket(address)
    except OSError:  # an address that is not on a local interface (NAT): listen everywhere
        return listen_socket("::" if ":" in address else "0.0.0.0")


def _destroy_process_group(timeout_s: float) -> None:
    """Destroys every process group; gives up waiting after `timeout_s`.

    NCCL can block in destroy while a peer is dead, so it is aborted instead.
    """
    if dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
        target = dist.distributed_c10d._abort_process_group
    else:
        target = dist.destroy_process_group
    worker = threading.Thread(target=target, name="commctx-destroy", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        log.warning("destroying the process groups took over %.0f s; continuing without waiting", timeout_s)
