"""Wiring: the grpc.aio server with the rendezvous, health and reflection
services, an optional health-only port, the HTTP server (dashboard, JSON API,
metrics: server/web), the state machine with its store and executor, and an
orderly stop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from commctx.common.addresses import host_port
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from ..errors import NotLeader, Unavailable, UnknownToken
from ..gc_pacer import GcPacer
from ..rendezvous.executor import Executor, Waiters
from ..rendezvous.machine import Rendezvous
from ..rendezvous.model import Limits
from ..rendezvous.reports import Stats
from ..rendezvous.store import Fenced, MemoryStore, Store
from ..telemetry import Telemetry, event
from . import codec
from .auth import Callers, TokenInterceptor
from .health import Health
from .servicer import RendezvousServicer

log = logging.getLogger("commctx.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Rendezvous"].full_name
RENDEZVOUS_METHODS = frozenset(f"/{SERVICE_NAME}/{m.name}" for m in pb.DESCRIPTOR.services_by_name["Rendezvous"].methods)
EPOCH_KEY = "commctx-epoch"  # trailing metadata: the epoch of the leader that answered
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclasses.dataclass
class Term:
    """What serves the rendezvous while this server leads: the state machine,
    its executor and waiters, and the servicer over them. A single server has
    one term for its life; an HA replica one per leadership."""

    machine: Rendezvous
    waiters: Waiters
    executor: Executor
    servicer: RendezvousServicer
    epoch: int

    @functools.cached_property
    def stamp(self) -> tuple[tuple[str, str], ...]:
        """The trailing metadata of every answer of this term: the writer's epoch (the fencing token)."""
        return ((EPOCH_KEY, str(self.epoch)),)


class RendezvousServer:
    """A running server. Create with `start_server`; stop with `stop` (idempotent)."""

    def __init__(self, *, lease_ttl_s: float = 10.0, reconnect_grace_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, limits: Limits = Limits(), callers: Callers | None = None,
                 store: Store | None = None, ha: bool = False) -> None:
        self.port = 0
        self.health_port: int | None = None
        self.http_port: int | None = None  # the dashboard, JSON API and /metrics
        self.telemetry: Telemetry
        self.term: Term | None = None  # None: not leading (an HA replica following, or between terms)
        self.leader = ""  # the leader's address, as a replica that does not lead knows it
        # Whether this server may answer now: an HA replica, only while sure of its
        # election lease (a leader frozen past it must not answer from stale state).
        self.leading: Callable[[], bool] = lambda: True
        # Set when another server took over the store: this one must stop.
        self.deposed = asyncio.Event()
        self._servers: list[grpc.aio.Server] = []
        self._health = Health(SERVICE_NAME, lambda: self.term is not None and self.leading())  # both ports' servicers
        self._tasks: list[asyncio.Task] = []
        self._web = None  # the HTTP server (server/web), when on
        self._store: Store = store if store is not None else MemoryStore()
        self._stopped = False
        self._lease_ttl_s = lease_ttl_s
        self._reconnect_grace_s = reconnect_grace_s
        self._clock = clock
        self._limits = limits
        self._callers = callers
        self._ha = ha

    @property
    def machine(self) -> Rendezvous:
        return self._current().machine

    @property
    def limits(self) -> Limits:
        """What the server holds at most (every term's machine has these)."""
        return self._limits

    @property
    def executor(self) -> Executor:
        return self._current().executor

    @property
    def servicer(self) -> RendezvousServicer:
        return self._current().servicer

    def _current(self) -> Term:
        if self.term is None:
            raise RuntimeError("this server does not lead now")
        return self.term

    def begin_term(self, store: Store, epoch: int, records: list) -> None:
        """Serves the rendezvous from `records` (the store's content), writing
        as `epoch`; every lease restored gets one TTL of grace."""
        machine = Rendezvous(lease_ttl_s=self._lease_ttl_s, reconnect_grace_s=self._reconnect_grace_s, clock=self._clock,
                             limits=self._limits)
        restored, actions = machine.restore(records, grace_s=self._lease_ttl_s)
        if restored:
            event("restored", jobs=restored, grace_s=self._lease_ttl_s)
        waiters = Waiters()
        executor = Executor(machine, store, epoch, waiters, self.telemetry.record,
                            on_store_error=self._store_error, on_fenced=self._fenced)
        executor.start()
        executor.submit(actions)
        servicer = RendezvousServicer(machine, executor, waiters, self.telemetry.rpc_error, self._callers,
                                      self.telemetry.session_ended)
        self.term, self.leader = Term(machine, waiters, executor, servicer, epoch), ""
        self._tasks.append(asyncio.ensure_future(self._set_health(SERVING)))

    async def end_term(self, leader: str = "") -> None:
        """Stops serving the rendezvous at once (an HA replica that lost its
        lease or its store): calls in flight, waiting Joins and open sessions
        are answered UNAVAILABLE/NOT_LEADER, naming `leader` if known."""
        term, self.term, self.leader = self.term, None, leader
        await self._set_health(NOT_SERVING, only_service=True)
        if term is None:
            return
        error = self.not_leader()
        term.servicer.close(error)
        await term.executor.abandon(error)

    def revoke_tokens(self) -> int:
        """Ends, UNAUTHENTICATED, every call in flight whose token the (reloaded)
        token file no longer holds: sessions, waiting Joins (their members are
        withdrawn, as on a cancelled Join) and event watches. Returns how many."""
        if self._callers is None or self.term is None:
            return 0
        return self.term.machine.shares.live.revoke(self._callers.knows, UnknownToken(
            "this call's token is no longer accepted: the server's --auth-tokens file no longer holds it"))

    def not_leader(self) -> NotLeader:
        if self.leader:
            return NotLeader(f"this replica does not serve the rendezvous; the leader is {self.leader}", self.leader)
        return NotLeader("this replica does not serve the rendezvous and knows no leader yet (an election is under way); retry")

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Drains: health NOT_SERVING (watchers see it), new joins refused with
        UNAVAILABLE, in-flight calls finish within `grace_s`; then the executor
        carries out what is queued, background tasks and the metrics endpoint
        stop, and the store closes. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.term is not None:
            self.term.machine.draining = True
        await self._health.enter_graceful_shutdown()
        await asyncio.gather(*(s.stop(grace_s) for s in self._servers))
        if self.term is not None:
            self.term.servicer.close(Unavailable("the server stopped"))
            await self.term.executor.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._web is not None:
            await self._web.stop()
        await asyncio.to_thread(self._store.close)
        self.telemetry.close()

    async def _set_health(self, status: int, only_service: bool = False) -> None:
        if not self._stopped:
            for name in (SERVICE_NAME,) if only_service or self._ha else ("", SERVICE_NAME):
                await self._health.set(name, status)

    def _store_error(self, exc: Exception | None) -> None:
        # While the store refuses writes nothing new is announced: tell probes.
        self._tasks.append(asyncio.ensure_future(self._set_health(NOT_SERVING if exc is not None else SERVING)))

    def _fenced(self, exc: Fenced) -> None:
        if self._ha:  # another replica leads: stop serving, and campaign again
            self._tasks.append(asyncio.ensure_future(self.end_term()))
            self.deposed.set()
            return
        if self.term is not None:
            self.term.machine.draining = True
        self._tasks.append(asyncio.ensure_future(self._set_health(NOT_SERVING)))
        self.deposed.set()


class Router(pb_grpc.RendezvousServicer):
    """commctx.v1.Rendezvous as registered with gRPC: each call goes to the
    current term's servicer, or is answered UNAVAILABLE (NOT_LEADER, with the
    leader's address when known) while this server does not lead."""

    def __init__(self, server: RendezvousServer) -> None:
        self._server = server

    def _servicer(self, context: grpc.aio.ServicerContext, method: str) -> RendezvousServicer | None:
        """The term's servicer, its epoch set as the answer's trailing metadata (an error answer
        replaces it); None once the call is answered NOT_LEADER (return None then)."""
        term = self._server.term
        if term is None or not self._server.leading():
            status = codec.error_status(self._server.not_leader())
            self._server.telemetry.rpc_error(method, status.code.name)
            codec.answer_error(context, status)
            return None
        context.set_trailing_metadata(term.stamp)
        return term.servicer


def _routed(method: str) -> Callable:
    async def route(self: Router, request, context: grpc.aio.ServicerContext):
        servicer = self._servicer(context, method)
        return None if servicer is None else await getattr(servicer, method)(request, context)

    route.__name__ = route.__qualname__ = method
    return route


for _method in pb.DESCRIPTOR.services_by_name["Rendezvous"].methods_by_name:  # every RPC, the same way
    setattr(Router, _method, _routed(_method))


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Requests to commctx.v1.Rendezvous whose bytes do not parse are answered
    INVALID_ARGUMENT (unary calls here; Session's reads in the servicer),
    with at most one log line a minute, instead of UNKNOWN and a traceback each."""

    def __init__(self, rpc_error: Callable[[str, str], None]) -> None:
        self._rpc_error = rpc_error
        self._log_line = codec.LimitedLog()
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        wrapped = self._wrapped.get(details.method)  # built once per method, not per call
        if wrapped is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or details.method not in RENDEZVOUS_METHODS:
            return handler  # health, reflection, unknown names: as they are (and nothing cached for them)
        wrapped = self._wrapped[details.method] = self._wrap(details.method, handler)
        return wrapped

    def _wrap(self, path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        method = path.rsplit("/", 1)[-1]
        parse = codec.tolerant(handler.request_deserializer, f"commctx.v1.{method}Request", self._log_line)
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(  # Session: assignments are written encoded
                handler.stream_stream, request_deserializer=parse, response_serializer=codec.pass_bytes(handler.response_serializer))
        inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

        async def checked(request, context: grpc.aio.ServicerContext):
            if isinstance(request, codec.Undecodable):
                status = codec.error_status(request.error())
                self._rpc_error(method, status.code.name)
                codec.answer_error(context, status)
                return None
            return await inner(request, context)

        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
        return make(checked, request_deserializer=parse,  # a Join's answer may come encoded (codec.join_answer)
                    response_serializer=codec.pass_bytes(handler.response_serializer))


def _grpc_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = (), limits: Limits = Limits()) -> grpc.aio.Server:
    return grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.so_reuseport", 0),  # a second server on the same port fails instead of sharing it
            # Clients ping every 30 s while a Join waits; allow it.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            # Reclaim what nobody uses: a peer that stops answering pings (gone
            # without a FIN) within 80 s; a connection with no call for 10 min.
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.max_connection_idle_ms", 600_000),
            # No connection lives for ever (its open calls get the longest Join wait to end).
            ("grpc.max_connection_age_ms", round(limits.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", round((limits.max_join_wait_s + 1) * 1000)),
            # A whole job joins at once; gRPC core would cancel calls beyond 3,000 queued.
            ("grpc.server.max_pending_requests", 1 << 17),
            ("grpc.server.max_pending_requests_hard_limit", 1 << 18),
        ]
    )


@dataclasses.dataclass(frozen=True)
class ServerTls:
    """The main port's TLS, as PEM bytes: certificate chain, key, and the CA
    bundle client certificates must chain to (None: no client certificates)."""

    cert_chain: bytes
    key: bytes
    client_ca: bytes | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert_chain)], root_certificates=self.client_ca, require_client_auth=self.client_ca is not None)


class ListenError(RuntimeError):
    """A port the server cannot bind."""


def _listen(server: grpc.aio.Server, host: str, port: int, tls: ServerTls | None = None) -> int:
    try:
        if tls is not None:
            return server.add_secure_port(host_port(host, port), tls.credentials())
        return server.add_insecure_port(host_port(host, port))
    except RuntimeError as exc:
        raise ListenError(f"cannot listen on {host_port(host, port)}: {exc}") from exc


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
    if replica is None:
        out.begin_term(store, store.take_over(), store.load())

    guards = [TokenInterceptor(callers, out.telemetry.rpc_error)] if callers is not None else []
    server = _grpc_server([*guards, DecodeGuard(out.telemetry.rpc_error)], limits)
    pb_grpc.add_RendezvousServicer_to_server(Router(out), server)
    health_pb2_grpc.add_HealthServicer_to_server(out._health.aio, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        out.port = _listen(server, host, port, tls)
        out._servers.append(server)
        if health_port is not None:
            probe = out._health.port()  # a sync server on threads of its own: its Checks never wait for the loop
            out.health_port = _listen(probe, host, health_port)
            out._servers.append(probe)
    except BaseException:
        if out.term is not None:
            await out.term.executor.stop()
        raise
    for s in out._servers:
        await s.start()
    if replica is None:
        await out._set_health(SERVING)
    else:  # alive, but the rendezvous is served only once elected
        await out._health.set("", SERVING)
        await out._health.set(SERVICE_NAME, NOT_SERVING)
        out._tasks.append(asyncio.create_task(replica(out), name="commctx-replica"))
    if http_port is not None:
        from ..web import WebServer  # only a server with HTTP loads aiohttp

        out._web = WebServer(out, registry, callers)
        try:
            out.http_port = await out._web.start(host, http_port)
        except BaseException:
            await out.stop(0)
            raise
    out._tasks.append(asyncio.create_task(out.telemetry.loop_lag.run(), name="commctx-loop-lag"))
    if pace_gc:
        out._tasks.append(asyncio.create_task(GcPacer(out.telemetry.loop_lag).run(), name="commctx-gc-pacer"))
    return out
