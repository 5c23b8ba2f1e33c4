"""The HTTP edge: one aiohttp server on the rendezvous server's event loop
(no thread per connection) serving Prometheus `/metrics`, a JSON API of the
jobs and their events, and a live dashboard whose assets ship in the package
(`assets/`: no CDN, clusters are often offline).

    GET /                                      the dashboard: every job, paged
    GET /jobs/<job_id>                         a job: its nodes x local ranks, groups, who is missing, its events
    GET /static/<asset>                        the pages' script and style
    GET /metrics                               Prometheus metrics (open, as the gRPC health service is)
    GET /api/v1/server                         whether the API needs a token, whether this replica leads, whether
                                               the server is open to the network without authentication (no job data)
    GET /api/v1/jobs?page_size=&page_token=    {"jobs": [...], "next_page_token": ...}
    GET /api/v1/jobs/<job_id>?node_page_size=&node_page_token=
    GET /api/v1/jobs/<job_id>/events?after=&page_size=
    GET /api/v1/jobs/<job_id>/events/stream?after=   server-sent events, live (Last-Event-ID resumes)

Access: with --auth-tokens every /api path needs an admin token
(`Authorization: Bearer <token>`; the pages keep one typed into them for the
tab and send it so); without, 401. A sealed job shows only its id and state,
and its page nothing, to anyone without an admin token (so, without
--auth-tokens, to everyone). The pages and /metrics hold no job data beyond
the counts in metrics, and need no token.

With --tls-client-ca and no --auth-tokens, the JSON API of jobs is closed
(403): client certificates guard the gRPC port, and plain HTTP cannot check
them; /metrics, /api/v1/server and the pages (no job data) stay open.

The port is shared fairly (docs/guides/security.md, "The HTTP port"): caps
on connections, all peers' and one peer's, and timeouts for idle and slow
ones (connections.py: --http-max-connections, --http-peer-connections,
--http-idle-timeout-s, --http-header-timeout-s, which commctx-server sets on
`WebServer.connections`). An event stream counts against its caller's share of
--max-streams, as gRPC's WatchEvents does (429 beyond it); one that falls
Watchers.QUEUE events behind its reader is ended. Every method and path
answers JSON: 405 with Allow, 404. Nothing is logged per request above DEBUG
(a client's malformed request included); an unexpected error is one line
without a traceback, which the server's log limit (server/main.py LogLimit)
holds to a few a minute.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import logging
import math
from typing import TYPE_CHECKING, Any, Protocol

import prometheus_client
from aiohttp import web

from commctx.common.planning import expand

from ..errors import LimitExceeded, NotFound, NotLeader, Refusal, Sealed
from ..rendezvous.model import JobEvent, Limits
from ..rendezvous.params import check_job_id
from ..rendezvous.reports import JobView
from ..rendezvous.shares import TOKEN, Caller
from ..rendezvous.views import MAX_NODE_PAGE_SIZE, MAX_PAGE_SIZE, NODE_PAGE_SIZE, PAGE_SIZE, page_key
from ..rendezvous.watching import JOB_GONE, TooSlow
from ..tokens import ADMIN, Callers
from .connections import AiohttpLog, Connections, peer_ip, short

if TYPE_CHECKING:
    from ..rendezvous.executor import Executor
    from ..rendezvous.machine import Rendezvous

GROUP_EXAMPLES = 8  # groups listed per mode (the rest counted)
ASSETS = {"app.js": "application/javascript", "style.css": "text/css"}
log = logging.getLogger("commctx.server")


class ServedTerm(Protocol):
    """A term of the server the HTTP port serves beside: its state machine and executor."""

    machine: Rendezvous
    executor: Executor


class Served(Protocol):
    """What the HTTP port reads of the server it serves beside (rpc/app.py
    RendezvousServer): whether it leads, and the term that serves now."""

    leader: str  # the leader's address, as a replica that does not lead knows it
    term: ServedTerm | None  # None: not leading

    @property
    def limits(self) -> Limits: ...

    def serving(self) -> ServedTerm:
        """The term serving now. Raises NotLeader when the server may not answer."""
        ...


class WebServer:
    """The HTTP server of a RendezvousServer. `start()`, then `stop()` (idempotent)."""

    # The defaults of --http-max-connections, --http-peer-connections, --http-idle-timeout-s and
    # --http-header-timeout-s (server/config.py), which commctx-server sets on `connections`.
    MAX_CONNECTIONS = 1000  # all peers together
    PEER_CONNECTIONS = 32  # one peer address: well below MAX_CONNECTIONS, so one peer never holds the port
    IDLE_S = 15.0  # no byte of a request this long after opening or after the last answer: closed
    HEADER_S = 10.0  # a request's line and headers complete this long after their first byte, else closed
    HEARTBEAT_S = 15.0  # an event stream's keep-alive comment, inside proxies' idle timeouts

    def __init__(self, server: Served, registry: prometheus_client.CollectorRegistry, callers: Callers | None) -> None:
        self._server = server
        self._registry = registry
        self._callers = callers
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._streams: set[asyncio.Task] = set()
        assets = importlib.resources.files(__package__) / "assets"
        self._pages = {name: (assets / name).read_bytes() for name in ("index.html", "job.html", *ASSETS)}
        self.port = 0
        self.connections = Connections(registry, self.MAX_CONNECTIONS, self.PEER_CONNECTIONS, self.IDLE_S, self.HEADER_S)
        self.client_certs = False  # set by commctx-server: the gRPC port requires client certificates
        # Set by commctx-server (server/main.py `exposure`): it serves beyond loopback and
        # calls need no credential; the start-up warnings, which the pages show as a banner.
        self.open_to_network = False
        self.warnings: tuple[str, ...] = ()

    # -- serving -----------------------------------------------------------------------

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: a free port) and returns the port.

        Raises:
            OSError: the port cannot be bound.
        """
        app = web.Application(middlewares=[self._headers])
        app.router.add_get("/", self._page("index.html"))
        app.router.add_get("/jobs/{job_id}", self._page("job.html"))
        app.router.add_get("/static/{name}", self._asset)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/api/v1/server", self._about)
        app.router.add_get("/api/v1/jobs", self._jobs)
        app.router.add_get("/api/v1/jobs/{job_id}", self._job)
        app.router.add_get("/api/v1/jobs/{job_id}/events", self._events)
        app.router.add_get("/api/v1/jobs/{job_id}/events/stream", self._stream)
        # Idle and slow connections are closed by self.connections' timers; aiohttp's own keep-alive is a backstop.
        # A handler is cancelled when its connection is lost: an event stream gives its share back at once.
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=3600, handle_signals=False,
                                     handler_cancellation=True, logger=AiohttpLog())
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(self.connections.protocol(self._runner.server), host or None, port,
                                                  reuse_address=True)
        self.port = self._listener.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        for task in self._streams:
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _headers(self, request: web.Request, handler) -> web.StreamResponse:
        transport = request.transport
        self.connections.handling(transport, True)
        try:
            return await self._answer(request, handler)
        finally:
            self.connections.handling(transport, False)

    async def _answer(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            response = exc
            if isinstance(exc, web.HTTPMethodNotAllowed):  # the router's: a known path, another method
                allowed = sorted(exc.allowed_methods)
                response = web.HTTPMethodNotAllowed(request.method, allowed, content_type="application/json", text=json.dumps(
                    {"error": f"{request.method[:16]} is not allowed on {request.path[:200]}: {', '.join(allowed)} only"}))
            elif exc.status >= 400 and exc.content_type != "application/json":  # the router's own (no such path): JSON too
                response = _error(type(exc), f"{exc.reason}: {request.path[:200]}")
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as exc:  # a bug: one line (no traceback), held to a few a minute by the server's log limit
            log.error("http_internal_error", extra={"fields": {"path": request.path[:200], "error": short(exc)}})
            response = _error(web.HTTPInternalServerError, f"internal error: {type(exc).__name__}")
        # Nothing served here runs or loads anything but the package's own script and style.
        response.headers.setdefault("Content-Security-Policy",
                                    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        response.headers.setdefault("Cache-Control", "no-store")
        if isinstance(response, web.HTTPException):
            raise response
        return response

    def _page(self, name: str):
        async def serve(request: web.Request) -> web.Response:
            return web.Response(body=self._pages[name], content_type="text/html", charset="utf-8")

        return serve

    async def _asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in ASSETS:
            raise _error(web.HTTPNotFound, f"no asset {name[:64]!r}")
        return web.Response(body=self._pages[name], content_type=ASSETS[name], charset="utf-8")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=prometheus_client.generate_latest(self._registry),
                            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    async def _about(self, request: web.Request) -> web.Response:
        return _json({"auth": self._callers is not None, "leading": self._server.term is not None,
                      "leader": self._server.leader or None, "open_to_network": self.open_to_network,
                      "warnings": list(self.warnings), "retain_ended_s": self._server.limits.retain_ended_s})

    # -- the API -------------------------------------------------------------------------

    def _admin(self, request: web.Request) -> bool:
        """Whether the caller holds an admin token; with --auth-tokens, 401 unless it does; with client
        certificates on the gRPC port and no tokens, 403 (plain HTTP cannot check certificates)."""
        if self._callers is None:
            if self.client_certs:
                raise _error(web.HTTPForbidden, "this server requires client certificates (--tls-client-ca), which its "
                                                "plain-HTTP port cannot check: the JSON API of jobs is closed here; with "
                                                "--auth-tokens as well it opens to admin tokens. /metrics stays open")
            return False
        if self._callers.role([("authorization", request.headers.get("Authorization", ""))]) == ADMIN:
            return True
        raise _error(web.HTTPUnauthorized, "this server requires an admin token: send 'Authorization: Bearer <token>' "
                                           "with a token its --auth-tokens file marks admin")

    def _caller(self, request: web.Request) -> Caller:
        """Who a request comes from, counted as gRPC counts its callers (rpc/auth.py caller_of): its token
        (its calls end when it is revoked; an admin one is exempt from shares), else its peer's address."""
        if self._callers is None:
            ip = peer_ip(request.transport.get_extra_info("peername") if request.transport else request.remote)
            return Caller("peer:" + ip, f"peer {ip[:64]}")
        digest, role = self._callers.lookup([("authorization", request.headers.get("Authorization", ""))])
        return Caller(TOKEN + digest.hex(), "this token", role == ADMIN)

    def _term(self) -> ServedTerm:
        try:
            return self._server.serving()
        except NotLeader as leader:
            raise _error(web.HTTPServiceUnavailable, str(leader), leader=leader.leader or None) from None

    async def _jobs(self, request: web.Request) -> web.Response:
        admin = self._admin(request)
        machine = self._term().machine
        size = min(_number(request, "page_size", PAGE_SIZE, 1), MAX_PAGE_SIZE)  # a huge page is capped
        ended = request.query.get("ended", "") in ("1", "true")  # the runs that ended and are kept, too
        views, more = machine.job_page(request.query.get("page_token", ""), size, ended)
        jobs = []
        for view in views:
            if view.seal and not admin:
                jobs.append({"job_id": view.job_id, "run": view.run, "state": view.state.value, "sealed": True,
                             "ended_at": view.ended_at or None})
                continue
            last = machine.events(view.job_id, run=view.run)[-1:] if view.ended_at else [machine.last_event(view.job_id)]
            jobs.append({**_summary(view), "last_event": _event(last[0]) if last and last[0] is not None else None})
        token = (page_key(views[-1]) if ended else views[-1].job_id) if more else ""
        return _json({"jobs": jobs, "next_page_token": token})

    def _view(self, request: web.Request, first: int = 0, count: int | None = 0) -> tuple[ServedTerm, JobView]:
        admin = self._admin(request)
        term = self._term()
        job_id = request.match_info["job_id"]
        run = _number(request, "run", 0, 0)  # 0: the live run, else the latest that ended
        try:
            check_job_id(job_id)
            view = term.machine.describe(job_id, None if admin else "", first, count, run=run)
        except NotFound as exc:
            raise _error(web.HTTPNotFound, str(exc)) from None
        except Sealed:
            raise _error(web.HTTPForbidden, f"job {job_id!r} is sealed: only an admin token shows it") from None
        except Refusal as exc:
            raise _error(web.HTTPBadRequest, str(exc)) from None
        return term, view

    async def _job(self, request: web.Request) -> web.Response:
        first = _number(request, "node_page_token", 0, 0)
        size = min(_number(request, "node_page_size", NODE_PAGE_SIZE, 1), MAX_NODE_PAGE_SIZE)
        term, view = self._view(request, first, size)
        machine = term.machine
        ended = bool(view.ended_at)  # a run that ended: who took part, no workers or groups held any more
        workers = {} if ended else machine.workers(view.job_id, [n.node_key for n in view.nodes])
        plan = None if ended else machine.plan_of(view.job_id)
        out = _summary(view)
        out.update(
            spec=view.spec.to_json(),
            waiting=view.waiting,
            not_ready=view.not_ready,
            missing_nodes=list(view.missing_nodes),
            refused=view.refused,
            last_refused=view.last_refused,
            lease_ttl_s=machine.lease_ttl_s,
            nodes=[{"node_key": n.node_key, "node_rank": n.node_rank, "address": n.address,
                    "addresses": list(n.addresses or (n.address,)), "took_part": n.workers if ended else None, "workers": [
                {"worker_id": w.worker_id, "local_rank": w.local_rank, "rank": w.rank, "role": w.role, "lease": w.lease,
                 "renewed_s_ago": None if w.renewed_s_ago is None else round(w.renewed_s_ago, 2)}
                for w in workers.get(n.node_key, ())]} for n in view.nodes],
            next_node_page_token=str(first + len(view.nodes)) if first + len(view.nodes) < view.num_nodes else "",
            groups=[{"mode": mode, "count": len(groups), "sizes": sorted({g.size for g in groups}),
                     "cpu_twin": any(g.cpu_twin for g in groups),
                     "groups": [{"index": g.index, "ranks": expand(g.ranks)[:64], "size": g.size, "root": g.root}
                                for g in groups[:GROUP_EXAMPLES]]}
                    for mode, groups in (plan.all_groups().items() if plan is not None else ())],
            events=[_event(e) for e in machine.events(view.job_id, run=view.run)[-50:]],
        )
        return _json(out)

    async def _events(self, request: web.Request) -> web.Response:
        term, view = self._view(request)
        machine = term.machine
        size = min(_number(request, "page_size", PAGE_SIZE, 1), MAX_PAGE_SIZE)
        events = machine.events(view.job_id, _number(request, "after", 0, 0), size + 1, run=view.run)
        shown = events[:size]
        return _json({"events": [_event(e) for e in shown],
                      "next_page_token": str(shown[-1].seq) if len(events) > size else ""})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: the kept events after `after` (or Last-Event-ID),
        then each new one; `event: end` when the job is gone; `event: error`
        when the reader fell too far behind (reconnecting resumes from the last id)."""
        term, view = self._view(request)
        machine = term.machine
        after = _number(request, "after", 0, 0)
        last_id = request.headers.get("Last-Event-ID", "")
        if last_id.isdigit() and len(last_id) < 20:
            after = max(after, int(last_id))
        if view.ended_at:  # a run that ended: its events, then the end
            kept = "".join(f"id: {e.seq}\nevent: job-event\ndata: {json.dumps(_event(e))}\n\n"
                           for e in machine.events(view.job_id, after, run=view.run))
            return web.Response(body=(kept + "event: end\ndata: {}\n\n").encode(),
                                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        caller = self._caller(request)
        try:  # the caller's share of --max-streams, as its gRPC streams count
            machine.shares.open_stream(caller, "open streams")
        except LimitExceeded as exc:
            raise _error(web.HTTPTooManyRequests, str(exc)) from None
        watchers = term.executor.watchers
        watch = watchers.open(view.job_id, machine.events(view.job_id, after))  # no await in between
        machine.shares.live.add(caller, watch.end)  # a revoked token's stream ends
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                               "X-Accel-Buffering": "no"})
        task = asyncio.current_task()
        self._streams.add(task)
        try:
            await response.prepare(request)
            while True:
                try:
                    item = await asyncio.wait_for(watch.queue.get(), self.HEARTBEAT_S)
                except asyncio.TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                if item is JOB_GONE:
                    await response.write(b"event: end\ndata: {}\n\n")
                    break
                if isinstance(item, (TooSlow, Exception)):
                    why = "this stream fell too far behind its reader" if isinstance(item, TooSlow) else str(item)
                    await response.write(b"event: error\ndata: " + json.dumps({"error": why}).encode() + b"\n\n")
                    break
                await response.write(f"id: {item.seq}\nevent: job-event\ndata: {json.dumps(_event(item))}\n\n".encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            watchers.close(watch)
            machine.shares.live.discard(caller, watch.end)
            machine.shares.close_stream(caller)
            self._streams.discard(task)
        return response


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, separators=(",", ":"), allow_nan=False), status=status,
                        content_type="application/json")


def _error(kind: type[web.HTTPException], message: str, **extra: Any) -> web.HTTPException:
    return kind(text=json.dumps({"error": message, **extra}), content_type="application/json")


def _number(request: web.Request, name: str, default: int, minimum: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    if not (raw.isdigit() and raw.isascii() and len(raw) <= 18) or int(raw) < minimum:
        raise _error(web.HTTPBadRequest, f"{name} {raw[:32]!r} is not a whole number of at least {minimum}")
    return int(raw)


def _summary(v: JobView) -> dict[str, Any]:
    return {
        "job_id": v.job_id, "state": v.state.value, "sealed": bool(v.seal), "generation": v.generation,
        "joined": v.joined, "world_size": v.spec.world_size, "min_size": v.spec.min_size, "missing": v.missing,
        "num_nodes": v.num_nodes, "age_s": round(v.forming_for_s, 1) if math.isfinite(v.forming_for_s) else None,
        "reason": v.reason, "refused": v.refused, "run": v.run, "started_at": v.started_at or None,
        "ended_at": v.ended_at or None, "other_runs": list(v.other_runs),
        "nodes_min": v.spec.min_world if v.spec.nodes else None,  # a job of nodes (torchrun's): its sizes count nodes
    }


def _event(e: JobEvent) -> dict[str, Any]:
    return {"seq": e.seq, "time": e.time, "kind": e.kind, "generation": e.generation, "message": e.message,
            "fields": dict(e.fields)}

