"""The HTTP port's connections, shared fairly: at most `max_connections` at
once and `peer_connections` from one peer address (so that one peer never
holds the port: /metrics and the pages answer others while it holds all it
may), and no connection held by doing nothing or by doing it slowly.

Each accepted connection is a `_Connection` in front of aiohttp's handler of
it. Over a cap it is answered 429 (its peer's) or 503 (the server's) and
closed before a byte is read. Admitted, it is closed when it sends no byte of
a request for `idle_s` after opening or after its last answer, and when a
request's line and headers are not complete `header_s` after their first byte
(slowloris); a request in its handler (an event stream) is never timed out
here. Every refusal and close is counted in
`commctx_http_connections_closed_total{why}`; none is logged.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import prometheus_client
from aiohttp.http_exceptions import HttpProcessingError

REFUSED_PEER, REFUSED_SERVER, SLOW_HEADER, IDLE = "refused_peer", "refused_server", "slow_header", "idle"


class Connections:
    """The caps, the timeouts, and who holds which connection now."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, max_connections: int, peer_connections: int,
                 idle_s: float, header_s: float) -> None:
        self.max_connections, self.peer_connections = max_connections, peer_connections
        self.idle_s, self.header_s = idle_s, header_s
        self.open: dict[asyncio.BaseTransport, _Connection] = {}
        self.peers: collections.Counter[str] = collections.Counter()
        self.closed = prometheus_client.Counter(
            "commctx_http_connections_closed", "HTTP connections refused (refused_peer, refused_server: over a cap) "
            "or closed (idle, slow_header: a request's head too slow)", ["why"], registry=registry)

    def protocol(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The listener's protocol factory, around aiohttp's (`make`)."""
        return lambda: _Connection(self, make)

    def handling(self, transport: asyncio.BaseTransport | None, handling: bool) -> None:
        """A request on `transport` reached its handler (its head is complete), or its handler is done."""
        connection = self.open.get(transport) if transport is not None else None
        if connection is not None:
            connection.handling(handling)


class _Connection(asyncio.Protocol):
    def __init__(self, owner: Connections, make: Callable[[], asyncio.Protocol]) -> None:
        self._owner, self._make = owner, make
        self._inner: asyncio.Protocol | None = None  # aiohttp's, once admitted
        self._transport: Any = None
        self._peer = ""
        self._timer: asyncio.TimerHandle | None = None
        self._heading = False  # a request's head has begun: header_s runs
        self._handling = False  # a request is in its handler
        self._unsent = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        owner = self._owner
        self._transport = transport
        self._peer = peer_ip(transport.get_extra_info("peername"))
        held = owner.peers[self._peer]
        if held >= owner.peer_connections:
            return self._refuse(429, REFUSED_PEER, f"peer {self._peer[:64]} holds {held} of its {owner.peer_connections} "
                                                   f"HTTP connections (--http-peer-connections); close some, or retry later")
        if len(owner.open) >= owner.max_connections:
            return self._refuse(503, REFUSED_SERVER, f"this server holds its maximum of {owner.max_connections} HTTP "
                                                     f"connections (--http-max-connections); retry later")
        owner.peers[self._peer] += 1
        owner.open[transport] = self
        self._inner = self._make()
        self._inner.connection_made(transport)
        self._wait(owner.idle_s, heading=False)

    def _refuse(self, status: int, why: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        head = (f"HTTP/1.1 {status} {'Too Many Requests' if status == 429 else 'Service Unavailable'}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        self._transport.write(head.encode() + body)
        self._transport.close()
        self._owner.closed.labels(why).inc()

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if not self._handling and not self._heading:  # a request's first byte: its head must follow within header_s
            self._wait(self._owner.header_s, heading=True)
        self._inner.data_received(data)

    def handling(self, handling: bool) -> None:
        self._handling = handling
        if handling:
            self._heading = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        elif self._inner is not None and not self._transport.is_closing():
            self._wait(self._owner.idle_s, heading=False)

    def _wait(self, seconds: float, heading: bool) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._heading, self._unsent = heading, 0
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self._timer = None
        transport = self._transport
        if self._handling or self._inner is None or transport.is_closing():
            return
        unsent = transport.get_write_buffer_size()
        if not self._heading and unsent and unsent != self._unsent:  # its last answer still goes out, slowly
            self._wait(self._owner.idle_s, heading=False)
            self._unsent = unsent
            return
        self._owner.closed.labels(SLOW_HEADER if self._heading else IDLE).inc()
        transport.abort()

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._inner is None:
            return
        owner = self._owner
        owner.open.pop(self._transport, None)
        owner.peers[self._peer] -= 1
        if owner.peers[self._peer] <= 0:
            del owner.peers[self._peer]
        inner, self._inner = self._inner, None
        inner.connection_lost(exc)


class AiohttpLog(logging.LoggerAdapter):
    """What aiohttp logs: a client's malformed request (a bad request line, a
    header over 8 KiB) at DEBUG, as it answers 400, never more per request;
    anything else as one ERROR line without a traceback, which the server's
    log limit (server/main.py LogLimit) holds to a few a minute."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("commctx.server.http"), {})

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1] if exc_info else None
        if level <= logging.DEBUG or isinstance(exc, (HttpProcessingError, ConnectionError, asyncio.CancelledError)):
            if self.logger.isEnabledFor(logging.DEBUG):
                self.logger.debug(msg, *args, exc_info=exc_info)
            return
        what = (str(msg) % args if args else str(msg))[:200]
        self.logger.log(max(level, logging.ERROR) if exc else level, "http_error",
                        extra={"fields": {"what": what, **({"error": short(exc)} if exc else {})}})


def peer_ip(name: Any) -> str:
    """A peer's IP address from its socket's peer name (an IPv4-mapped IPv6 one as IPv4, as gRPC names it)."""
    host = str(name[0]) if isinstance(name, (tuple, list)) and name else str(name or "")
    return host[7:] if host.startswith("::ffff:") and "." in host else host


def short(exc: BaseException) -> str:
    """An exception in one short line: its type and message."""
    return f"{type(exc).__name__}: {exc}"[:200]
