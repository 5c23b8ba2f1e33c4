"""Where the rendezvous state lives between restarts: the store's records, its
write vocabulary, the fencing contract, and the store of `--store memory`.

The state machine returns the writes each transition implies (`PutJob`,
`PutMember`, `DeleteMember`, `DeleteJob`, and `PutEvent`, `TrimEvents` for a
job's history); the executor commits them through a
`Store`, in order, before anyone hears of what they record. Leases are not
stored: after a restart every member gets a fresh lease plus a grace period.
A world is stored as its `Seats` (who sits where); planning is
deterministic, so the groups are rebuilt identically.

Fencing: a server becomes the writer with `take_over()`, which returns a new
epoch and fences every earlier one; `commit(writes, epoch)` raises `Fenced`
once another writer has taken over. (SQLite: an epoch row checked inside the
write transaction. etcd: a transaction comparing the leader key's revision.)

`MemoryStore` is the server's `--store memory`: it keeps nothing, the state
machine's own structures being the state. `SqliteStore` (sqlite.py) keeps the
records in a file, `EtcdStore` (etcd.py) in etcd; tests/stores.py holds the
contract tests' reference, which keeps them in dicts.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from commctx.common.planning import JobSpec, SeatedNode, Seats

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
    world: Seats | None  # the current world (while re-forming: the one being replaced)
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
    workers each record holds 10,000 seats). Same final state, in
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


class MemoryStore(Store):
    """The server's `--store memory`: the state lives in the state machine's
    memory alone, so this store keeps nothing and a restart starts empty."""

    def take_over(self) -> int:
        return 1

    def load(self) -> list[JobRecord]:
        return []

    def commit(self, writes: Sequence[Write], epoch: int) -> None:
        pass


# -- the stored form of specs and seats: named fields, the store's own schema ----


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


def seats_record(s: Seats) -> dict[str, Any]:
    return {
        "nodes": [{"node_key": n.node_key, "address": n.address, "members": list(n.members)} for n in s.nodes],
        "roles": list(s.roles),
        "master_addr": s.master_addr,
        "master_port": s.master_port,
    }


def seats_from_record(record: dict[str, Any]) -> Seats:
    return Seats(
        tuple(SeatedNode(n["node_key"], n["address"], tuple(n["members"])) for n in record["nodes"]),
        tuple(record["roles"]),
        record["master_addr"],
        record["master_port"],
    )


def member_record(member_id: str, m) -> MemberRecord:
    """The stored form of a member of the state machine (model.Member)."""
    return MemberRecord(member_id, m.seq, m.node_key, m.address, m.port, m.local_rank, m.node_rank, m.role, m.secret, m.workers,
                        tuple(tuple(s) for s in m.slots))
