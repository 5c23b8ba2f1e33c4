"""A whole server, assembled: `start_server` wires the rendezvous (its state
machine, store and executor, served over gRPC by rpc/app.py), telemetry, the
HTTP port (web/) and GC pacing. The edges stand apart; this is where they meet."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable

import prometheus_client

from .gc_pacer import GcPacer
from .rendezvous.machine import Rendezvous
from .rendezvous.model import Limits
from .rendezvous.reports import Stats
from .rendezvous.store import MemoryStore, Store
from .rpc.app import RendezvousServer, ServerTls
from .telemetry import Telemetry
from .tokens import Callers


async def start_server(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    lease_ttl_s: float = 10.0,
    reconnect_grace_s: float = 1.0,
    health_port: int | None = None,
    http_port: int | None = None,
    store: Store | None = None,
    clock: Callable[[], float] = time.monotonic,
    pace_gc: bool = False,
    tls: ServerTls | None = None,
    callers: Callers | None = None,
    limits: Limits = Limits(),
    replica: Callable[[RendezvousServer], Awaitable[None]] | None = None,
) -> RendezvousServer:
    """Starts a rendezvous server on host:port (port 0: any free port).

    Args:
        reconnect_grace_s: how long a member whose session the client ended
            without a Leave (a killed process) keeps its seat for a new session
            (at most lease_ttl_s); then it is removed as an expired lease is.
        store: where state is kept (default: memory only). The server takes it
            over (fencing any earlier writer) and restores the jobs it holds,
            every lease with one more TTL of grace.
        health_port: also serve grpc.health.v1 alone on this port (0: any free
            port; None: not at all).
        http_port: serve HTTP on this port (0: any free port; None: not at
            all): the dashboard, the JSON API of jobs and events, and
            Prometheus metrics at /metrics (server/web).
        pace_gc: collect garbage on a timer instead of on allocation counts
            (gc_pacer.py); changes the whole process, so for a dedicated server.
        tls: serve the main port over TLS only (mutual TLS with a client CA);
            the health-only port stays plaintext for probes.
        callers: require one of these bearer tokens on every call but health.
        limits: how much the server holds at most (jobs, members, spec sizes, join waits).
        replica: for an HA replica (server/ha.py): runs for the server's life,
            calling `begin_term` when elected and `end_term` when not; the
            server then serves the rendezvous only between the two.

    Raises:
        ListenError: an address could not be bound.
        StoreError: the store cannot be used.
    """
    store = store if store is not None else MemoryStore()
    out = RendezvousServer(lease_ttl_s=lease_ttl_s, reconnect_grace_s=reconnect_grace_s, clock=clock, limits=limits,
                           callers=callers, store=store, ha=replica is not None)
    loop = asyncio.get_running_loop()
    idle = Rendezvous(lease_ttl_s=lease_ttl_s, clock=clock, limits=limits)  # what metrics show between terms

    loop_thread = threading.get_ident()

    async def snapshot() -> Stats:
        return now()

    def now() -> Stats:
        term = out.term
        if term is None:
            return idle.stats()
        return dataclasses.replace(term.machine.stats(), sessions=term.servicer.open_member_sessions)

    def stats() -> Stats:  # from another thread (the metrics thread), the loop takes the snapshot
        if threading.get_ident() == loop_thread:
            return now()
        return asyncio.run_coroutine_threadsafe(snapshot(), loop).result(timeout=5)

    registry = prometheus_client.CollectorRegistry()
    out.telemetry = Telemetry(registry, stats)
    await out.start(host, port, health_port, tls, replica)
    if http_port is not None:
        from .web import WebServer  # only a server with HTTP loads aiohttp

        out.web = WebServer(out, registry, callers)
        try:
            out.http_port = await out.web.start(host, http_port)
        except BaseException:
            await out.stop(0)
            raise
    out.own(out.telemetry.loop_lag.run(), "commctx-loop-lag")
    if pace_gc:
        out.own(GcPacer(out.telemetry.loop_lag).run(), "commctx-gc-pacer")
    return out
