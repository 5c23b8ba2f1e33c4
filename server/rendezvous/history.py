"""A job's history: the events the state machine records as it goes (the
`Recording` mixin of `Rendezvous`, machine.py), kept in the job (the last
--max-events-per-job), persisted with the transition's writes and published to
the job's watches (watching.py) once durable. Pure: no asyncio, no grpc."""

from __future__ import annotations

import collections

from commctx.common.planning import elide

from ..errors import NotFound
from .actions import Actions
from .model import EventKind, Job, JobEvent
from .shares import SERVER, Caller
from .store import PutEvent, TrimEvents


class Recording:
    """Appending to a job's history, and reading it."""

    JOIN_COALESCE_S = 1.0  # joins within this long of a job's "joined" event are counted in it

    def _event(self, job: Job, kind: EventKind, message: str, actions: Actions, **fields: object) -> None:
        """Appends an event to the job's history (the last max_events_per_job are kept):
        persisted with the transition's writes, then published to its watchers."""
        now = self._wall()
        events = job.events
        if events.maxlen != self.limits.max_events_per_job:
            job.events = events = collections.deque(events, maxlen=self.limits.max_events_per_job)
        last = events[-1] if events else None
        if (kind is EventKind.JOINED and last is not None and last.kind == EventKind.JOINED.value
                and last.generation == job.generation and now - last.fields.get("first", last.time) < self.JOIN_COALESCE_S):
            count = last.fields.get("workers", 1) + fields.get("workers", 1)
            first = last.fields.get("first", last.time)
            event = last._replace(time=now, message=f"{count} workers joined in {now - first:.1f} s (the last on node "
                                                    f"{fields.get('node')!r}); {job.count()}",
                                  fields={**fields, "workers": count, "first": first})
            events[-1] = event  # a count that grew: the same seq, replaced
        else:
            event = JobEvent(last.seq + 1 if last is not None else 1, now, kind.value, job.generation, message, fields)
            dropped = len(events) == events.maxlen
            events.append(event)
            if dropped and events[0].seq % 64 == 0:  # the store forgets the dropped ones now and then, not each time
                actions.writes.append(TrimEvents(job.job_id, events[0].seq))
        actions.writes.append(PutEvent(job.job_id, event))
        actions.events.append((job.job_id, event))

    def last_event(self, job_id: str) -> JobEvent | None:
        """The job's latest event (None: none, or an unknown job)."""
        job = self._jobs.get(job_id)
        history = job.events if job is not None else self._failed.get(job_id, (None, None, ()))[2]
        return history[-1] if history else None

    def events(self, job_id: str, after: int = 0, limit: int | None = None, secret: str | None = None,
               caller: Caller = SERVER) -> list[JobEvent]:
        """The job's kept events of seq above `after` (at most `limit`), of a
        job held or a failed one kept; for a sealed job, given its secret (None:
        not checked).

        Raises:
            NotFound: an unknown job.
            Sealed: the job is sealed and `secret` does not open it.
        """
        job = self._jobs.get(job_id)
        if job is not None:
            seal, history = job.seal, job.events
        elif job_id in self._failed:
            view, _, history = self._failed[job_id]
            seal = view.seal
        else:
            raise NotFound(f"no job {elide(job_id)} on this server")
        self._unseal(job_id, seal, secret, caller, "give its job_secret to read its events")
        out = []
        for event in reversed(history):  # the newest first: a follower asks for a few after its cursor
            if event.seq <= after:
                break
            out.append(event)
        out.reverse()
        return out if limit is None else out[:limit]
