"""The contract tests' reference store: it keeps the records in dicts, in this
process, so a test can "restart" a server on it and compare any other store's
content with it (tests/test_store.py runs the contract over it too)."""

from __future__ import annotations

from collections.abc import Sequence

from commctx.server.rendezvous.model import JobEvent
from commctx.server.rendezvous.store import (
    DeleteMember,
    Fenced,
    JobRecord,
    MemberRecord,
    PutEvent,
    PutJob,
    PutMember,
    Store,
    TrimEvents,
    Write,
)


class DictStore(Store):
    """Keeps the records in dicts, fenced by epoch as every store is."""

    def __init__(self) -> None:
        self._jobs: dict[str, JobRecord] = {}
        self._members: dict[str, dict[str, MemberRecord]] = {}
        self._events: dict[str, dict[int, JobEvent]] = {}
        self._epoch = 0

    def take_over(self) -> int:
        self._epoch += 1
        return self._epoch

    def commit(self, writes: Sequence[Write], epoch: int) -> None:
        if epoch != self._epoch:
            raise Fenced(f"epoch {epoch} was fenced by epoch {self._epoch}")
        for w in writes:
            if isinstance(w, PutMember):
                self._members.setdefault(w.job_id, {})[w.record.member_id] = w.record
            elif isinstance(w, PutJob):
                self._jobs[w.record.job_id] = w.record
                self._members.setdefault(w.record.job_id, {})
            elif isinstance(w, DeleteMember):
                self._members.get(w.job_id, {}).pop(w.member_id, None)
            elif isinstance(w, PutEvent):
                self._events.setdefault(w.job_id, {})[w.event.seq] = w.event
            elif isinstance(w, TrimEvents):
                events = self._events.get(w.job_id, {})
                for seq in [s for s in events if s < w.first_kept]:
                    del events[seq]
            else:
                self._jobs.pop(w.job_id, None)
                self._members.pop(w.job_id, None)
                self._events.pop(w.job_id, None)

    def load(self) -> list[JobRecord]:
        return [
            job._replace(members=tuple(sorted(self._members.get(job_id, {}).values(), key=lambda m: m.seq)),
                         events=tuple(sorted(self._events.get(job_id, {}).values())))
            for job_id, job in sorted(self._jobs.items())
        ]
