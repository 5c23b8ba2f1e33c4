"""One generation's torch.distributed world on this worker: entered, aborted, left.

When the rendezvous server says that members of a world went without a
Leave (a lease expired: a hung process, a dead host; a session closed: a
killed process), a collective blocked on them must not wait out torch's
timeout (30 minutes by default). `World.abort` ends every collective of the
world at once, from any thread:

  * NCCL (and any backend but gloo): `ProcessGroup.abort()`, which aborts its
    communicators (ncclCommAbort);
  * gloo: its abort() does not interrupt a collective in flight (torch 2.13:
    a blocked all_reduce still waited out its timeout after abort() and
    shutdown()), so the TCP connections the world's process groups opened
    are shut down instead; the blocked send or receive fails at once with
    gloo's "Connection closed by peer".

Which connections: the TCP connections this process opened while the world
was being built (Linux's /proc/self/fd, compared before and after; nothing
elsewhere), less listening sockets and connections to the rendezvous server.
A connection another thread of the process opened in that window would be
shut down too. With gloo's lazy init (TORCH_GLOO_LAZY_INIT) its connections
open later and are not found: a blocked collective then waits for its timeout.

Members that left, and a world that only grows, abort nothing: their peers'
collectives complete, or fail at once on the connections a departing
worker's destroy closes (an abort would cut a peer still reading the last
bytes of a collective that would have completed).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable

import torch.distributed as dist

from .assignment import Assignment
from .process_groups import build_groups, destroy_all, init_world
from .registry import GroupRegistry

log = logging.getLogger("commctx")

DESTROY_TIMEOUT_S = 10.0

Peer = Callable[[tuple], bool]  # whether a connection to this peer address is to be kept


def _sockets() -> dict[int, str]:
    """This process's socket descriptors: fd -> 'socket:[inode]' ({} where /proc/self/fd is missing)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    out = {}
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (listdir's own descriptor among them)
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


def kept_peers(addresses: Iterable[tuple[str, int]]) -> Peer:
    """Matches connections to the rendezvous servers at `addresses` (host, port):
    their resolved IPs and port, or only the port where a name does not resolve."""
    ports, ips, unresolved = set(), set(), False
    for host, port in addresses:
        ports.add(port)
        try:
            ips.update(info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError:
            unresolved = True

    def keep(peer: tuple) -> bool:
        ip = peer[0].removeprefix("::ffff:")  # an IPv4 peer of a dual-stack socket
        return peer[1] in ports and (unresolved or ip in ips or peer[0] in ips)

    return keep


class World:
    """The process groups of one generation, and what `abort` needs to end their collectives."""

    def __init__(self, generation: int, keep: Peer) -> None:
        self.generation = generation
        self.aborted = ""  # why, once aborted
        self._keep = keep
        self._lock = threading.Lock()
        self._before = _sockets()
        self._opened: dict[int, str] | None = None  # None while the world is being built
        self._groups: list = []  # process groups that abort() ends themselves (not gloo)
        self._left = False

    def abort(self, why: str) -> bool:
        """Ends every collective of this world now (any thread; idempotent).
        While the world is still being built, its connections so far are shut
        down, and the rest as soon as it is built. Returns whether this call aborted it."""
        with self._lock:
            if self.aborted or self._left:
                return False
            self.aborted = why
            opened = self._opened if self._opened is not None else self._new_sockets()
            closed = self._shut_down(opened)
            for pg in self._groups:
                pg.abort()
        log.info("aborted the process groups of generation %d (%d connections shut down): %s", self.generation, closed, why)
        return True

    def _entered(self, registry: GroupRegistry) -> None:
        """Records what abort() needs, once the world is built (or failed to be)."""
        groups = {id(r.group): r.group for r in registry}
        with self._lock:
            self._opened = self._new_sockets()
            self._groups = [pg for pg in groups.values() if _backend(pg) not in ("gloo", None) and hasattr(pg, "abort")]
            if self.aborted:  # aborted while being built
                self._shut_down(self._opened)
                for pg in self._groups:
                    pg.abort()

    def _new_sockets(self) -> dict[int, str]:
        before = self._before
        return {fd: link for fd, link in _sockets().items() if before.get(fd) != link}

    def _shut_down(self, sockets: dict[int, str]) -> int:
        count = 0
        for fd, link in sockets.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != link:
                    continue  # closed, and the number reused since
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                        and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and not self._keep(sock.getpeername())):
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
            except OSError:  # not connected, or shut down already
                pass
            finally:
                sock.detach()  # the descriptor stays torch's
        return count

    def leave(self, registry: GroupRegistry) -> None:
        """Destroys the process groups (no barrier, bounded time) and forgets them."""
        with self._lock:
            self._left = True  # no abort from now on: its descriptors are being closed
        leave_world(registry)


def _backend(pg: object) -> str | None:
    try:
        return str(dist.get_backend(pg))
    except (RuntimeError, ValueError):
        return None


def enter_world(registry: GroupRegistry, a: Assignment, backend: str, init_method: str, timeout: datetime.timedelta,
                world: World | None = None) -> World:
    """Initialises torch.distributed through `init_method` and registers every
    group of `a`, into `world` (made before, so that an abort meanwhile finds
    it) or a new one."""
    world = world if world is not None else World(a.generation, lambda peer: False)
    try:
        registry.register(init_world(a.world_size, a.rank, backend, init_method, timeout, a.local_rank))
        for record in build_groups(a.groups, job_id=a.job_id, generation=a.generation, world_size=a.world_size,
                                   backend=backend, timeout=timeout):
            registry.register(record)
    finally:
        world._entered(registry)
    return world


def leave_world(registry: GroupRegistry) -> None:
    """Destroys the process groups (no barrier, bounded time) and forgets them."""
    if registry.initialized and dist.is_initialized() and not destroy_all(DESTROY_TIMEOUT_S):
        log.warning("destroying the process groups took over %.0f s; continuing without waiting", DESTROY_TIMEOUT_S)
    registry.clear()
