"""Chaos history checker: reads a recorded history of calls, pushed events,
faults and leadership terms, and reports every violated invariant with the
records that show it. Pure: no processes, no network.

A chaos runner (tests/test_chaos.py; a later one with partitions, SIGSTOP and
netem) records every call with its answer, the client host, the replica that
answered and its start/end (monotonic seconds), and hands the History to
`check`. The invariants (names as reported):

  unique_rank      no two members hold the same rank of a job in one generation (of one run)
  one_world        no two records tell different worlds for one job, run and generation
  monotonic_gen    a member's generations never go backwards in real time
  leave_final      no answered Leave comes back
  join_kept        no completed Join is lost from the final state (probes)
  one_writer       answered writes follow the leadership order (epochs)
  convergence      after the last fault heals, each job is FORMED with its
                   live members within election TTL + lease TTL + 2 s
  no_minority      a replica cut off from etcd answers nothing as leader
                   later than its election TTL after the cut

--self-test plants one violation of each invariant in a small history (and
checks one clean history) and exits non-zero unless every plant is caught
and the clean history passes.

    python benchmarks/chaos_history.py --self-test
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import hashlib
import sys
from collections.abc import Iterable

INVARIANTS = ("unique_rank", "one_world", "monotonic_gen", "leave_final", "join_kept", "one_writer",
              "convergence", "no_minority")
WRITES = ("join", "keepalive", "leave")  # calls the leader applies to the store
LEADER_ANSWERS = ("join", "keepalive", "leave", "describe")  # answered only by a replica that leads
CUTS = ("etcd_cut", "isolate")  # fault kinds that cut their target replicas off from etcd


def world_digest(members: Iterable[str], *shape: object) -> str:
    """A short digest of a world: its members in rank order and anything else every member must agree on."""
    return hashlib.sha256(repr((tuple(members), shape)).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Op:
    """One call with its answer, or one pushed event (kind "event", start = end = when received).

    kind: join | keepalive | leave | describe | event | probe (a KeepAlive of the final-state check,
    after every fault healed). ok: answered without error; error: the status code name otherwise
    ("NOT_FOUND", "UNAVAILABLE", ...). generation/rank/node_rank: the assignment answered (a KeepAlive
    answers a generation). world: a digest of the world told (world_digest), members: the world's
    members where known (describe, event); state: a describe's job state ("FORMED", ...).
    epoch: the leader epoch (election revision) of the replica that answered a write, where known.
    A world is named by (job, run, generation)."""

    id: int
    kind: str
    job: str
    member: str = ""
    host: str = ""
    replica: str = ""
    start: float = 0.0
    end: float = 0.0
    ok: bool = True
    error: str = ""
    generation: int | None = None
    rank: int | None = None
    node_rank: int | None = None
    world: str = ""
    members: tuple[str, ...] | None = None
    state: str = ""
    epoch: int | None = None
    run: int = 0  # the run of the job (a job id names one run at a time; generations count within it)


@dataclasses.dataclass(frozen=True)
class Fault:
    """A fault the nemesis injected: kind (kill, pause, partition, netem, etcd_cut, isolate, ...), the
    replicas or hosts it hit, and when; end None: never healed."""

    id: int
    kind: str
    targets: tuple[str, ...]
    start: float
    end: float | None


@dataclasses.dataclass(frozen=True)
class Term:
    """A leadership term, where known: `replica` led with `epoch` from `start` to `end` (None: still)."""

    replica: str
    epoch: int
    start: float
    end: float | None = None


@dataclasses.dataclass
class History:
    ops: list[Op] = dataclasses.field(default_factory=list)
    faults: list[Fault] = dataclasses.field(default_factory=list)
    terms: list[Term] = dataclasses.field(default_factory=list)
    election_ttl_s: float = 5.0
    lease_ttl_s: float = 10.0
    min_size: dict[str, int] = dataclasses.field(default_factory=dict)  # job -> the fewest members it forms with (1)
    live: dict[str, frozenset[str]] | None = None  # job -> its live members after the heal; None: derived
    checks_convergence: bool = True


@dataclasses.dataclass(frozen=True)
class Violation:
    invariant: str
    ids: tuple[int, ...]  # the records (Op.id, Fault.id) that show it
    reason: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.reason} (records {', '.join(map(str, self.ids))})"


@dataclasses.dataclass
class Report:
    violations: list[Violation]
    convergence_s: dict[str, float | None]  # job -> seconds from the heal until FORMED with its live members

    def invariants(self) -> set[str]:
        return {v.invariant for v in self.violations}


def check(history: History) -> Report:
    ops = sorted(history.ops, key=lambda o: (o.end, o.id))
    found: list[Violation] = []
    found += unique_rank(ops)
    found += one_world(ops)
    found += monotonic_gen(ops)
    found += leave_final(ops)
    found += join_kept(ops, history.lease_ttl_s)
    found += one_writer(ops, history.terms)
    converged: dict[str, float | None] = {}
    if history.checks_convergence:
        problems, converged = convergence(ops, history)
        found += problems
    found += no_minority(ops, history.faults, history.election_ttl_s)
    return Report(found, converged)


def unique_rank(ops: list[Op]) -> list[Violation]:
    """Rule: among answered records with a rank, (job, run, generation, rank) maps to one member."""
    holder: dict[tuple[str, int, int, int], Op] = {}
    out = []
    for o in ops:
        if not o.ok or o.rank is None or o.generation is None or not o.member:
            continue
        first = holder.setdefault((o.job, o.run, o.generation, o.rank), o)
        if first.member != o.member:
            out.append(Violation("unique_rank", (first.id, o.id), f"rank {o.rank} of {o.job} generation {o.generation} "
                                 f"given to {first.member} and {o.member}"))
    return out


def one_world(ops: list[Op]) -> list[Violation]:
    """Rule: among answered records with a world digest, (job, run, generation) maps to one digest."""
    told: dict[tuple[str, int, int], Op] = {}
    out, reported = [], set()
    for o in ops:
        if not o.ok or not o.world or o.generation is None:
            continue
        first = told.setdefault((o.job, o.run, o.generation), o)
        if first.world != o.world and (o.job, o.run, o.generation) not in reported:
            reported.add((o.job, o.run, o.generation))
            out.append(Violation("one_world", (first.id, o.id), f"{o.job} generation {o.generation}: "
                                 f"{first.member or first.kind} told world {first.world}, {o.member or o.kind} {o.world}"))
    return out


def monotonic_gen(ops: list[Op]) -> list[Violation]:
    """Rule: for one member, an answered call that starts after another answered call ended answers a
    generation no lower (overlapping calls are not ordered)."""
    out = []
    for member, mine in by_member(ops).items():
        done = sorted((o for o in mine if o.ok and o.generation is not None), key=lambda o: o.end)
        ends = [o.end for o in done]
        best: list[Op] = []  # best[i]: the highest generation among done[: i + 1]
        for o in done:
            best.append(o if not best or o.generation > best[-1].generation else best[-1])
        for o in done:
            i = bisect.bisect_left(ends, o.start)  # done[:i] ended before o started
            if i and best[i - 1].generation > o.generation:
                b = best[i - 1]
                out.append(Violation("monotonic_gen", (b.id, o.id), f"{member} of {o.job}: generation "
                                     f"{b.generation} answered, then {o.generation}"))
                break
    return out


def left_at(ops: list[Op]) -> dict[str, Op]:
    """member -> its first answered Leave (ok, or NOT_FOUND: a retry finding its first try applied)."""
    out: dict[str, Op] = {}
    for o in ops:
        if o.kind == "leave" and (o.ok or o.error == "NOT_FOUND") and o.member not in out:
            out[o.member] = o
    return out


def leave_final(ops: list[Op]) -> list[Violation]:
    """Rule: after a member's Leave was answered, no Join, KeepAlive or probe of it that starts later is
    answered OK, and no describe that starts later lists it (member ids are one per incarnation)."""
    left, out = left_at(ops), []
    for o in ops:
        if not o.ok:
            continue
        if o.kind in ("join", "keepalive", "probe") and o.member in left and o.start > left[o.member].end:
            out.append(Violation("leave_final", (left[o.member].id, o.id), f"{o.member} of {o.job} answered Leave "
                                 f"but a later {o.kind} was answered (generation {o.generation})"))
        elif o.kind == "describe" and o.members:
            back = [m for m in o.members if m in left and o.start > left[m].end]
            if back:
                out.append(Violation("leave_final", (left[back[0]].id, o.id), f"{back[0]} of {o.job} answered Leave "
                                     f"but a later describe lists it"))
    return out


def join_kept(ops: list[Op], lease_ttl_s: float) -> list[Violation]:
    """Rule: a member with an answered Join and no answered Leave is found by its last probe, unless its
    lease ran out: the first call that found it gone (a renewal answering NOT_FOUND, else the failed probe)
    ended 0.9 lease TTL or more after the last call before it that renewed it started (an answered
    KeepAlive or probe, or its Join: whose lease starts when its world formed, no later than the first
    answer of that world to anyone); or a call answered RUN_ENDED (the run it was in ended: FAILED, ENDED or CLOSED, and
    every member with it); or it tried to Leave (unanswered, it stops renewing, as a worker that exited)."""
    left, out = left_at(ops), []
    told: dict[tuple[str, int, int], float] = {}  # a world -> when anyone first heard of it
    for o in ops:
        if o.ok and o.kind in ("join", "event") and o.generation is not None:
            key = (o.job, o.run, o.generation)
            told[key] = min(told.get(key, o.end), o.end)
    for member, mine in by_member(ops).items():
        joined = next((o for o in mine if o.kind == "join" and o.ok), None)
        probes = [o for o in mine if o.kind == "probe"]
        if joined is None or not probes or member in left or probes[-1].ok \
                or any(o.error == "RUN_ENDED" or o.kind == "leave" for o in mine):
            continue
        gone = next((o for o in mine if o.kind == "keepalive" and o.error == "NOT_FOUND"), probes[-1])
        # The server renewed at some time within a KeepAlive's call, and had found the member gone by
        # the end of `gone`'s: only a removal before the renewal's start + TTL is surely early (a slow
        # answer does not lengthen the lease it brings back).
        renewed = [told.get((o.job, o.run, o.generation), o.end) if o.kind == "join" else o.start
                   for o in mine if o.ok and o.kind in ("join", "keepalive", "probe") and o.end <= gone.start]
        quiet = gone.end - max(renewed, default=joined.end)
        if quiet < lease_ttl_s * 0.9:
            out.append(Violation("join_kept", (joined.id, probes[-1].id), f"{member} of {joined.job} completed its Join "
                                 f"but the final state lacks it: {probes[-1].error} (found gone {quiet:.1f} s after "
                                 f"its last renewal)"))
    return out


def one_writer(ops: list[Op], terms: list[Term]) -> list[Violation]:
    """Rules, over answered writes with an epoch: (a) one epoch, one replica; (c) no write starts after a
    write with a higher epoch completed; (d) with terms known: a write's epoch is its replica's term, and
    it starts before that term ended. (An answer written in one term may reach its caller after the same
    replica began the next: completions alone are not ordered by epoch.)"""
    writes = [o for o in ops if o.ok and o.kind in WRITES and o.epoch is not None]
    out: list[Violation] = []
    owner: dict[int, Op] = {}
    for o in writes:  # in the order of completion
        first = owner.setdefault(o.epoch, o)
        if first.replica != o.replica:
            out.append(Violation("one_writer", (first.id, o.id), f"epoch {o.epoch} answered writes at two replicas, "
                                 f"{first.replica} and {o.replica}"))
    ends = [o.end for o in writes]
    best: list[Op] = []
    for o in writes:
        best.append(o if not best or o.epoch > best[-1].epoch else best[-1])
    for o in writes:
        i = bisect.bisect_left(ends, o.start)
        if i and best[i - 1].epoch > o.epoch:
            b = best[i - 1]
            out.append(Violation("one_writer", (b.id, o.id), f"{o.replica} accepted a {o.kind} with epoch {o.epoch} "
                                 f"after {b.replica}'s write with epoch {b.epoch} completed"))
    term_of = {(t.replica, t.epoch): t for t in terms}
    holder = {t.epoch: t.replica for t in terms}
    for o in writes if terms else ():
        t = term_of.get((o.replica, o.epoch))
        if t is None and o.epoch in holder:
            out.append(Violation("one_writer", (o.id,), f"{o.replica} answered a {o.kind} with epoch {o.epoch}, "
                                 f"{holder[o.epoch]}'s term"))
        elif t is not None and t.end is not None and o.start > t.end:
            out.append(Violation("one_writer", (o.id,), f"{o.replica} answered a {o.kind} that started {o.start - t.end:.2f} s "
                                 f"after its term (epoch {o.epoch}) ended"))
    return out


def convergence(ops: list[Op], history: History) -> tuple[list[Violation], dict[str, float | None]]:
    """Rule: once every fault has healed (the latest fault end, H), each job with at least min_size live
    members is seen FORMED with exactly its live members (a describe starting at or after H, or an event
    received after H) by H + election TTL + lease TTL + 2 s. Live members: History.live, else members
    with an answered Join and no Leave tried. No fault, or one never healed: not checked."""
    if not history.faults or any(f.end is None for f in history.faults):
        return [], {}
    healed = max(f.end for f in history.faults)
    bound = history.election_ttl_s + history.lease_ttl_s + 2.0
    live = history.live
    if live is None:
        gone = {o.member for o in ops if o.kind == "leave"}
        members: dict[str, set[str]] = collections.defaultdict(set)
        for o in ops:
            if o.kind == "join" and o.ok and o.member not in gone:
                members[o.job].add(o.member)
        live = {job: frozenset(m) for job, m in members.items()}
    last_fault = max(history.faults, key=lambda f: f.end).id
    out, times = [], {}
    for job, want in sorted(live.items()):
        if not want or len(want) < history.min_size.get(job, 1):
            continue
        seen = next((o for o in ops if o.job == job and o.ok and o.members is not None
                     and ((o.kind == "describe" and o.start >= healed and o.state == "FORMED")
                          or (o.kind == "event" and o.end >= healed))
                     and frozenset(o.members) == want), None)
        times[job] = None if seen is None else seen.end - healed
        if seen is None or seen.end - healed > bound:
            last = [o.id for o in ops if o.job == job and o.members is not None][-1:]
            out.append(Violation("convergence", (last_fault, *(last if seen is None else [seen.id])),
                                 f"{job} not FORMED with its {len(want)} live members within {bound:g} s of the heal"
                                 + ("" if seen is None else f" (took {seen.end - healed:.1f} s)")))
    return out, times


def no_minority(ops: list[Op], faults: list[Fault], election_ttl_s: float) -> list[Violation]:
    """Rule: for a fault cutting replica R off from etcd over [s, e], no Join, KeepAlive, Leave or describe
    answered OK by R both starts at or after s + election TTL and ends by e."""
    out = []
    for f in faults:
        if f.kind not in CUTS:
            continue
        end = float("inf") if f.end is None else f.end
        for o in ops:
            if o.ok and o.kind in LEADER_ANSWERS and o.replica in f.targets and o.start >= f.start + election_ttl_s \
                    and o.end <= end:
                out.append(Violation("no_minority", (f.id, o.id), f"{o.replica}, cut off from etcd at {f.start:.1f}, "
                                     f"answered a {o.kind} of {o.job} at {o.end:.1f}"))
    return out


def by_member(ops: list[Op]) -> dict[str, list[Op]]:
    out: dict[str, list[Op]] = collections.defaultdict(list)
    for o in ops:
        if o.member:
            out[o.member].append(o)
    return out


# -- self-test: a clean history and one planted violation of each invariant ---------------------------------

def clean_history() -> History:
    """Two jobs of two members on three replicas: r0 leads (epoch 10) until it is cut off from etcd at
    t=20 and r1 takes over (epoch 20) at t=26; the cut heals at t=30; job-a re-forms (generation 2) when
    a-1 leaves and a-2 joins; final probes at t=50."""
    h = History(election_ttl_s=5.0, lease_ttl_s=10.0)
    h.faults = [Fault(1, "etcd_cut", ("r0",), 20.0, 30.0)]
    h.terms = [Term("r0", 10, 0.0, 25.0), Term("r1", 20, 26.0, None)]
    wa1, wa2 = world_digest(["a-0", "a-1"]), world_digest(["a-0", "a-2"])
    wb = world_digest(["b-0", "b-1"])
    ops = [
        Op(0, "join", "job-a", "a-0", "h0", "r0", 1.0, 2.0, generation=1, rank=0, world=wa1, epoch=10),
        Op(0, "join", "job-a", "a-1", "h1", "r0", 1.0, 2.0, generation=1, rank=1, world=wa1, epoch=10),
        Op(0, "join", "job-b", "b-0", "h0", "r0", 3.0, 4.0, generation=1, rank=0, world=wb, epoch=10),
        Op(0, "join", "job-b", "b-1", "h1", "r0", 3.0, 4.0, generation=1, rank=1, world=wb, epoch=10),
        Op(0, "event", "job-a", "a-0", "h0", "r0", 2.0, 2.0, generation=1, world=wa1, members=("a-0", "a-1")),
        Op(0, "keepalive", "job-a", "a-0", "h0", "r0", 8.0, 8.1, generation=1, epoch=10),
        Op(0, "keepalive", "job-b", "b-0", "h0", "r0", 8.0, 8.1, generation=1, epoch=10),
        Op(0, "keepalive", "job-b", "b-1", "h1", "r0", 8.0, 8.1, generation=1, epoch=10),
        Op(0, "leave", "job-a", "a-1", "h1", "r0", 10.0, 10.2, epoch=10),
        Op(0, "join", "job-a", "a-2", "h2", "r0", 11.0, 12.0, generation=2, rank=1, world=wa2, epoch=10),
        Op(0, "keepalive", "job-a", "a-0", "h0", "r0", 11.5, 11.6, generation=2, epoch=10),
        Op(0, "keepalive", "job-b", "b-0", "h0", "r0", 16.0, 16.1, generation=1, epoch=10),
        Op(0, "keepalive", "job-a", "a-0", "h0", "r0", 22.0, 22.1, generation=2, epoch=10),  # within the TTL of the cut
        Op(0, "keepalive", "job-a", "a-2", "h2", "r0", 26.0, 26.1, ok=False, error="UNAVAILABLE"),  # r0 steps down
        Op(0, "keepalive", "job-a", "a-2", "h2", "r1", 27.0, 27.1, generation=2, epoch=20),
        Op(0, "keepalive", "job-b", "b-0", "h0", "r1", 27.0, 27.1, generation=1, epoch=20),
        Op(0, "keepalive", "job-b", "b-1", "h1", "r1", 27.0, 27.1, generation=1, epoch=20),
        Op(0, "keepalive", "job-a", "a-0", "h0", "r1", 28.0, 28.1, generation=2, epoch=20),
        Op(0, "describe", "job-a", "", "h3", "r1", 33.0, 33.1, generation=2, world=wa2, members=("a-0", "a-2"), state="FORMED"),
        Op(0, "describe", "job-b", "", "h3", "r1", 33.0, 33.1, generation=1, world=wb, members=("b-0", "b-1"), state="FORMED"),
        *(Op(0, "probe", job, m, "h3", "r1", 50.0, 50.1, generation=g)
          for job, m, g in (("job-a", "a-0", 2), ("job-a", "a-2", 2), ("job-b", "b-0", 1), ("job-b", "b-1", 1))),
        Op(0, "probe", "job-a", "a-1", "h3", "r1", 50.0, 50.1, ok=False, error="NOT_FOUND"),
    ]
    h.ops = [dataclasses.replace(o, id=i) for i, o in enumerate(ops, start=100)]
    return h


def planted() -> dict[str, History]:
    """invariant -> the clean history with one violation of it planted."""

    def plus(*extra: Op, **changes) -> History:
        h = clean_history()
        h.ops = h.ops + [dataclasses.replace(o, id=900 + i) for i, o in enumerate(extra)]
        for name, value in changes.items():
            setattr(h, name, value)
        return h

    wb = world_digest(["b-0", "b-1"])
    cases = {
        # b-2 told rank 1 of job-b generation 1, which b-1 holds (same world digest: only the rank clashes).
        "unique_rank": plus(Op(0, "join", "job-b", "b-2", "h2", "r0", 5.0, 6.0, generation=1, rank=1, world=wb, epoch=10),
                            Op(0, "leave", "job-b", "b-2", "h2", "r0", 7.0, 7.1, epoch=10)),
        # an event tells a-0 a different world for job-a generation 2.
        "one_world": plus(Op(0, "event", "job-a", "a-0", "h0", "r0", 12.5, 12.5, generation=2,
                             world=world_digest(["a-0", "a-1"]), members=("a-0", "a-1"))),
        # a-0 renewed at generation 2 by 11.6, then a renewal starting at 14 answers generation 1.
        "monotonic_gen": plus(Op(0, "keepalive", "job-a", "a-0", "h0", "r0", 14.0, 14.1, generation=1, epoch=10)),
        # a-1 answered Leave at 10.2, and a KeepAlive starting at 15 is answered.
        "leave_final": plus(Op(0, "keepalive", "job-a", "a-1", "h1", "r0", 15.0, 15.1, generation=1, epoch=10)),
        # b-1's last probe finds it gone though it renewed every few seconds and never left.
        "join_kept": plus(Op(0, "probe", "job-b", "b-1", "h3", "r1", 51.0, 51.1, ok=False, error="NOT_FOUND")),
        # after the heal, r0 accepts a write with its old epoch though r1's epoch-20 writes completed (at 27.1).
        "one_writer": plus(Op(0, "keepalive", "job-b", "b-0", "h0", "r0", 31.0, 31.1, generation=1, epoch=10)),
        # job-b is never seen FORMED after the heal (its describe dropped).
        "convergence": dataclasses.replace(clean_history(), ops=[o for o in clean_history().ops
                                                                  if not (o.kind == "describe" and o.job == "job-b")]),
        # r0, cut off since 20, answers a describe at 25.5-25.6: later than the election TTL (5 s) after the cut.
        "no_minority": plus(Op(0, "describe", "job-a", "", "h3", "r0", 25.5, 25.6, generation=2,
                               world=world_digest(["a-0", "a-2"]), members=("a-0", "a-2"), state="FORMED")),
    }
    assert set(cases) == set(INVARIANTS)
    return cases


def self_test() -> int:
    failures = 0
    report = check(clean_history())
    print(f"{'clean':<14} {'passes' if not report.violations else 'FAILED'}  "
          f"convergence {', '.join(f'{j} {t:.1f} s' for j, t in report.convergence_s.items())}")
    for v in report.violations:
        print(f"{'':<14}   unexpected {v}")
    failures += bool(report.violations)
    for name, history in planted().items():
        report = check(history)
        caught = [v for v in report.violations if v.invariant == name]
        other = [v for v in report.violations if v.invariant != name]
        ok = bool(caught) and not other
        failures += not ok
        print(f"{name:<14} {'caught' if caught else 'MISSED'}{'' if not other else ' (and others)'}  "
              f"{caught[0] if caught else ''}")
        for v in other:
            print(f"{'':<14}   unexpected {v}")
    print(f"{len(INVARIANTS)} planted violations, {failures} failures")
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--self-test", action="store_true",
                        help="check a clean history and one planted violation of each invariant")
    args = parser.parse_args()
    if not args.self_test:
        parser.error("nothing to do: give --self-test (a runner imports check() and feeds it its history)")
    sys.exit(self_test())


if __name__ == "__main__":
    main()
