"""commctx.elastic and the abort beneath it, piece by piece: which connections
an abort shuts down, what the session's news ends, the guard's verdicts, the
sampler's shares, and the heal's choice of source and receivers in real gloo
worlds. tests/test_elastic_train.py runs them together, end to end."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import pathlib
import socket
import subprocess
import sys

import pytest

from commctx import WorldChanged
from commctx.elastic import Elastic, ElasticSampler
from commctx.registry import GroupRegistry
from commctx.session import Session, WorldChange
from commctx.v1 import rendezvous_pb2 as pb
from commctx.world import World, kept_peers

from .cluster import Proc, running

HEAL_WORKER = str(pathlib.Path(__file__).with_name("heal_worker.py"))


# -- the abort: which connections ----------------------------------------------------------


# The far ends live in another process, as a peer's and the server's do: shut
# down there, they would count as this process's connections too.
FAR_ENDS = """
import select, socket, sys
listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
print(*(l.getsockname()[1] for l in listeners), flush=True)
accepted = []
for line in sys.stdin:
    if line.startswith("accept"):
        accepted.append(listeners[int(line.split()[1])].accept()[0])
        print("ok", flush=True)
    elif line.startswith("check"):  # which connections the other side shut down (EOF)
        shut = []
        for conn in accepted:
            ready, _, _ = select.select([conn], [], [], 0.5)
            shut.append(bool(ready) and conn.recv(1) == b"")
        print(*map(int, shut), flush=True)
"""


@contextlib.contextmanager
def far_ends():
    """A peer's listener and the rendezvous server's, in a child process; connect() returns a connection to one."""
    child = subprocess.Popen([sys.executable, "-c", FAR_ENDS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ports = [int(p) for p in child.stdout.readline().split()]
    mine: list[socket.socket] = []

    def connect(which: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", ports[which]))
        child.stdin.write(f"accept {which}\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ok"
        mine.append(sock)
        return sock

    def shut() -> list[bool]:
        child.stdin.write("check\n")
        child.stdin.flush()
        return [flag == "1" for flag in child.stdout.readline().split()]

    try:
        yield connect, shut, ports
    finally:
        for sock in mine:
            sock.close()
        child.kill()
        child.wait(10)


def test_an_abort_shuts_down_the_worlds_connections_and_nothing_else():
    with far_ends() as (connect, shut, (_, server_port)):
        connect(0)  # open before the world: another library's
        world = World(7, kept_peers([("localhost", server_port)]))
        connect(0)  # opened while the world was built: gloo's
        connect(1)  # the session reconnecting to the rendezvous server meanwhile
        with socket.create_server(("127.0.0.1", 0)) as listening:  # gloo's own listener, opened meanwhile too
            world._entered(GroupRegistry())
            assert world.abort("member 3 expired") and world.aborted == "member 3 expired"
            assert not world.abort("again")  # once
            assert shut() == [False, True, False]  # the world's connection only: a collective blocked on it fails now
            with socket.create_connection(listening.getsockname()):
                listening.accept()[0].close()  # the listener still accepts: shutting it down would crash gloo


def test_an_abort_while_the_world_is_built_shuts_what_it_opened_so_far_and_the_rest_when_built():
    with far_ends() as (connect, shut, _):
        world = World(2, kept_peers([]))
        connect(0)  # e.g. the store's connection, init_process_group blocked after it
        world.abort("generation 3 formed")
        assert shut() == [True]
        connect(0)  # built on regardless
        world._entered(GroupRegistry())
        assert shut() == [True, True]


def test_a_world_left_is_not_aborted():
    world = World(1, kept_peers([]))
    world._entered(GroupRegistry())
    world.leave(GroupRegistry())
    assert not world.abort("too late") and world.aborted == ""


# -- the session's news ---------------------------------------------------------------------


def session_with_world(generation: int) -> tuple[Session, list]:
    session = Session("127.0.0.1:1")
    session._generation = generation  # the session thread's state, set as a join would
    ended: list = []
    session.on_world_ended(lambda before, why: ended.append((before, why)))
    return session, ended


def assignment(generation: int, reason: str = "", lost: bool = False) -> pb.SessionEvent:
    return pb.SessionEvent(assignment=pb.Assignment(job_id="j", generation=generation, rank=0, world_size=1, reason=reason,
                                                    previous_lost=lost))


def test_the_news_that_ends_a_world_and_the_news_that_does_not():
    """A world whose members went without a Leave ends at once; one whose
    members left, or that only grows, runs its collectives to their end."""
    session, ended = session_with_world(4)
    try:
        session._handle(pb.SessionEvent(world_changed=pb.WorldChange(generation=4, reason="2 workers waiting", lost=False)))
        assert ended == [] and not session.next_ready  # it runs on until its assignment comes
        assert session.world_change == WorldChange(4, "2 workers waiting")
        session._handle(assignment(5, "2 workers waiting"))
        assert ended == [] and session.next_ready  # the loop takes it at its next step
        session.next_assignment(1)
        session._handle(assignment(6, "member w left"))
        assert ended == []
        session.next_assignment(1)
        session._handle(pb.SessionEvent(world_changed=pb.WorldChange(generation=6, reason="member x expired", lost=True)))
        assert ended == [(7, "member x expired")]  # at once: a collective may be blocked on it
        session._handle(assignment(7, "member x expired", lost=True))
        assert ended[-1] == (7, "member x expired")
        session.next_assignment(1)
        session._handle(assignment(8, "member v disconnected", lost=True))  # formed at once: the assignment says it
        assert ended[-1] == (8, "member v disconnected")
    finally:
        session.close(leave=False)


@pytest.mark.parametrize(("ended_job", "aborts"), [(False, True), (True, False)])
def test_a_membership_that_is_over_ends_its_world_unless_its_job_finished(ended_job, aborts):
    session, ended = session_with_world(4)
    try:
        assert session._handle(pb.SessionEvent(gone="job 'j' ...", job_ended=ended_job))
        assert ended == ([(math.inf, "job 'j' ...")] if aborts else [])
    finally:
        session.close(leave=False)


def test_a_failure_report_goes_out_with_the_next_message():
    session, _ = session_with_world(3)
    try:
        requests = session._requests()
        assert next(requests).failed_generation == 0
        session.report_failure(3)
        message = next(requests)  # sent at once: the report woke the writer
        assert (message.failed_generation, message.generation) == (3, 3)
        session._stop.set()
        session._wake.put(True)
    finally:
        session.close(leave=False)


# -- the guard ----------------------------------------------------------------------------------


class FakeSession:
    """What the guard asks of a session (a unit test: the real one is in test_elastic_train.py)."""

    lease_ttl_s = 0.05

    def __init__(self, news: WorldChange | None, arrives: bool) -> None:
        self.world_change = news
        self._arrives = arrives
        self.assignment = type("A", (), {"generation": 9})()
        self.reported: list[int] = []

    def report_failure(self, generation: int) -> None:
        self.reported.append(generation)

    def wait_world_change(self, timeout_s: float) -> WorldChange | None:
        if self._arrives:
            self.world_change = WorldChange(9, "member z broke off")
        return self.world_change


def guarded(session: FakeSession) -> Elastic:
    ctx = type("Ctx", (), {"_membership": type("M", (), {"session": session})(), "assignment": None})()
    return Elastic(ctx, state_dict=dict, load_state_dict=lambda s: None)


def test_a_collective_that_failed_because_the_world_changed_raises_world_changed():
    session = FakeSession(WorldChange(9, "member z expired"), arrives=False)
    with pytest.raises(WorldChanged, match="generation 9 changed: member z expired") as caught, guarded(session).guard():
        raise RuntimeError("Connection closed by peer")
    assert isinstance(caught.value, RuntimeError) and str(caught.value.__cause__) == "Connection closed by peer"
    assert caught.value.change.reason == "member z expired" and session.reported == []


def test_a_failure_before_the_news_is_reported_and_the_news_awaited():
    session = FakeSession(None, arrives=True)
    with pytest.raises(WorldChanged, match="broke off"), guarded(session).guard():
        raise RuntimeError("Connection reset by peer")
    assert session.reported == [9]


def test_errors_that_are_not_the_worlds_pass_unchanged():
    session = FakeSession(None, arrives=False)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as caught, guarded(session).guard():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert type(caught.value) is RuntimeError and session.reported == [9]  # no news within the wait
    session = FakeSession(WorldChange(9, "member z expired"), arrives=False)
    with pytest.raises(KeyError), guarded(session).guard():
        raise KeyError("not a collective's")


def test_elastic_needs_callables():
    with pytest.raises(TypeError, match="callables"):
        Elastic(None, state_dict={}, load_state_dict=None)


# -- the sampler ---------------------------------------------------------------------------------


def joined(lists) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_a_step_holds_the_same_samples_at_any_world_size(world):
    sampler = ElasticSampler(100, 32, seed=5)
    for step in (0, 1, 2, 3, 17):
        shares = [sampler.indices(step, r, world) for r in range(world)]
        assert max(map(len, shares)) - min(map(len, shares)) <= 1  # near-equal
        assert joined(shares) == joined(sampler.indices(step, r, 2) for r in range(2))


def test_the_sampler_walks_whole_epochs_in_a_seeded_order():
    sampler = ElasticSampler(10, 4, seed=1)
    stream = joined(sampler.indices(step, 0, 1) for step in range(5))  # 20 positions: epochs 0 and 1
    assert sorted(stream[:10]) == list(range(10)) == sorted(stream[10:])
    assert stream[:10] != stream[10:]  # each epoch its own order
    assert stream == joined(ElasticSampler(10, 4, seed=1).indices(step, 0, 1) for step in range(5))  # anywhere
    assert ElasticSampler(10, 4, shuffle=False).indices(2, 1, 2) == [0, 1]  # positions 8, 9 / 10, 11: the wrap


@pytest.mark.parametrize("args", [(0, 4), (10, 0), (10, True), (2.5, 4)])
def test_the_sampler_refuses_sizes_that_cannot_be(args):
    with pytest.raises(ValueError, match="positive integer"):
        ElasticSampler(*args)


def test_the_sampler_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 3 is not in a world of 3"):
        ElasticSampler(10, 4).indices(0, 3, 3)


# -- the heal, in real gloo worlds of three processes ---------------------------------------------


def heal(tmp_path, case: list[dict]) -> list[dict]:
    """Runs tests/heal_worker.py as ranks 0..n-1: each starts from its row of
    `case` ({"holds", "step", "value"}), heals, and reports what it holds."""
    init = f"file://{tmp_path}/store"
    procs = [Proc([HEAL_WORKER, init, str(rank), json.dumps(case)], f"heal-{rank}", fork={"netns": None, "hostname": None})
             for rank in range(len(case))]
    with running(procs):
        return [p.event(60) for p in procs]


def test_a_first_world_takes_rank_0s_state(tmp_path):
    out = heal(tmp_path, [{"holds": False, "step": 0, "value": 10.0 + r} for r in range(3)])
    assert [o["value"] for o in out] == [10.0] * 3 and [o["step"] for o in out] == [0] * 3
    assert {(o["source"], tuple(o["receivers"])) for o in out} == {(0, (1, 2))}
    assert out[0]["nbytes"] == out[1]["nbytes"] > 0  # one broadcast


def test_a_newcomer_gets_the_state_and_the_step_and_the_other_survivor_pays_nothing(tmp_path):
    out = heal(tmp_path, [{"holds": True, "step": 40, "value": 1.5}, {"holds": True, "step": 40, "value": 1.5},
                          {"holds": False, "step": 0, "value": -7.0}])
    assert [o["value"] for o in out] == [1.5] * 3 and [o["step"] for o in out] == [40] * 3
    assert [(o["source"], o["receivers"]) for o in out] == [(0, [2])] * 3
    assert [o["nbytes"] > 0 for o in out] == [True, False, True]  # rank 1 sent and received nothing


def test_survivors_a_step_apart_take_the_state_of_the_one_ahead(tmp_path):
    """One survivor completed the step's all_reduce and update before the
    abort reached it, the others did not: the one ahead is the source."""
    out = heal(tmp_path, [{"holds": True, "step": 12, "value": 2.0}, {"holds": True, "step": 13, "value": 3.0},
                          {"holds": True, "step": 12, "value": 2.0}])
    assert [o["value"] for o in out] == [3.0] * 3 and [o["step"] for o in out] == [13] * 3
    assert [(o["source"], o["receivers"]) for o in out] == [(1, [0, 2])] * 3


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
