"""What the server tells operators: one structured log line per membership
event, Prometheus metrics, and the event loop's lag.

The state machine returns `Note`s; `Telemetry.record` turns each into a log
line (plain `key=value` text or JSON) and metrics. Gauges are read from one
snapshot the event loop takes on each scrape, never from live structures in
the scraping thread. Nothing from request payloads is logged beyond ids, node
keys and counts.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from .rendezvous.model import Note
from .rendezvous.reports import Stats

log = logging.getLogger("commctx.server")

_LOG_EVENT = {"left": "leave", "expired": "expiry", "withdrawn": "withdrawn"}


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    if log.isEnabledFor(level):
        log.log(level, name, extra={"fields": fields})


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        text = " ".join(f"{k}={_plain(v)}" for k, v in fields.items())
        line = f"{self.formatTime(record)} {record.levelname} {record.getMessage()}" + (f" {text}" if text else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _plain(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "event": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class LoopLag:
    """A timer that measures its own lateness: how long the event loop was
    kept from running anything. Keeps the worst lag of each of the last ten
    seconds."""

    PERIOD_S = 0.05

    def __init__(self, histogram: Histogram | None = None) -> None:
        self._histogram = histogram
        self._worst: collections.deque[tuple[int, float]] = collections.deque(maxlen=10)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + self.PERIOD_S
            await asyncio.sleep(self.PERIOD_S)
            lag = max(0.0, loop.time() - expected)
            if self._histogram is not None:
                self._histogram.observe(lag)
            second = int(time.monotonic())
            if self._worst and self._worst[-1][0] == second:
                if lag > self._worst[-1][1]:
                    self._worst[-1] = (second, lag)
            else:
                self._worst.append((second, lag))

    def worst(self, seconds: int = 10) -> float:
        """The worst lag seen in the last `seconds` (at most 10)."""
        since = int(time.monotonic()) - seconds
        return max((lag for second, lag in self._worst if second > since), default=0.0)


class Telemetry:
    """Logs every note and counts it in a Prometheus registry."""

    def __init__(self, registry: CollectorRegistry, stats: Callable[[], Stats]) -> None:
        self.registry = registry
        self.joins = Counter("commctx_joins", "Workers registered in a job", registry=registry)
        self.removed_members = Counter(
            "commctx_members_removed", "Members removed, by why: left, expired, withdrawn", ["why"], registry=registry
        )
        self.worlds = Counter("commctx_worlds_formed", "Worlds formed (each is a new generation of a job)", registry=registry)
        self.reforms = Counter("commctx_reforms", "Formed worlds that began re-forming (a member left or expired, or joiners arrived)", registry=registry)
        self.failures = Counter("commctx_jobs_failed", "Jobs whose joined workers could not form a valid world", registry=registry)
        self.duration = Histogram(
            "commctx_rendezvous_duration_seconds",
            "From a generation's first join to its world forming",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800),
            registry=registry,
        )
        self.errors = Counter("commctx_rpc_errors", "RPCs answered with an error, by method and status code", ["method", "code"], registry=registry)
        self.session_ends = Counter(
            "commctx_session_ends", "Session streams that ended, by how: finished or cancelled by the client (or its "
            "connection broke: a departure unless it is back within the reconnect grace), replaced by a newer one, "
            "or ended by the server", ["how"], registry=registry)
        lag = Histogram(
            "commctx_event_loop_lag_seconds", "How late a 50 ms timer on the server's event loop fires",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5), registry=registry,
        )
        self.loop_lag = LoopLag(lag)
        self.gc_pauses = Histogram(
            "commctx_gc_pause_seconds", "Garbage-collector passes, by generation", ["generation"],
            buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1), registry=registry,
        )
        self._gc_started = 0.0
        self._tls_expires_at: float | None = None
        gc.callbacks.append(self._gc)
        registry.register(_StateCollector(stats, self.loop_lag))

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_pauses.labels(str(info["generation"])).observe(time.perf_counter() - self._gc_started)

    def close(self) -> None:
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)

    def record(self, note: Note) -> None:
        kind, fields = note
        if kind == "join":
            self.joins.inc()
            if log.isEnabledFor(logging.INFO):  # checked here: this runs once per worker of every job
                event("join", **fields)
        elif kind == "removed":
            self.removed_members.labels(fields["why"]).inc()
            event(_LOG_EVENT.get(fields["why"], fields["why"]), job=fields["job"], member=fields["member"])
        elif kind == "formed":
            self.worlds.inc()
            self.duration.observe(fields["seconds"])
            event("formed", **fields)
        elif kind == "reforming":
            self.reforms.inc()
            event("reforming", **fields)
        elif kind == "failed":
            self.failures.inc()
            event("failed", logging.WARNING, **fields)
        else:
            event(kind, **fields)

    def tls_expiry(self, seconds_left: float) -> None:
        """The main port's certificate expires in `seconds_left` (commctx_tls_cert_expiry_seconds counts down)."""
        self._tls_expires_at = time.time() + seconds_left
        self.registry.register(_ExpiryCollector(lambda: self._tls_expires_at))

    def rpc_error(self, method: str, code: str) -> None:
        self.errors.labels(method, code).inc()

    def session_ended(self, how: str) -> None:
        self.session_ends.labels(how).inc()


class _ExpiryCollector:
    def __init__(self, expires_at: Callable[[], float | None]) -> None:
        self._expires_at = expires_at

    def collect(self) -> Iterator[GaugeMetricFamily]:
        at = self._expires_at()
        if at is not None:
            yield GaugeMetricFamily("commctx_tls_cert_expiry_seconds",
                                    "Seconds until the main port's TLS certificate expires", value=at - time.time())


class _StateCollector:
    """Gauges from a snapshot taken at scrape time."""

    def __init__(self, stats: Callable[[], Stats], loop_lag: LoopLag) -> None:
        self._stats = stats
        self._loop_lag = loop_lag

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._stats()
        yield GaugeMetricFamily("commctx_active_jobs", "Jobs held (forming, formed or failed with members)", value=s.jobs)
        yield GaugeMetricFamily("commctx_active_members", "Workers of all jobs (a node membership counts its workers)", value=s.members)
        yield GaugeMetricFamily("commctx_open_sessions", "Session streams open (one a membership: the workers of a host "
                                "membership share one)", value=s.sessions)
        yield GaugeMetricFamily("commctx_waiting_members", "Workers whose world has not formed yet", value=s.waiting)
        yield GaugeMetricFamily(
            "commctx_keepalive_age_seconds", "Seconds since the least recently renewed lease was renewed", value=s.oldest_keepalive_s
        )
        yield GaugeMetricFamily(
            "commctx_event_loop_lag_max_seconds", "The worst event-loop lag in the last 10 seconds", value=self._loop_lag.worst()
        )
