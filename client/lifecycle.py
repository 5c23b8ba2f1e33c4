"""A worker's life in a job: join, enter each world, rejoin, leave.

`Membership` owns what that life holds besides the stream to the server: the
spare listening socket (a port the server may hand to this worker when it
becomes rank 0 of a world: no "bind port 0, close, hope" race), the TCPStore
this process serves while it is rank 0, and the launcher variables it
exported. The groups it builds go into the caller's GroupRegistry.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import MutableMapping

import torch.distributed as dist

from commctx.v1 import rendezvous_pb2 as pb

from . import _torch
from .addresses import server_addresses
from .assignment import Assignment
from .credentials import Tls
from .errors import UsageError
from .host import HostLink, host_worker
from .host_wire import link_paths
from .hub import HostJob
from .launcher import LauncherEnv
from .netif import advertised_address, interface_of, listen_on
from .progress import DEFAULT_EVERY_S
from .registry import GroupRegistry
from .session import Session
from .world import Peer, World, enter_world, kept_peers, leave_world

log = logging.getLogger("commctx")


class Membership:
    """What one worker holds as a member of a job, besides the stream to the
    server: its spare listening socket, the TCPStore it serves while rank 0,
    the world it is in, and the launcher variables it exported. It reaches the
    server through `session`: its own Session or, where the workers of a host
    share one member, the HostLink to the hub that holds the Session for them.
    Create with `Membership.join`.

    With `abort_on_change`, the thread that brings the news aborts the
    current world's process groups as soon as the server says members of it
    went without a Leave (a lease expired, a session closed), or this
    membership ended for another reason than its job finishing: a collective
    blocked on a dead or hung peer raises then instead of at torch's timeout
    (world.py says how)."""

    def __init__(self, session: Session | HostLink, address: str, backend: str, collective_timeout_s: int,
                 spare: socket.socket | None, env: MutableMapping[str, str], *, abort_on_change: bool = True,
                 keep: Peer = lambda peer: False) -> None:
        self.session = session
        self.address = address
        self.backend = backend
        self._timeout = datetime.timedelta(seconds=collective_timeout_s)
        self._spare: socket.socket | None = spare
        self._store: dist.TCPStore | None = None
        self._env = env
        self._env_saved: dict[str, str | None] = {}
        self._world: World | None = None
        self._keep = keep
        if abort_on_change:
            session.on_world_ended(self._world_ended)

    @classmethod
    def join(cls, server_addr: str, request: pb.JoinRequest, *, advertise_addr: str | None, backend: str,
             timeout_s: float, collective_timeout_s: int, env: MutableMapping[str, str] | None = None,
             progress_s: float = DEFAULT_EVERY_S, abort_on_change: bool = True, share_host: bool = False,
             tls: Tls | None = None, token: str | None = None) -> Membership:
        """Joins with `request` (job, spec, node and rank fields) and blocks until
        seated in a world. The address and spare port are filled in here. With
        `share_host`, the workers of this job and node key on this machine share
        one membership (host.py): this worker joins it through its host's hub.

        Raises:
            InvalidArgument: `server_addr` is not host:port, or the token is malformed.
            RendezvousError: the server refused the join or the world did not form in time.
        """
        started = time.monotonic()
        address = advertised_address(server_addr, advertise_addr, timeout_s)  # waits for a name that resolves late
        waited = time.monotonic() - started
        if waited > 0.1:  # the name came late: the join has what is left of its timeout
            timeout_s = max(0.1, round(timeout_s - waited, 1))
        env = os.environ if env is None else env
        keep = kept_peers(server_addresses(server_addr))
        if share_host:
            if tls is not None:
                tls.credentials()  # a TLS file that cannot be read fails here, in the worker that names it
            request.address = address
            worker = host_worker(request.role, request.local_rank if request.HasField("local_rank") else None, timeout_s)
            request.ClearField("role")
            request.ClearField("local_rank")
            local = HostLink(server_addr, HostJob(server_addr, request, tls, token),
                                 link_paths(server_addr, request.job_id, request.node_key), worker)
            try:
                local.join(timeout_s, progress_s)
            except BaseException:
                local.close(leave=False)
                raise
            return cls(local, address, backend, collective_timeout_s, None, env, abort_on_change=abort_on_change, keep=keep)
        session = Session(server_addr, tls, token)  # first: a TLS file that cannot be read fails before any socket is held
        try:
            spare = listen_on(address)
        except BaseException:
            session.close(leave=False)
            raise
        request.address = address
        request.master_port = spare.getsockname()[1]
        try:
            session.join(request, timeout_s, progress_s)
        except BaseException:
            spare.close()
            session.close(leave=False)
            raise
        return cls(session, address, backend, collective_timeout_s, spare, env, abort_on_change=abort_on_change, keep=keep)

    @property
    def assignment(self) -> Assignment:
        return self.session.assignment

    def _world_ended(self, before: float, reason: str) -> None:
        """The session's news: worlds older than generation `before` are over."""
        world = self._world
        if world is not None and world.generation < before:
            world.abort(reason)

    def enter(self, registry: GroupRegistry, timeout_s: float) -> None:
        """Initialises torch.distributed for the current assignment and registers its groups.

        A world that is aborted while it is being built (a peer went, or the
        next world formed meanwhile) is left for the next one, until
        `timeout_s` has passed.

        Raises:
            MemberNotFound: the member is gone or the job cannot continue.
            RendezvousTimeout: no world entered within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._enter(registry)
                return
            except Exception as exc:
                world = self._world
                if world is None or not world.aborted or time.monotonic() >= deadline:
                    raise
                log.warning("generation %d ended while its world was being built (%s: %s); taking the next",
                            world.generation, world.aborted, str(exc).splitlines()[0][:200])
            self.leave_world(registry)
            self.session.next_assignment(max(0.0, deadline - time.monotonic()))

    def _enter(self, registry: GroupRegistry) -> None:
        """Rank 0 serves the TCPStore on its spare socket, whose port the server
        gave out as the master port, then offers a new spare for later worlds."""
        a = self.session.assignment
        self._export_env(a)
        if a.rank == 0:
            hosted = isinstance(self.session, HostLink)  # the host's hub holds the spare and passed it on
            if hosted:
                spare = self.session.take_spare(a.generation, a.master_port)
            else:
                spare, self._spare = self._spare, None
            if spare is None or spare.getsockname()[1] != a.master_port:
                raise UsageError(f"the server made this worker rank 0 on port {a.master_port}, which it does not hold")
            self._store = _torch.store_on_socket(a.master_addr, a.master_port, a.world_size, self._timeout, spare)
            if not hosted:
                self._spare = listen_on(self.address)
                self.session.offer_spare(self._spare.getsockname()[1])
        self._world = World(a.generation, self._keep)  # before anything connects: an abort finds it
        enter_world(registry, a, self.backend, a.dist_url, self._timeout, world=self._world)
        log.info(
            "joined job=%s generation=%d rank=%d/%d node_rank=%d local_rank=%d master=%s",
            a.job_id, a.generation, a.rank, a.world_size, a.node_rank, a.local_rank, a.dist_url,
        )

    def rejoin(self, registry: GroupRegistry, timeout_s: float) -> None:
        """Leaves the current world and enters the next one the server assigns.

        Raises:
            MemberNotFound: the member is gone or the job cannot continue.
            RendezvousTimeout: no new world within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        self.leave_world(registry)
        self.session.next_assignment(timeout_s)
        self.enter(registry, max(0.0, deadline - time.monotonic()))

    def leave_world(self, registry: GroupRegistry) -> None:
        """Destroys the process groups (no barrier, bounded time) and forgets them."""
        world, self._world = self._world, None
        if world is not None:
            world.leave(registry)
        else:
            leave_world(registry)
        self._store = None

    def close(self, registry: GroupRegistry) -> None:
        """Leaves the job (best effort), the world, and restores the environment. Idempotent."""
        self.session.close()
        self.leave_world(registry)
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        for key, value in self._env_saved.items():
            if value is None:
                self._env.pop(key, None)
            else:
                self._env[key] = value
        self._env_saved.clear()

    def _export_env(self, a: Assignment) -> None:
        """Sets the variables torchrun would, and the interface gloo/NCCL should use."""
        values = a.torch_env()
        ifname = interface_of(self.address)
        launcher = LauncherEnv.from_env(self._env)
        ours = self._env_saved  # variables this membership set (and may set again)
        # gloo and NCCL pick the interface that carries our advertised address,
        # unless the user chose one. Without this, gloo resolves the hostname,
        # which in containers and namespaces often means 127.0.0.1.
        if ifname is not None:
            if launcher.gloo_socket_ifname is None or "GLOO_SOCKET_IFNAME" in ours:
                values["GLOO_SOCKET_IFNAME"] = ifname
            if self.backend == "nccl" and (launcher.nccl_socket_ifname is None or "NCCL_SOCKET_IFNAME" in ours):
                values["NCCL_SOCKET_IFNAME"] = ifname
        for key, value in values.items():
            self._env_saved.setdefault(key, self._env.get(key))
            self._env[key] = value
