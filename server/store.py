"""Where the server's state lives between restarts.

The state machine writes through a `Store` on every change (a job's spec,
state, generation and world; its members) and reads everything back once, at
start. Leases are not stored: after a restart every member gets a fresh lease
plus a grace period. A world's plan is not stored either: its inputs are
(`StoredJob.world`), and planning is deterministic.

`NullStore` keeps nothing (the server's in-memory mode: the state machine's
own structures are the state); `MemoryStore` keeps copies within the process
(the reference for the contract tests); `SqliteStore` keeps a SQLite database
in WAL mode. MemoryStore and SqliteStore pass tests/test_store.py; a
distributed store (etcd) would implement the same methods and pass the same
tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import sqlite3
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from commctx.v1 import rendezvous_pb2 as pb

from .assignment import MemberSpec
from .spec import JobSpec, spec_from_proto, spec_to_proto


class StoredMember(NamedTuple):  # a NamedTuple: one is built per join
    member_id: str
    seq: int  # join order
    node_key: str
    address: str
    master_port: int
    local_rank: int | None
    node_rank: int | None
    role: str
    in_world: bool


@dataclasses.dataclass(frozen=True)
class StoredJob:
    job_id: str
    spec: JobSpec
    state: str
    generation: int
    reason: str
    world: Sequence[MemberSpec]  # the current plan's input, in order
    members: tuple[StoredMember, ...] = ()  # filled by load()


class Store:
    """The interface. Writes happen on the event loop and must be quick."""

    def save_job(self, job: StoredJob) -> None:
        raise NotImplementedError

    def save_member(self, job_id: str, member: StoredMember) -> None:
        raise NotImplementedError

    def delete_member(self, job_id: str, member_id: str) -> None:
        raise NotImplementedError

    def delete_job(self, job_id: str) -> None:
        """Deletes the job and any members it still has."""
        raise NotImplementedError

    def load(self) -> list[StoredJob]:
        """Every job with its members, as last saved."""
        raise NotImplementedError

    def flush(self) -> None:
        """Makes every write so far durable before returning."""

    def close(self) -> None:
        """Flushes and releases the store. Idempotent."""


class NullStore(Store):
    """Keeps nothing: state lives only in the server's memory."""

    def save_job(self, job: StoredJob) -> None:
        pass

    def save_member(self, job_id: str, member: StoredMember) -> None:
        pass

    def delete_member(self, job_id: str, member_id: str) -> None:
        pass

    def delete_job(self, job_id: str) -> None:
        pass

    def load(self) -> list[StoredJob]:
        return []


class MemoryStore(Store):
    def __init__(self) -> None:
        self._jobs: dict[str, StoredJob] = {}
        self._members: dict[str, dict[str, StoredMember]] = {}

    def save_job(self, job: StoredJob) -> None:
        self._jobs[job.job_id] = job
        self._members.setdefault(job.job_id, {})

    def save_member(self, job_id: str, member: StoredMember) -> None:
        self._members.setdefault(job_id, {})[member.member_id] = member

    def delete_member(self, job_id: str, member_id: str) -> None:
        self._members.get(job_id, {}).pop(member_id, None)

    def delete_job(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._members.pop(job_id, None)

    def load(self) -> list[StoredJob]:
        return [
            dataclasses.replace(job, members=tuple(sorted(self._members.get(job_id, {}).values(), key=lambda m: m.seq)))
            for job_id, job in sorted(self._jobs.items())
        ]


def _world_json(world: Iterable[MemberSpec]) -> str:
    return json.dumps([list(m) for m in world])


def _world(text: str) -> list[MemberSpec]:
    return [MemberSpec(*fields) for fields in json.loads(text)]


class SqliteStore(Store):
    """SQLite in WAL mode under `state_dir`.

    synchronous=NORMAL: a commit is durable against the process being killed
    (kill -9), which is what a restart needs; against power loss the last
    commits before the failure may be lost (the workers then re-join).

    Writes are queued and committed together every 10 ms, as one transaction
    of executemany runs (group commit): a burst of ten thousand joins costs a
    few hundred commits, not ten thousand. `flush` commits at once; the state
    machine calls it before answering with anything that depends on a write
    (a formed world). A crash can lose at most the last 10 ms of joins and
    departures, which the workers' retries and leases make good.
    """

    COMMIT_EVERY_S = 0.01

    SCHEMA = """
        CREATE TABLE IF NOT EXISTS jobs (
            job_id TEXT PRIMARY KEY, spec BLOB NOT NULL, state TEXT NOT NULL,
            generation INTEGER NOT NULL, reason TEXT NOT NULL, world TEXT NOT NULL);
        CREATE TABLE IF NOT EXISTS members (
            job_id TEXT NOT NULL, member_id TEXT NOT NULL, seq INTEGER NOT NULL,
            node_key TEXT NOT NULL, address TEXT NOT NULL, master_port INTEGER NOT NULL,
            local_rank INTEGER, node_rank INTEGER, role TEXT NOT NULL, in_world INTEGER NOT NULL,
            PRIMARY KEY (job_id, member_id));
    """

    def __init__(self, state_dir: str | pathlib.Path) -> None:
        path = pathlib.Path(state_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / "commctx.sqlite3"
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(self.SCHEMA)
        self._queue: list[tuple[str, tuple]] = []

    def _write(self, sql: str, values: tuple) -> None:
        self._queue.append((sql, values))
        if len(self._queue) == 1:
            try:
                asyncio.get_running_loop().call_later(self.COMMIT_EVERY_S, self._commit)
            except RuntimeError:  # no event loop (tests, tools): commit at once
                self._commit()

    def flush(self) -> None:
        self._commit()

    def _commit(self) -> None:
        queue, self._queue = self._queue, []
        if not queue or self._db is None:
            return
        with self._db:  # one transaction
            self._db.execute("BEGIN")
            start = 0
            for i in range(1, len(queue) + 1):  # consecutive writes of one statement go together
                if i == len(queue) or queue[i][0] != queue[start][0]:
                    self._db.executemany(queue[start][0], [values for _, values in queue[start:i]])
                    start = i

    def save_job(self, job: StoredJob) -> None:
        self._write(
            "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?)",
            (job.job_id, spec_to_proto(job.spec).SerializeToString(), job.state, job.generation, job.reason, _world_json(job.world)),
        )

    def save_member(self, job_id: str, m: StoredMember) -> None:
        self._write(
            "INSERT OR REPLACE INTO members VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job_id, m.member_id, m.seq, m.node_key, m.address, m.master_port, m.local_rank, m.node_rank, m.role, int(m.in_world)),
        )

    def delete_member(self, job_id: str, member_id: str) -> None:
        self._write("DELETE FROM members WHERE job_id = ? AND member_id = ?", (job_id, member_id))

    def delete_job(self, job_id: str) -> None:
        self._write("DELETE FROM members WHERE job_id = ?", (job_id,))
        self._write("DELETE FROM jobs WHERE job_id = ?", (job_id,))

    def load(self) -> list[StoredJob]:
        self._commit()
        members: dict[str, list[StoredMember]] = {}
        for row in self._db.execute("SELECT * FROM members ORDER BY seq"):
            job_id, *fields = row
            fields[-1] = bool(fields[-1])
            members.setdefault(job_id, []).append(StoredMember(*fields))
        jobs = []
        for job_id, spec, state, generation, reason, world in self._db.execute("SELECT * FROM jobs ORDER BY job_id"):
            jobs.append(StoredJob(job_id, spec_from_proto(pb.JobSpec.FromString(spec)), state, generation, reason,
                                  _world(world), tuple(members.get(job_id, ()))))
        return jobs

    def close(self) -> None:
        if self._db is not None:
            self._commit()
            self._db.close()
            self._db = None
