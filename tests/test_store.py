"""Contract tests every store passes: memory, SQLite (and any future one)."""

from __future__ import annotations

import pytest

from commctx.server.assignment import MemberSpec
from commctx.server.spec import spec_from_proto
from commctx.server.store import MemoryStore, SqliteStore, StoredJob, StoredMember
from commctx.v1 import rendezvous_pb2 as pb


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request, tmp_path):
    """A factory: calling it again reopens the same store (a restart)."""
    opened = []

    def make():
        s = MemoryStore() if request.param == "memory" else SqliteStore(tmp_path / "state")
        opened.append(s)
        return s

    if request.param == "memory":  # memory survives only within the process: share one
        shared = make()
        yield lambda: shared
    else:
        yield make
    for s in opened:
        s.close()


SPEC = spec_from_proto(pb.JobSpec(world_size=2, layout=pb.ParallelLayout(tp=2), elastic=pb.Elastic(min_size=2, last_call_ms=250)))
WORLD = (MemberSpec("m1", "a", "10.0.0.1", 5000, None, None, "trainer", 0, 1), MemberSpec("m2", "a", "10.0.0.1", 5001, 1, 0, "", None, None))


def member(mid: str, seq: int, in_world: bool = True) -> StoredMember:
    return StoredMember(mid, seq, "a", "10.0.0.1", 5000 + seq, None, None, "", in_world)


def test_roundtrip(make_store):
    s = make_store()
    s.save_job(StoredJob("j", SPEC, "formed", 3, "", WORLD))
    s.save_member("j", member("m2", 2))
    s.save_member("j", member("m1", 1))
    s.save_job(StoredJob("k", spec_from_proto(pb.JobSpec(world_size=1)), "forming", 0, "", ()))
    s.close()
    loaded = make_store().load()
    assert [j.job_id for j in loaded] == ["j", "k"]
    j = loaded[0]
    assert (j.spec, j.state, j.generation, j.reason, tuple(j.world)) == (SPEC, "formed", 3, "", WORLD)
    assert [m.member_id for m in j.members] == ["m1", "m2"]  # join order
    assert j.members[0] == member("m1", 1)
    assert loaded[1].members == ()


def test_updates_and_deletes(make_store):
    s = make_store()
    s.save_job(StoredJob("j", SPEC, "forming", 1, "", WORLD))
    s.save_member("j", member("m1", 1))
    s.save_member("j", member("m2", 2))
    s.save_member("j", member("m2", 2, in_world=False))  # replaces
    s.save_job(StoredJob("j", SPEC, "failed", 1, "why", ()))
    s.delete_member("j", "m1")
    s.delete_member("j", "nope")  # absent: no error
    s.save_job(StoredJob("gone", SPEC, "forming", 0, "", ()))
    s.save_member("gone", member("g", 3))
    s.delete_job("gone")
    (j,) = make_store().load()
    assert (j.state, j.reason, tuple(j.world)) == ("failed", "why", ())
    assert j.members == (member("m2", 2, in_world=False),)
