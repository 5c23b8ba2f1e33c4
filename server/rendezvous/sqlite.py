"""The SQLite store: one file under the state directory, in WAL mode.

Schema version 6 (`PRAGMA user_version`), named columns throughout; specs and
seats are JSON objects with named fields (store.py); members keep the
SHA-256 digest of their secret, and a host membership its workers (JSON);
each job's history is a table of events. Older files are migrated in place
when opened: version 5 (no host memberships), 4 (no events), 3 (no
node memberships, forming times or kept failed jobs), 2 (no member secrets)
and 1 (the first release's: the spec as the wire message's bytes, worlds as
positional JSON tuples).

One state directory, one server: the store holds an exclusive, non-blocking
`flock` on `commctx.lock` in the directory for as long as it is open (the
file records the holder's PID and host). A second store on the same directory,
in another server or in this process, fails at once with a StoreError naming
the directory and that PID; once the holder is gone (closed, or dead: the
kernel releases its lock) a new one starts at once. The lock guards against
the common mistake (two servers on one --state-dir); the epoch below still
guards the writes (a directory shared where flock does not reach, a lock
bypassed).

Fencing: the `writer` table holds the current epoch. `take_over` increments
it; every commit runs as `BEGIN IMMEDIATE` (SQLite's write lock), checks the
epoch it was given, and writes only if it is still the current one, so a
server that another has replaced on the same file learns so from its next
write.

synchronous=NORMAL: a commit is durable against the process being killed
(kill -9), which is what a restart needs; against power loss the last
commits before the failure may be lost (the members then re-join).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import socket
import sqlite3
import threading
from collections.abc import Callable, Sequence

from commctx.common.planning import Candidate, JobSpec, PlanError, seat

from .model import JobEvent
from .store import (
    DeleteJob,
    DeleteMember,
    Fenced,
    JobRecord,
    MemberRecord,
    PutEvent,
    PutJob,
    PutMember,
    Store,
    StoreError,
    TrimEvents,
    Write,
    event_fields_json,
    event_of,
    seats_from_record,
    seats_record,
    spec_from_json,
    spec_json,
)

SCHEMA_VERSION = 7
FILE_NAME = "commctx.sqlite3"
LOCK_NAME = "commctx.lock"

_SCHEMA = """
    CREATE TABLE writer (id INTEGER PRIMARY KEY CHECK (id = 1), epoch INTEGER NOT NULL);
    INSERT INTO writer VALUES (1, 0);
    CREATE TABLE jobs (
        job_id TEXT PRIMARY KEY, state TEXT NOT NULL, generation INTEGER NOT NULL,
        reason TEXT NOT NULL, spec TEXT NOT NULL, world TEXT, secret TEXT NOT NULL DEFAULT '',
        since REAL NOT NULL DEFAULT 0, retained_until REAL NOT NULL DEFAULT 0,
        run INTEGER NOT NULL DEFAULT 1, started REAL NOT NULL DEFAULT 0, ended REAL NOT NULL DEFAULT 0);
    CREATE TABLE members (
        job_id TEXT NOT NULL, member_id TEXT NOT NULL, seq INTEGER NOT NULL,
        node_key TEXT NOT NULL, address TEXT NOT NULL, port INTEGER NOT NULL,
        local_rank INTEGER, node_rank INTEGER, role TEXT NOT NULL,
        secret TEXT NOT NULL DEFAULT '', workers INTEGER NOT NULL DEFAULT 1, slots TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (job_id, member_id));
"""
_EVENTS_TABLE = """
    CREATE TABLE events (
        job_id TEXT NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL,
        generation INTEGER NOT NULL, message TEXT NOT NULL, fields TEXT NOT NULL,
        PRIMARY KEY (job_id, seq))
"""
_SCHEMA += _EVENTS_TABLE

_PUT_JOB = ("INSERT OR REPLACE INTO jobs (job_id, state, generation, reason, spec, world, secret, since, retained_until, "
            "run, started, ended) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
_PUT_MEMBER = (
    "INSERT OR REPLACE INTO members (job_id, member_id, seq, node_key, address, port, local_rank, node_rank, role, secret, workers, "
    "slots) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_DELETE_MEMBER = "DELETE FROM members WHERE job_id = ? AND member_id = ?"
_PUT_EVENT = "INSERT OR REPLACE INTO events (job_id, seq, time, kind, generation, message, fields) VALUES (?, ?, ?, ?, ?, ?, ?)"


def lock_directory(directory: pathlib.Path) -> int:
    """Takes the state directory's lock: an exclusive, non-blocking flock on
    its lock file, recording this process's PID and host in it. Returns the
    file's descriptor, which holds the lock until it is closed.

    flock belongs to the open file description, so a second open of the file
    in this same process conflicts too; a holder that dies releases it.

    Raises:
        StoreError: another holder has it (named by the PID it recorded).
        OSError: the lock file cannot be opened or written.
    """
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise StoreError(f"state directory {directory} is in use by {_holder(fd)}; "
                             f"give another --state-dir, or stop that one") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _holder(fd: int) -> str:
    """Who holds the lock, as its file records it: 'commctx-server pid 1234
    (another server)', with its host when that is another one."""
    try:
        recorded = os.pread(fd, 512, 0).decode("utf-8", "replace").split()
    except OSError:
        recorded = []
    if not recorded or not recorded[0].isdigit():
        return "another commctx-server (its pid not recorded yet)"
    pid, host = recorded[0], recorded[1] if len(recorded) > 1 else ""
    if host and host != socket.gethostname():
        return f"commctx-server pid {pid} on host {host[:64]} (another server)"
    if pid == str(os.getpid()):
        return f"commctx-server pid {pid} (this process: another store on it is open)"
    return f"commctx-server pid {pid} (another server)"


class SqliteStore(Store):
    """SQLite in WAL mode at `state_dir`/commctx.sqlite3."""

    blocking = True

    def __init__(self, state_dir: str | pathlib.Path, *,
                 lock: Callable[[pathlib.Path], int | None] = lock_directory) -> None:
        """Locks the state directory, then opens (creating or migrating) the database.

        Args:
            lock: takes the directory's lock and returns the descriptor that
                holds it until the store closes (None: it holds nothing). One
                that holds nothing opens a second writer on a file, which only
                the epoch then fences.

        Raises:
            StoreError: the directory is in use by another store (the message
                names the directory and the holder's PID), or the directory
                or database cannot be used (the message names the path).
        """
        directory = pathlib.Path(state_dir)
        self.path = directory / FILE_NAME
        self._lock = threading.Lock()  # commits run in a worker thread; one at a time
        self._db: sqlite3.Connection | None = None
        self._dir_lock: int | None = None  # the locked file's descriptor, held open while the store is
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._dir_lock = lock(directory)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._open_schema()
        except BaseException as exc:
            self.close()
            if isinstance(exc, (OSError, sqlite3.Error)):
                raise StoreError(f"cannot use the state database {self.path}: {exc}") from exc
            raise

    def _open_schema(self) -> None:
        db = self._db
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path} has schema version {version}; this server reads up to {SCHEMA_VERSION}")
        db.execute("BEGIN IMMEDIATE")
        try:
            if version in (2, 3, 4, 5, 6):
                if version == 2:
                    _migrate_v2(db)
                if version <= 3:
                    _migrate_v3(db)
                if version <= 4:
                    _migrate_v4(db)
                if version <= 5:
                    _migrate_v5(db)
                _migrate_v6(db)
            elif "jobs" in tables:
                _migrate_v1(db)
            else:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def take_over(self) -> int:
        with self._lock:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            db.execute("UPDATE writer SET epoch = epoch + 1")
            (epoch,) = db.execute("SELECT epoch FROM writer").fetchone()
            db.execute("COMMIT")
            return epoch

    def commit(self, writes: Sequence[Write], epoch: int) -> None:
        with self._lock:
            db = self._connection()
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"cannot write {self.path}: {exc}") from exc
            try:
                (current,) = db.execute("SELECT epoch FROM writer").fetchone()
                if current != epoch:
                    raise Fenced(f"{self.path}: epoch {epoch} was fenced by epoch {current}")
                _apply(db, writes)
                db.execute("COMMIT")
            except BaseException as exc:
                with contextlib.suppress(sqlite3.Error):  # a failed COMMIT may have rolled back already
                    db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"cannot write {self.path}: {exc}") from exc
                raise

    def load(self) -> list[JobRecord]:
        with self._lock:
            db = self._connection()
            members: dict[str, list[MemberRecord]] = {}
            rows = db.execute(
                "SELECT job_id, member_id, seq, node_key, address, port, local_rank, node_rank, role, secret, workers, slots "
                "FROM members ORDER BY seq")
            for job_id, *fields, slots in rows:
                members.setdefault(job_id, []).append(MemberRecord(*fields, tuple(map(tuple, json.loads(slots))) if slots else ()))
            events: dict[str, list[JobEvent]] = {}
            for job_id, *fields in db.execute(
                    "SELECT job_id, seq, time, kind, generation, message, fields FROM events ORDER BY job_id, seq"):
                events.setdefault(job_id, []).append(event_of(*fields))
            jobs = []
            for job_id, state, generation, reason, spec, world, seal, since, until, run, started, ended in db.execute(
                    "SELECT job_id, state, generation, reason, spec, world, secret, since, retained_until, run, started, ended "
                    "FROM jobs ORDER BY job_id"):
                jobs.append(JobRecord(
                    job_id, spec_from_json(spec), state, generation, reason,
                    seats_from_record(json.loads(world)) if world else None, tuple(members.get(job_id, ())), seal,
                    since, until, tuple(events.get(job_id, ())), run, started, ended,
                ))
            return jobs

    def close(self) -> None:
        """Closes the database, then releases the state directory. Idempotent."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            if self._dir_lock is not None:
                os.close(self._dir_lock)  # releases the flock (held by this open file alone)
                self._dir_lock = None

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError(f"{self.path} is closed")
        return self._db


def _apply(db: sqlite3.Connection, writes: Sequence[Write]) -> None:
    """Executes `writes` in order; consecutive writes of one kind go as one executemany."""
    start = 0
    for i in range(1, len(writes) + 1):
        if i < len(writes) and type(writes[i]) is type(writes[start]):
            continue
        run = writes[start:i]
        kind = type(run[0])
        if kind is PutMember:
            db.executemany(_PUT_MEMBER, [(w.job_id, *w.record[:-1], _slots_json(w.record.slots)) for w in run])
        elif kind is PutJob:
            db.executemany(_PUT_JOB, [_job_row(w.record) for w in run])
        elif kind is DeleteMember:
            db.executemany(_DELETE_MEMBER, run)
        elif kind is DeleteJob:
            db.executemany("DELETE FROM members WHERE job_id = ?", [(w.job_id,) for w in run])
            db.executemany("DELETE FROM events WHERE job_id = ?", [(w.job_id,) for w in run])
            db.executemany("DELETE FROM jobs WHERE job_id = ?", [(w.job_id,) for w in run])
        elif kind is PutEvent:
            db.executemany(_PUT_EVENT, [(w.job_id, e.seq, e.time, e.kind, e.generation, e.message, event_fields_json(e))
                                        for w in run for e in (w.event,)])
        elif kind is TrimEvents:
            db.executemany("DELETE FROM events WHERE job_id = ? AND seq < ?", run)
        start = i


def _job_row(job: JobRecord) -> tuple:
    world = json.dumps(seats_record(job.world), separators=(",", ":")) if job.world is not None else None
    return (job.job_id, job.state, job.generation, job.reason, spec_json(job.spec), world, job.seal, job.since, job.retained_until,
            job.run, job.started, job.ended)


def _slots_json(slots: tuple) -> str:
    return json.dumps([list(s) for s in slots], separators=(",", ":")) if slots else ""


def _migrate_v2(db: sqlite3.Connection) -> None:
    """Schema 2 -> 3, inside the caller's transaction: members gain the digest
    of their secret, jobs the digest of their job secret; those of schema 2
    have none ('': members renew without one, jobs are open)."""
    db.execute("ALTER TABLE members ADD COLUMN secret TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE jobs ADD COLUMN secret TEXT NOT NULL DEFAULT ''")


def _migrate_v3(db: sqlite3.Connection) -> None:
    """Schema 3 -> 4, inside the caller's transaction: members gain their
    number of workers (a launcher's node membership holds several); jobs when
    they began forming (0: unknown) and, failed ones kept after their workers
    left, until when."""
    db.execute("ALTER TABLE members ADD COLUMN workers INTEGER NOT NULL DEFAULT 1")
    db.execute("ALTER TABLE jobs ADD COLUMN since REAL NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE jobs ADD COLUMN retained_until REAL NOT NULL DEFAULT 0")


def _migrate_v4(db: sqlite3.Connection) -> None:
    """Schema 4 -> 5, inside the caller's transaction: each job's history of
    events (the jobs of schema 4 start with none)."""
    db.execute(_EVENTS_TABLE)


def _migrate_v5(db: sqlite3.Connection) -> None:
    """Schema 5 -> 6, inside the caller's transaction: members gain a host
    membership's workers (those of schema 5 are none)."""
    db.execute("ALTER TABLE members ADD COLUMN slots TEXT NOT NULL DEFAULT ''")


def _migrate_v6(db: sqlite3.Connection) -> None:
    """Schema 6 -> 7, inside the caller's transaction: jobs gain their run
    number and when the run began and ended (those of schema 6 are run 1,
    times unknown)."""
    for column in ("run INTEGER NOT NULL DEFAULT 1", "started REAL NOT NULL DEFAULT 0", "ended REAL NOT NULL DEFAULT 0"):
        db.execute(f"ALTER TABLE jobs ADD COLUMN {column}")


def _migrate_v1(db: sqlite3.Connection) -> None:
    """Schema 1 -> the current one, inside the caller's transaction.

    Version 1 stored each spec as the wire message's bytes and each world as
    the planner's input (positional tuples); later versions store named fields
    and the seats themselves. Only this migration reads the wire format, so its
    message is imported here, not at module level.
    """
    from google.protobuf import json_format

    from commctx.v1 import rendezvous_pb2 as pb

    old_members = db.execute(
        "SELECT job_id, member_id, seq, node_key, address, master_port, local_rank, node_rank, role FROM members").fetchall()
    old_jobs = db.execute("SELECT job_id, spec, state, generation, reason, world FROM jobs").fetchall()
    db.execute("DROP TABLE members")
    db.execute("DROP TABLE jobs")
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)
    consumed: set[tuple[str, str]] = set()  # (job, member) whose port rank 0's TCPStore holds
    jobs = []
    for job_id, spec_bytes, state, generation, reason, world_json in old_jobs:
        message = pb.JobSpec.FromString(spec_bytes)
        spec = JobSpec.from_json(json_format.MessageToDict(message, preserving_proto_field_name=True))
        inputs = [Candidate(*fields) for fields in json.loads(world_json)]
        world = None
        if inputs:
            try:
                world = seat(inputs, spec.at_size(len(inputs)))
            except PlanError as exc:  # it formed once, so this cannot happen unless the file was edited
                raise StoreError(f"job {job_id!r}: its stored world no longer seats: {exc}") from exc
            consumed.add((job_id, world.nodes[0].members[0]))
        jobs.append(_job_row(JobRecord(job_id, spec, state, generation, reason, world)))
    db.executemany(_PUT_JOB, jobs)
    db.executemany(_PUT_MEMBER, [
        (job_id, member_id, seq, node_key, address, 0 if (job_id, member_id) in consumed else port, local_rank, node_rank, role, "", 1,
         "")
        for job_id, member_id, seq, node_key, address, port, local_rank, node_rank, role in old_members
    ])
