"""Where the rendezvous state lives between restarts: the store's records, its
write vocabulary, the fencing contract, and the in-memory stores.

The state machine returns the writes each transition implies (`PutJob`,
`PutMember`, `DeleteMember`, `DeleteJob`, and `PutEvent`, `TrimEvents` for a
job's history); the executor commits them through a
`Store`, in order, before anyone hears of what they record. Leases are not
stored: after a restart every member gets a fresh lease plus a grace period.
A world is stored as its `Seating` (who sits where); planning is
deterministic, so the groups are rebuilt identically.

Fencing: a server becomes the writer with `take_over()`, which returns a new
epoch and fences every earlier one; `commit(writes, epoch)` raises `Fenced`
once another writer has taken over. (SQLite: an epoch row checked inside the
write transaction. etcd: a transaction comparing the leader key's revision.)

`NullStore` keeps nothing (the server's `--store memory`: the state machine's
own structures are the state); `MemoryStore` keeps the records in this
process (the reference implementation of the contract tests); `SqliteStore`
(sqlite.py) keeps them in a file.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from commctx.common.planning import JobSpec, SeatedNode, Seating

from .model import JobEvent


class Fenced(Exception):
    """Another writer has taken over the store; this one must stop writing."""


class StoreError(Exception):
    """The store cannot be opened or written; the message names the path and the reason."""


class MemberRecord(NamedTuple):  # a NamedTuple: one is built per join
    member_id: str
    seq: int  # join order
    node_key: str
    address: str
    port: int  # the member's spare listening port (0: none until it offers one)
    local_rank: int | None
    node_rank: int | None
    role: str
    secret: str = ""  # SHA-256 digest (hex) of the member secret; "": none (schema 2)
    workers: int = 1  # >1: a node membership (schema 4)
    slots: tuple = ()  # a host membership's workers, (index, role, local rank) each (schema 6)


class JobRecord(NamedTuple):
    job_id: str
    spec: JobSpec
    state: str  # a JobState value
    generation: int
    reason: str
    world: Seating | None  # the current world (while re-forming: the one being replaced)
    members: tuple[MemberRecord, ...] = ()  # filled by load(), in join order
    seal: str = ""  # SHA-256 digest (hex) of the job secret; "": an open job
    since: float = 0.0  # wall-clock time its current generation began forming (AGE); 0: unknown (schema 3)
    retained_until: float = 0.0  # an ended run (job_id '<id>#<run>', history.py): wall-clock time it is forgotten
    events: tuple[JobEvent, ...] = ()  # filled by load(): its history, by seq
    run: int = 1  # which run of its job id (schema 7)
    started: float = 0.0  # wall-clock times the run began (its first Join) and ended (0: it has not)
    ended: float = 0.0


class PutJob(NamedTuple):
    record: JobRecord


class PutMember(NamedTuple):
    job_id: str
    record: MemberRecord


class DeleteMember(NamedTuple):
    job_id: str
    member_id: str


class DeleteJob(NamedTuple):
    """Deletes the job, every member it still has and its events."""

    job_id: str


class PutEvent(NamedTuple):
    """Adds an event to the job's history, or replaces the one of the same seq
    (a count of joins or refusals that grew)."""

    job_id: str
    event: JobEvent


class TrimEvents(NamedTuple):
    """Forgets the job's events of seq below `first_kept`."""

    job_id: str
    first_kept: int


Write = PutJob | PutMember | DeleteMember | DeleteJob | PutEvent | TrimEvents


def without_superseded(writes: list[Write]) -> list[Write]:
    """`writes` less each PutJob that a later PutJob of the same job replaces
    whole (a re-form puts its job twice: FORMING, then FORMED; at 10,000
    workers each record holds a 10,000-member seating). Same final state, in
    every store."""
    last = {w.record.job_id: i for i, w in enumerate(writes) if type(w) is PutJob}
    if len(last) == sum(type(w) is PutJob for w in writes):
        return writes
    return [w for i, w in enumerate(writes) if type(w) is not PutJob or last[w.record.job_id] == i]


class Store:
    """The interface every store implements (tests/test_store.py is its contract)."""

    # Whether commit() does I/O; the executor then runs it in a worker thread.
    blocking = False

    def take_over(self) -> int:
        """Becomes the store's writer; returns the new epoch. Every earlier epoch is fenced."""
        raise NotImplementedError

    def load(self) -> list[JobRecord]:
        """Every job with its members, as last committed, ordered by job id."""
        raise NotImplementedError

    def commit(self, writes: Sequence[Write], epoch: int) -> None:
        """Applies `writes` in order, atomically and durably.

        Raises:
            Fenced: `epoch` is no longer the store's writer; nothing was written.
            StoreError: the writes could not be made durable; nothing was written.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Releases the store. Idempotent."""


class NullStore(Store):
    """Keeps nothing: state lives only in the server's memory."""

    def take_over(self) -> int:
        return 1

    def load(self) -> list[JobRecord]:
        return []

    def commit(self, writes: Sequence[Write], epoch: int) -> None:
        pass


class MemoryStore(Store):
    """Keeps records in this process; shared by the "restarts" of contract tests."""

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


# -- the stored form of specs and seatings: named fields, the store's own schema ----


@functools.lru_cache(maxsize=1024)  # every PutJob of a job carries the same spec
def spec_json(spec: JobSpec) -> str:
    """A spec as stored: its JSON form (JobSpec.to_json), named fields."""
    return json.dumps(spec.to_json(), separators=(",", ":"))


def event_fields_json(event: JobEvent) -> str:
    """An event's fields as stored: a JSON object."""
    return json.dumps(dict(event.fields), separators=(",", ":"))


def event_of(seq: int, time: float, kind: str, generation: int, message: str, fields: str) -> JobEvent:
    """An event as stored (its fields a JSON object)."""
    return JobEvent(seq, time, kind, generation, message, json.loads(fields) if fields else {})


def spec_from_json(text: str) -> JobSpec:
    return JobSpec.from_json(json.loads(text))


def seating_record(s: Seating) -> dict[str, Any]:
    return {
        "nodes": [{"node_key": n.node_key, "address": n.address, "members": list(n.members)} for n in s.nodes],
        "roles": list(s.roles),
        "master_addr": s.master_addr,
        "master_port": s.master_port,
    }


def seating_from_record(record: dict[str, Any]) -> Seating:
    return Seating(
        tuple(SeatedNode(n["node_key"], n["address"], tuple(n["members"])) for n in record["nodes"]),
        tuple(record["roles"]),
        record["master_addr"],
        record["master_port"],
    )


def member_record(member_id: str, m) -> MemberRecord:
    """The stored form of a member of the state machine (model.Member)."""
    return MemberRecord(member_id, m.seq, m.node_key, m.address, m.port, m.local_rank, m.node_rank, m.role, m.secret, m.workers,
                        tuple(tuple(s) for s in m.slots))
