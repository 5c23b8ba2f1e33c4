"""Requests that do not parse, at the RPC edge: the deserializer answers
`Undecodable` instead of raising (gRPC would answer UNKNOWN and log a
traceback per request), and logs at most a line a minute of them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from google.protobuf.message import DecodeError

from ..errors import BadRequest

log = logging.getLogger("commctx.server")


class Undecodable:
    """What the request deserializer returns for bytes that do not parse, instead
    of raising (gRPC would answer UNKNOWN and log a traceback per request)."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def error(self) -> BadRequest:
        return BadRequest(f"the request is not a valid {self.type_name} message")


class LimitedLog:
    """At most one log line per `every_s` seconds, counting what it held back."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s, self.held = every_s, 0
        self.last: float | None = None  # when the last line was logged (None: never)

    def __call__(self, now: float, message: str) -> None:
        if self.last is None or now - self.last >= self.every_s:
            log.warning("undecodable_requests", extra={"fields": {"example": message, "more_since_last_line": self.held}})
            self.last, self.held = now, 0
        else:
            self.held += 1


def tolerant(parse: Callable[[bytes], object], type_name: str, log_line: LimitedLog) -> Callable[[bytes], object]:
    """`parse`, answering Undecodable (and logging through `log_line`) where it would raise."""

    def decode(data: bytes) -> object:
        try:
            return parse(data)
        except DecodeError:
            log_line(time.monotonic(), f"{len(data)} bytes that are not a {type_name}")
            return Undecodable(type_name)

    return decode
