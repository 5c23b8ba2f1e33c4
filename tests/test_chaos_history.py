"""The chaos history checker (benchmarks/chaos_history.py): the self-test's
cases as unit tests (one planted violation of each invariant caught under
its own name and no other; the clean history passes), the CLI's exit code,
and the edges of each rule: what must not be reported."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from benchmarks import chaos_history as ch

ROOT = pathlib.Path(__file__).resolve().parents[1]

PLANTED = ch.planted()


def with_ops(*extra: ch.Op, **changes) -> ch.History:
    h = ch.clean_history()
    h.ops = h.ops + [dataclasses.replace(o, id=800 + i) for i, o in enumerate(extra)]
    for name, value in changes.items():
        setattr(h, name, value)
    return h


def test_clean_history_passes_and_reports_convergence_times():
    report = ch.check(ch.clean_history())
    assert report.violations == []
    assert report.convergence_s == {"job-a": pytest.approx(3.1), "job-b": pytest.approx(3.1)}


@pytest.mark.parametrize("invariant", ch.INVARIANTS)
def test_each_planted_violation_is_caught_under_its_name(invariant):
    report = ch.check(PLANTED[invariant])
    assert report.invariants() == {invariant}, [str(v) for v in report.violations]
    for v in report.violations:
        assert v.ids and v.reason and "\n" not in v.reason
    ops = {o.id for o in PLANTED[invariant].ops} | {f.id for f in PLANTED[invariant].faults}
    assert all(set(v.ids) <= ops for v in report.violations)


def test_self_test_cli_exits_zero_and_names_every_invariant():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chaos_history.py"), "--self-test"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ch.INVARIANTS:
        assert f"{name}" in out.stdout and "MISSED" not in out.stdout
    assert "clean          passes" in out.stdout


def test_self_test_fails_when_a_check_misses(monkeypatch, capsys):
    monkeypatch.setattr(ch, "no_minority", lambda *a: [])
    assert ch.self_test() == 1
    assert "no_minority    MISSED" in capsys.readouterr().out


def test_overlapping_calls_are_not_ordered_for_generations():
    # a renewal started at 11.0 (before the generation-2 answers ended) may still answer generation 1
    h = with_ops(ch.Op(0, "keepalive", "job-a", "a-0", "h0", "r0", 11.0, 12.5, generation=1, epoch=10))
    assert ch.check(h).violations == []


def test_leave_answered_not_found_counts_and_describe_listing_a_left_member_is_caught():
    h = with_ops(ch.Op(0, "describe", "job-a", "", "h3", "r1", 34.0, 34.1, generation=2,
                       world=ch.world_digest(["a-0", "a-1"]), members=("a-0", "a-1"), state="FORMED"))
    h.checks_convergence = False
    found = ch.check(h).violations
    assert {v.invariant for v in found} == {"leave_final", "one_world"}
    h = with_ops(ch.Op(0, "leave", "job-b", "b-1", "h1", "r1", 40.0, 40.1, ok=False, error="NOT_FOUND"))
    h.ops = [o for o in h.ops if not (o.kind == "probe" and o.member == "b-1")] + [
        ch.Op(999, "probe", "job-b", "b-1", "h3", "r1", 50.0, 50.1, ok=False, error="NOT_FOUND")]
    assert "join_kept" not in ch.check(h).invariants()


def test_expiry_after_a_lease_of_failed_renewals_is_not_a_lost_join():
    h = ch.clean_history()
    h.ops = [o for o in h.ops if not (o.member == "b-1" and o.kind in ("keepalive", "probe"))] + [
        ch.Op(801, "keepalive", "job-b", "b-1", "h1", "r1", 27.0, 27.1, ok=False, error="NOT_FOUND"),
        ch.Op(802, "probe", "job-b", "b-1", "h3", "r1", 50.0, 50.1, ok=False, error="NOT_FOUND")]
    h.live = {"job-a": frozenset({"a-0", "a-2"}), "job-b": frozenset({"b-0"})}
    h.ops = [o for o in h.ops if not (o.kind == "describe" and o.job == "job-b")] + [
        ch.Op(803, "describe", "job-b", "", "h3", "r1", 33.0, 33.1, generation=2, members=("b-0",), state="FORMED")]
    assert ch.check(h).violations == []
    # the same NOT_FOUND with renewals never a lease apart is a lost Join
    h.ops += [ch.Op(804 + i, "keepalive", "job-b", "b-1", "h1", "r0", t, t + 0.1, generation=1, epoch=10)
              for i, t in enumerate((8.0, 16.0, 24.0))]
    assert ch.check(h).invariants() == {"join_kept"}


def test_a_lease_counts_from_when_its_renewal_was_sent_not_when_the_answer_came_back():
    """Found by benchmarks/chaos.py (seed 4): a KeepAlive over a slow link was answered 0.65 s after it was
    sent, then a partition cut the member off; the server expired it a TTL after the renewal, which the
    rule, counting from the answer, took for 0.9 TTL after it. A removal is early only if it came before
    the renewal's start + 0.9 TTL."""
    h = ch.clean_history()
    h.ops = [o for o in h.ops if not (o.member == "b-1" and o.kind in ("keepalive", "probe"))] + [
        ch.Op(801, "keepalive", "job-b", "b-1", "h1", "r0", 16.0, 16.65, generation=1, epoch=10),  # a slow answer
        ch.Op(802, "keepalive", "job-b", "b-1", "h1", "r1", 25.6, 25.7, ok=False, error="NOT_FOUND"),
        ch.Op(803, "probe", "job-b", "b-1", "h3", "r1", 50.0, 50.1, ok=False, error="NOT_FOUND")]
    h.live = {"job-a": frozenset({"a-0", "a-2"}), "job-b": frozenset({"b-0"})}
    h.ops = [o for o in h.ops if not (o.kind == "describe" and o.job == "job-b")] + [
        ch.Op(804, "describe", "job-b", "", "h3", "r1", 33.0, 33.1, generation=2, members=("b-0",), state="FORMED")]
    assert ch.check(h).violations == []  # gone 9.7 s after the renewal was sent: its lease may have run out
    h.ops = [dataclasses.replace(o, start=16.8, end=17.45) if o.id == 801 else o for o in h.ops]
    assert ch.check(h).invariants() == {"join_kept"}  # gone 8.9 s after it was sent: surely early


def test_one_writer_rules():
    # (a) one epoch answered at two replicas
    h = with_ops(ch.Op(0, "keepalive", "job-b", "b-0", "h0", "r2", 28.0, 28.1, generation=1, epoch=20))
    assert any("two replicas" in v.reason for v in ch.check(h).violations)
    # an older epoch completing after a newer one, the calls overlapping: delivery order, not a violation
    h = with_ops(ch.Op(0, "keepalive", "job-b", "b-0", "h0", "r1", 26.9, 27.2, generation=1, epoch=15), terms=[])
    assert ch.check(h).violations == []
    # (d) a write started after its term ended; terms unknown: not reported
    h = with_ops(ch.Op(0, "keepalive", "job-a", "a-0", "h0", "r0", 25.2, 25.3, generation=2, epoch=10))
    h.faults = [dataclasses.replace(h.faults[0], kind="kill")]
    assert any("after its term" in v.reason for v in ch.check(h).violations)
    h.terms = []
    assert ch.check(h).violations == []


def test_convergence_too_slow_and_unhealed_faults():
    h = ch.clean_history()
    h.ops = [dataclasses.replace(o, start=o.start + 20, end=o.end + 20) if o.kind == "describe" else o for o in h.ops]
    report = ch.check(h)
    assert report.invariants() == {"convergence"} and "took 23.1 s" in report.violations[0].reason
    assert report.convergence_s["job-a"] == pytest.approx(23.1)
    h.faults = [dataclasses.replace(h.faults[0], end=None)]  # never healed: convergence not judged
    assert "convergence" not in ch.check(h).invariants()
    h = ch.clean_history()
    h.min_size = {"job-b": 3}  # too few live members to form: not expected
    h.ops = [o for o in h.ops if not (o.kind == "describe" and o.job == "job-b")]
    assert ch.check(h).violations == []


def test_no_minority_only_for_answers_wholly_inside_the_cut_after_the_ttl():
    d = dict(generation=2, world=ch.world_digest(["a-0", "a-2"]), members=("a-0", "a-2"), state="FORMED")
    assert ch.check(with_ops(ch.Op(0, "describe", "job-a", "", "h3", "r0", 24.0, 24.1, **d))).violations == []
    assert ch.check(with_ops(ch.Op(0, "describe", "job-a", "", "h3", "r0", 29.0, 30.5, **d))).violations == []
    assert ch.check(with_ops(ch.Op(0, "describe", "job-a", "", "h3", "r0", 26.0, 26.1, ok=False,
                                   error="UNAVAILABLE"))).violations == []
    assert ch.check(with_ops(ch.Op(0, "describe", "job-a", "", "h3", "r1", 26.0, 26.1, **d))).violations == []


def test_a_later_run_of_a_job_id_may_reuse_its_generations_and_ranks():
    """Generations count from 1 in each run: run 2's world of generation 1 is another world, with
    other members in the same ranks; within one run the same clash is a violation."""
    run2 = [ch.Op(0, "join", "job-b", m, "h2", "r1", 40.0, 40.5, generation=1, rank=r, world=ch.world_digest(["x"]), run=2)
            for r, m in enumerate(("b-8", "b-9"))]
    assert ch.check(with_ops(*run2, checks_convergence=False)).violations == []
    clash = [dataclasses.replace(o, run=0) for o in run2]  # the clean history's worlds are run 0's
    assert ch.check(with_ops(*clash, checks_convergence=False)).invariants() == {"unique_rank", "one_world"}


def test_a_member_whose_run_ended_may_be_missing_from_the_final_state():
    """join_kept: a member told RUN_ENDED (its job's run failed, ended or closed, and every member with it)
    is not a lost Join; the same member found missing (NOT_FOUND) with no such word is."""
    gone = ch.Op(0, "keepalive", "job-b", "b-1", "h1", "r1", 30.0, 30.1, ok=False, error="RUN_ENDED")
    missing = ch.Op(0, "probe", "job-b", "b-1", "h3", "r1", 51.0, 51.1, ok=False, error="RUN_ENDED")
    assert ch.check(with_ops(gone, missing)).invariants() <= {"convergence"}
    assert "join_kept" in ch.check(with_ops(dataclasses.replace(missing, error="NOT_FOUND"))).invariants()


def test_a_member_that_tried_to_leave_may_be_missing_from_the_final_state():
    """Its Leave unanswered (a partition), the worker stops renewing and its lease runs out."""
    tried = ch.Op(0, "leave", "job-b", "b-1", "h1", "r1", 30.0, 33.0, ok=False, error="DEADLINE_EXCEEDED")
    missing = ch.Op(0, "probe", "job-b", "b-1", "h3", "r1", 51.0, 51.1, ok=False, error="NOT_FOUND")
    assert "join_kept" not in ch.check(with_ops(tried, missing)).invariants()


def test_an_answer_written_in_one_term_may_reach_its_caller_after_the_next_began():
    """one_writer orders writes by when they start: r0's epoch-10 Join that started before r1's epoch-20
    writes completed may be answered after them (its delivery waited); one that starts later may not."""
    late = ch.Op(0, "join", "job-b", "b-7", "h2", "r0", 19.0, 28.0, generation=1, rank=2, world="x", epoch=10)
    assert "one_writer" not in ch.check(with_ops(late, terms=[], checks_convergence=False)).invariants()
    started_late = dataclasses.replace(late, start=27.5)
    assert "one_writer" in ch.check(with_ops(started_late, terms=[], checks_convergence=False)).invariants()
