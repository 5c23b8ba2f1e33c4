"""Wiring: the grpc.aio server with the rendezvous, health and reflection
services, the lease reaper, and an orderly stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .servicer import RendezvousServicer
from .state import Rendezvous

log = logging.getLogger("commctx.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Rendezvous"].full_name


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class RendezvousServer:
    """A running server. Create with `start_server`; stop with `stop` (idempotent)."""

    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        rendezvous: Rendezvous,
        servicer: RendezvousServicer,
        health_servicer: health.aio.HealthServicer,
        reaper: asyncio.Task,
    ) -> None:
        self.port = port
        self.rendezvous = rendezvous
        self._server = server
        self._servicer = servicer
        self._health = health_servicer
        self._reaper = reaper
        self._stopped = False

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Drains: health NOT_SERVING, refuse new joins, finish in-flight calls
        within `grace_s`, then stop the reaper."""
        if self._stopped:
            return
        self._stopped = True
        self._servicer.draining = True
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
        self._reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reaper

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


async def _reap(rendezvous: Rendezvous, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        for job_id, member_id in rendezvous.expire():
            log.info("lease expired job=%s member=%s", job_id, member_id)


async def start_server(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    lease_ttl_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
) -> RendezvousServer:
    """Starts a rendezvous server on host:port (port 0: any free port).

    Raises:
        RuntimeError: the address could not be bound.
    """
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),  # a second server on the same port fails instead of sharing it
            # Clients ping every 30 s while a Join waits; allow it.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            # A whole job joins at once; gRPC core would cancel calls beyond 3,000 queued.
            ("grpc.server.max_pending_requests", 1 << 17),
            ("grpc.server.max_pending_requests_hard_limit", 1 << 18),
        ]
    )
    rendezvous = Rendezvous(lease_ttl_s=lease_ttl_s, clock=clock)
    servicer = RendezvousServicer(rendezvous)
    pb_grpc.add_RendezvousServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    try:
        bound = server.add_insecure_port(host_port(host, port))
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {host_port(host, port)}: {exc}") from exc
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reaper = asyncio.create_task(_reap(rendezvous, max(lease_ttl_s / 4, 0.05)), name="lease-reaper")
    return RendezvousServer(server, bound, rendezvous, servicer, health_servicer, reaper)
