"""The gRPC edge's server: the grpc.aio server with the rendezvous, health and
reflection services and an optional health-only port; the term that serves
the rendezvous (the state machine with its store, executor and servicer) and
the router that sends each call to it; the guard that answers undecodable
requests; TLS; and an orderly stop. server/startup.py assembles a whole server
around it (telemetry, the HTTP port, GC pacing)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from commctx.common.addresses import host_port
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from ..errors import NotLeader, Unavailable, UnknownToken
from ..rendezvous.executor import Executor, Waiters
from ..rendezvous.machine import Rendezvous
from ..rendezvous.model import Limits
from ..rendezvous.store import Fenced, MemoryStore, Store
from ..telemetry import Telemetry, event
from ..tokens import Callers
from .auth import TokenInterceptor
from .health import Health
from .servicer import RendezvousServicer
from .status import answer_error, error_status
from .undecodable import LimitedLog, Undecodable, tolerant
from .wire import pass_bytes

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
    """A running server. Create with `start_server` (server/startup.py); stop with `stop` (idempotent)."""

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
        self.web: Any = None  # the HTTP server (server/web), when on: start_server sets it, stop() stops it
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

    def serving(self) -> Term:
        """The term serving the rendezvous now.

        Raises:
            NotLeader: this server may not answer now (naming the leader when known).
        """
        term = self.term
        if term is None or not self.leading():
            raise self.not_leader()
        return term

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
                                      self.telemetry.session_ended,
                                      deposed=lambda: None if self.leading() and self.term is not None
                                      and self.term.servicer is servicer else self.not_leader())
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

    async def start(self, host: str, port: int, health_port: int | None = None, tls: ServerTls | None = None,
                    replica: Callable[[RendezvousServer], Awaitable[None]] | None = None) -> None:
        """Serves gRPC on host:port, and health alone on `health_port` (None: not
        at all): the rendezvous at once from the store's records, or, for an HA
        replica, between the terms `replica` begins and ends (start_server says more).

        Raises:
            ListenError: an address could not be bound.
            StoreError: the store cannot be used.
        """
        if replica is None:
            self.begin_term(self._store, self._store.take_over(), self._store.load())
        guards = [TokenInterceptor(self._callers, self.telemetry.rpc_error)] if self._callers is not None else []
        server = grpc_server([*guards, DecodeGuard(self.telemetry.rpc_error)], self._limits, self._lease_ttl_s)
        pb_grpc.add_RendezvousServicer_to_server(Router(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health.aio, server)
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        try:
            self.port = listen(server, host, port, tls)
            self._servers.append(server)
            if health_port is not None:
                probe = self._health.port()  # a sync server on threads of its own: its Checks never wait for the loop
                self.health_port = listen(probe, host, health_port)
                self._servers.append(probe)
        except BaseException:
            if self.term is not None:
                await self.term.executor.stop()
            raise
        for s in self._servers:
            await s.start()
        if replica is None:
            await self._set_health(SERVING)
        else:  # alive, but the rendezvous is served only once elected
            await self._health.set("", SERVING)
            await self._health.set(SERVICE_NAME, NOT_SERVING)
            self.own(replica(self), "commctx-replica")

    def own(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Runs `work` for the server's life: cancelled and awaited when it stops."""
        self._tasks.append(asyncio.create_task(work, name=name))

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
        if self.web is not None:
            await self.web.stop()
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
            status = error_status(self._server.not_leader())
            self._server.telemetry.rpc_error(method, status.code.name)
            answer_error(context, status)
            return None
        context.set_trailing_metadata(term.stamp)
        return term.servicer


def _routed(method: str) -> Callable:
    streams = pb.DESCRIPTOR.services_by_name["Rendezvous"].methods_by_name[method].server_streaming

    async def route(self: Router, request, context: grpc.aio.ServicerContext):
        term = self._server.term
        servicer = self._servicer(context, method)
        if servicer is None:
            return None
        answer = await getattr(servicer, method)(request, context)
        if not streams and (self._server.term is not term or not self._server.leading()):
            # Deposed while it worked (paused past its lease, say): its answer may rest on a state another
            # replica has moved on from (its timers fired on waking), so the caller asks the leader instead.
            status = error_status(self._server.not_leader())
            self._server.telemetry.rpc_error(method, status.code.name)
            answer_error(context, status)
            return None
        return answer

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
        self._log_line = LimitedLog()
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
        parse = tolerant(handler.request_deserializer, f"commctx.v1.{method}Request", self._log_line)
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(  # Session: assignments are written encoded
                handler.stream_stream, request_deserializer=parse, response_serializer=pass_bytes(handler.response_serializer))
        inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

        async def checked(request, context: grpc.aio.ServicerContext):
            if isinstance(request, Undecodable):
                status = error_status(request.error())
                self._rpc_error(method, status.code.name)
                answer_error(context, status)
                return None
            return await inner(request, context)

        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
        return make(checked, request_deserializer=parse,  # a Join's answer comes encoded (codec.join_slices)
                    response_serializer=pass_bytes(handler.response_serializer))


def grpc_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = (), limits: Limits = Limits(),
                lease_ttl_s: float = 10.0) -> grpc.aio.Server:
    return grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.so_reuseport", 0),  # a second server on the same port fails instead of sharing it
            # Clients ping a connection with nothing to read every 3 s (client/channels.py); allow it.
            ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
            # Reclaim what nobody uses: a peer that stops answering pings (gone
            # without a FIN: its host crashed or was cut off) within a ping
            # interval and a timeout (30 s with the default lease), its waiting
            # Join withdrawn before a world seats it; a connection with no call
            # for 10 min. The timeout is at least a lease, so that a paused
            # member is found by its lease, not its connection. gRPC core closes
            # on ping_timeout (default: a minute), not on the keepalive timeout,
            # so both are set: with 60 s / 20 s alone, a stopped client's Join
            # was held for 121 s.
            ("grpc.keepalive_time_ms", round(max(2 * lease_ttl_s, 20.0) * 1000)),
            ("grpc.keepalive_timeout_ms", round(max(lease_ttl_s, 10.0) * 1000)),
            ("grpc.http2.ping_timeout_ms", round(max(lease_ttl_s, 10.0) * 1000)),
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


def listen(server: grpc.aio.Server, host: str, port: int, tls: ServerTls | None = None) -> int:
    try:
        if tls is not None:
            return server.add_secure_port(host_port(host, port), tls.credentials())
        return server.add_insecure_port(host_port(host, port))
    except RuntimeError as exc:
        raise ListenError(f"cannot listen on {host_port(host, port)}: {exc}") from exc
