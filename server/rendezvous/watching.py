"""Watching a job's history: the watches open on each job, fed by the
executor with every event once it is durable, each through a bounded queue.

A watch starts from a snapshot of the kept events after its cursor; events
published later that the snapshot already held are not sent twice (an event
whose count grew since, same seq, is). A watch whose reader falls QUEUE events
behind is cut off (TOO_SLOW) rather than held in memory without bound. A job
that is gone ends its watches (JOB_GONE).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable

from .model import JobEvent

JOB_GONE = None  # what a watch reads when its job is gone from the server


class TooSlow:
    """What a watch reads when its reader fell too far behind (it may watch again from what it has)."""


TOO_SLOW = TooSlow()


class Watch:
    """One reader of one job's events: read `queue` until JOB_GONE, TooSlow or an Exception."""

    __slots__ = ("job_id", "queue", "_last", "_cut")

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.queue: asyncio.Queue[JobEvent | TooSlow | Exception | None] = asyncio.Queue()
        self._last: JobEvent | None = None  # the last event queued
        self._cut = False

    def offer(self, event: JobEvent, limit: int) -> None:
        if self._cut:
            return
        last = self._last
        if last is not None and (event.seq < last.seq or (event.seq == last.seq and event == last)):
            return  # the snapshot held it already
        if self.queue.qsize() >= limit:
            self._cut = True
            self.queue.put_nowait(TOO_SLOW)
            return
        self._last = event
        self.queue.put_nowait(event)

    def end(self, why: Exception | None = JOB_GONE) -> None:
        if not self._cut:
            self._cut = True
            self.queue.put_nowait(why)


class Watchers:
    """The open watches, by job."""

    QUEUE = 1024  # events a watch may hold for its reader before it is cut off

    def __init__(self) -> None:
        self._by_job: dict[str, set[Watch]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def open(self, job_id: str, snapshot: Iterable[JobEvent]) -> Watch:
        """A watch of `job_id` that first reads `snapshot` (taken in the same
        step, with no await between: nothing published falls in between)."""
        watch = Watch(job_id)
        for event in snapshot:  # at most max_events_per_job: never cut
            watch.offer(event, sys.maxsize)
        self._by_job.setdefault(job_id, set()).add(watch)
        self._count += 1
        return watch

    def close(self, watch: Watch) -> None:
        watches = self._by_job.get(watch.job_id)
        if watches is not None and watch in watches:
            watches.discard(watch)
            self._count -= 1
            if not watches:
                del self._by_job[watch.job_id]

    def publish(self, job_id: str, event: JobEvent | None) -> None:
        """Hands a durable event to the job's watches (None: the job is gone, and so are they)."""
        watches = self._by_job.get(job_id)
        if not watches:
            return
        if event is JOB_GONE:
            for watch in watches:
                watch.end()
            return
        for watch in watches:
            watch.offer(event, self.QUEUE)

    def end_all(self, why: Exception) -> None:
        """Ends every watch with `why` (the server stops serving)."""
        for watches in self._by_job.values():
            for watch in watches:
                watch.end(why)
