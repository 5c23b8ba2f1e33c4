"""Wiring: the grpc.aio server with the rendezvous, health and reflection
services, an optional health-only port, the metrics endpoint, the lease
reaper, and an orderly stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .servicer import RendezvousServicer
from .state import Rendezvous
from .store import Store
from .telemetry import Telemetry, event

log = logging.getLogger("commctx.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Rendezvous"].full_name


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class RendezvousServer:
    """A running server. Create with `start_server`; stop with `stop` (idempotent)."""

    def __init__(self) -> None:
        self.port = 0
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self.rendezvous: Rendezvous
        self.telemetry: Telemetry
        self._servers: list[grpc.aio.Server] = []
        self._servicer: RendezvousServicer | None = None
        self._health = health.aio.HealthServicer()
        self._reaper: asyncio.Task | None = None
        self._metrics: tuple | None = None
        self._store: Store | None = None
        self._stopped = False

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Drains: health NOT_SERVING (watchers see it), new joins refused with
        UNAVAILABLE, in-flight calls finish within `grace_s`; then the reaper and
        the metrics endpoint stop. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._servicer is not None:
            self._servicer.draining = True
        await self._health.enter_graceful_shutdown()
        await asyncio.gather(*(s.stop(grace_s) for s in self._servers))
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self._metrics is not None:
            httpd, thread = self._metrics
            httpd.shutdown()
            httpd.server_close()
            thread.join(5)
        if self._store is not None:
            self._store.close()


async def _reap(rendezvous: Rendezvous, expire_every_s: float) -> None:
    """Expires leases and forms elastic worlds whose last call has passed.

    One task for all jobs: 20 ticks a second check the last calls; leases are
    scanned every `expire_every_s` (at most a quarter of the TTL).
    """
    loop = asyncio.get_running_loop()
    next_expiry = loop.time()
    while True:
        await asyncio.sleep(0.05)
        rendezvous.tick()
        if loop.time() >= next_expiry:
            rendezvous.expire()  # each expiry is logged and counted through the events
            next_expiry = loop.time() + expire_every_s


def _grpc_server() -> grpc.aio.Server:
    return grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),  # a second server on the same port fails instead of sharing it
            # Clients ping every 30 s while a Join waits; allow it.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            # A whole job joins at once; gRPC core would cancel calls beyond 3,000 queued.
            ("grpc.server.max_pending_requests", 1 << 17),
            ("grpc.server.max_pending_requests_hard_limit", 1 << 18),
        ]
    )


def _listen(server: grpc.aio.Server, host: str, port: int) -> int:
    try:
        return server.add_insecure_port(host_port(host, port))
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {host_port(host, port)}: {exc}") from exc


async def start_server(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    lease_ttl_s: float = 10.0,
    health_port: int | None = None,
    metrics_port: int | None = None,
    store: Store | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RendezvousServer:
    """Starts a rendezvous server on host:port (port 0: any free port).

    Args:
        store: where state is kept (default: memory only). Jobs it holds are
            restored first, every lease with one more TTL of grace.
        health_port: also serve grpc.health.v1 alone on this port (0: any free
            port; None: not at all).
        metrics_port: serve Prometheus metrics over HTTP on this port (0: any
            free port; None: not at all).

    Raises:
        RuntimeError: an address could not be bound.
    """
    out = RendezvousServer()
    registry = prometheus_client.CollectorRegistry()
    out.telemetry = Telemetry(registry, lambda: out.rendezvous.stats())
    out.rendezvous = Rendezvous(lease_ttl_s=lease_ttl_s, clock=clock, events=out.telemetry, store=store)
    out._store = store
    if store is not None:
        restored = out.rendezvous.restore(grace_s=lease_ttl_s)
        if restored:
            event("restored", jobs=restored, grace_s=lease_ttl_s)
    out._servicer = RendezvousServicer(out.rendezvous, out.telemetry)

    server = _grpc_server()
    pb_grpc.add_RendezvousServicer_to_server(out._servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(out._health, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    out.port = _listen(server, host, port)
    out._servers.append(server)
    if health_port is not None:
        probe = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(out._health, probe)
        out.health_port = _listen(probe, host, health_port)
        out._servers.append(probe)
    for s in out._servers:
        await s.start()
    for name in ("", SERVICE_NAME):
        await out._health.set(name, health_pb2.HealthCheckResponse.SERVING)
    if metrics_port is not None:
        httpd, thread = prometheus_client.start_http_server(metrics_port, addr=host, registry=registry)
        out._metrics = (httpd, thread)
        out.metrics_port = httpd.server_port
    out._reaper = asyncio.create_task(_reap(out.rendezvous, min(lease_ttl_s / 4, 0.25)), name="lease-reaper")
    return out
