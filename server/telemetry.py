"""What the server tells operators: one structured log line per membership
event, and Prometheus metrics.

The domain calls an `Events` object; `Telemetry` turns the calls into log lines
(plain `key=value` text or JSON) and metrics. Nothing here is ever logged from
request payloads beyond ids, node keys and counts.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("commctx.server")


class Events:
    """Membership events; this base ignores them (for tests and embedding)."""

    def joined(self, job_id: str, member_id: str, node_key: str, role: str, joined: int, world_size: int) -> None: ...

    def formed(self, job_id: str, generation: int, world_size: int, nodes: int, seconds: float) -> None: ...

    def failed(self, job_id: str, reason: str) -> None: ...

    def reforming(self, job_id: str, generation: int, reason: str) -> None: ...

    def ended(self, job_id: str, reason: str) -> None: ...

    def removed(self, job_id: str, member_id: str, why: str) -> None: ...

    def rpc_error(self, method: str, code: str) -> None: ...


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


class Telemetry(Events):
    """Logs every event and counts it in a Prometheus registry."""

    def __init__(self, registry: CollectorRegistry, stats: Callable[[], dict[str, float]]) -> None:
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
        registry.register(_StateCollector(stats))

    def joined(self, job_id, member_id, node_key, role, joined, world_size):
        self.joins.inc()
        if log.isEnabledFor(logging.INFO):  # checked here: this runs once per worker of every job
            event("join", job=job_id, member=member_id, node=node_key, role=role, joined=joined, world_size=world_size)

    def formed(self, job_id, generation, world_size, nodes, seconds):
        self.worlds.inc()
        self.duration.observe(seconds)
        event("formed", job=job_id, generation=generation, world_size=world_size, nodes=nodes, seconds=round(seconds, 3))

    def failed(self, job_id, reason):
        self.failures.inc()
        event("failed", logging.WARNING, job=job_id, reason=reason)

    def reforming(self, job_id, generation, reason):
        self.reforms.inc()
        event("reforming", job=job_id, generation=generation, reason=reason)

    def ended(self, job_id, reason):
        event("ended", job=job_id, reason=reason)

    def removed(self, job_id, member_id, why):
        self.removed_members.labels(why).inc()
        event({"left": "leave", "expired": "expiry"}.get(why, why), job=job_id, member=member_id)

    def rpc_error(self, method, code):
        self.errors.labels(method, code).inc()


class _StateCollector:
    """Gauges read from the state at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._stats()
        yield GaugeMetricFamily("commctx_active_jobs", "Jobs held (forming, formed or failed with members)", value=s["jobs"])
        yield GaugeMetricFamily("commctx_active_members", "Members of all jobs", value=s["members"])
        yield GaugeMetricFamily("commctx_waiting_members", "Members whose world has not formed yet", value=s["waiting"])
        yield GaugeMetricFamily(
            "commctx_keepalive_age_seconds", "Seconds since the least recently renewed lease was renewed", value=s["oldest_keepalive_s"]
        )
