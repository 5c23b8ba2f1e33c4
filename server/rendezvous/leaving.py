"""Leaving: a member or a host membership's workers going, however they go
(left, expired, withdrawn, disconnected, broke off), and what their loss does
to the job: its world re-forms, ends or fails, or its run ends with its last
member. A decider: it is given a job and adds to the `Actions` it is given or
returns."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .actions import Actions
from .forming import Forming
from .history import History
from .model import (
    BROKE_OFF,
    DISCONNECTED,
    EventKind,
    Gone,
    Job,
    Jobs,
    JobState,
    Member,
    MemberGone,
    Note,
    worker_id,
)
from .shares import JOBS, SERVER, WORKERS, Caller, Shares
from .store import DeleteMember, PutMember, member_record

log = logging.getLogger("commctx.server")

# Why a member was removed ("left", "expired", "withdrawn", DISCONNECTED, BROKE_OFF), as said to people.
SAID = {DISCONNECTED: "disconnected: session closed without leave",
        BROKE_OFF: "disconnected: session closed without leave after its world's collectives failed"}


class Leaving:
    """Removing members and workers, and what their loss does. Its state: the
    machine's jobs (shared), the callers' shares it gives back, and the
    deciders it hands on to (forming a world, recording history)."""

    def __init__(self, jobs: Jobs, shares: Shares, forming: Forming, history: History) -> None:
        self._jobs = jobs
        self._shares = shares
        self._forming = forming
        self._history = history

    def remove_workers(self, job: Job, member_id: str, member: Member, indexes: Iterable[int], why: str) -> Actions:
        """Workers of a host membership are gone (`why`: DISCONNECTED, their
        process ended; "expired", it went silent; "left"): they leave its seat as single members would,
        the world re-forming around them by the rank rule; the membership
        keeps its lease and its other workers. Its last worker takes the
        membership with it. Indexes it does not hold are ignored."""
        job_id = job.job_id
        actions = Actions()
        wanted = set(indexes)
        gone = tuple(s for s in member.slots if s.index in wanted)
        if not gone:
            return actions
        if len(gone) == len(member.slots):
            self.remove(job, member_id, why, actions)
            return actions
        ranks = job.plan.ranks if job.plan is not None else {}
        seated = [(s, ranks.get(worker_id(member_id, s.index))) for s in gone]
        seated = [(s, rank) for s, rank in seated if rank is not None]
        member.slots = tuple(s for s in member.slots if s.index not in wanted)
        member.workers -= len(gone)
        node = job.nodes[member.node_key]
        for s in gone:
            if s.local_rank is not None:
                node.local_ranks.pop(s.local_rank, None)
            node.roles[s.role] -= 1
            job.role_counts[s.role] -= 1
        node.workers -= len(gone)
        job.workers -= len(gone)
        job.seated_workers -= len(seated)
        job.version += 1
        actions.writes.append(PutMember(job_id, member_record(member_id, member)))
        said = {"left": "left", "expired": "expired: its process went silent for a lease"}.get(
            why, "disconnected: its process ended without a leave")
        kind = EventKind.LEFT if why == "left" else EventKind.LOST
        for s in gone:
            rank = ranks.get(worker_id(member_id, s.index))
            where = f"node {member.node_key!r}" + (f", rank {rank}" if rank is not None else "")
            actions.notes.append(Note("removed", {"job": job_id, "member": member_id, "worker": s.index, "why": why}))
            self._history.event(job, kind, f"worker {s.index} of host member {member_id} ({where}) {said}", actions,
                                member=member_id, worker=s.index, node=member.node_key, rank=rank, why=why)
        if seated and job.generation > 0 and job.state in (JobState.FORMED, JobState.FORMING):
            (first, rank), more = seated[0], len(seated) - 1
            what = (f"worker {first.index} of host member {member_id} (node {member.node_key!r}, rank {rank})"
                    f"{f' and {more} more' if more else ''} {said}")
            self._lost(job, member_id, member, why, actions, what)
        elif job.state is JobState.FORMING:
            self._forming.maybe_form(job, actions)
        return actions

    def leave(self, job: Job, member_id: str, member: Member, caller: Caller = SERVER, close: bool = False) -> Actions:
        """Removes a member that leaves. With `close`, first closes the job for
        everyone (torchrun's shutdown of the run): CLOSED, every member and
        waiter told, later joins refused while the job is kept."""
        job_id = job.job_id
        actions = Actions()
        if close and not (job.in_world(member_id, member) or caller.exempt):  # a standby, or a worker still waiting
            log.info("close_ignored", extra={"fields": {"job": job_id, "member": member_id, "node": member.node_key}})
            close = False  # it leaves; the run is its world's to close (or the admin's)
        if close and job.state is not JobState.CLOSED:
            self._forming.stop(job, JobState.CLOSED, f"node {member.node_key!r} closed it (its launcher shut the run down)",
                                "was closed", actions)
        self.remove(job, member_id, "left", actions)
        return actions

    def remove(self, job: Job, member_id: str, why: str, actions: Actions) -> None:
        """Removes a member (`why`: "left", "expired", "withdrawn", DISCONNECTED, BROKE_OFF), and does
        what its loss does: the job's run ends with its last member; a world it sat in re-forms, or ends or fails
        below its minimum; a forming job may form without it."""
        member = job.members.pop(member_id)
        self._jobs.members -= 1
        if member.held:
            self._shares.give(WORKERS, Caller(member.caller, ""), member.held)
        job.version += 1
        in_world = job.in_world(member_id, member)
        job.seated_workers -= job.seated(member_id, member)
        job.workers -= member.workers
        job.suspects.discard(member_id)
        node = job.nodes[member.node_key]
        node.workers -= member.workers
        for role, count in member.roles():
            node.roles[role] -= count
            job.role_counts[role] -= count
        if member.local_rank is not None:
            node.local_ranks.pop(member.local_rank, None)
        for s in member.slots:
            if s.local_rank is not None:
                node.local_ranks.pop(s.local_rank, None)
        if node.workers == 0:
            del job.nodes[node.key]
            if node.node_rank is not None:
                job.node_ranks.pop(node.node_rank, None)
        actions.writes.append(DeleteMember(job.job_id, member_id))
        actions.notes.append(Note("removed", {"job": job.job_id, "member": member_id, "why": why}))
        rank = job.rank_of(member_id, member) if in_world else None
        where = f"node {member.node_key!r}" + (f", rank {rank}" if rank is not None else "")
        said = "withdrew (its Join call ended before it was placed)" if why == "withdrawn" else SAID.get(why, why)
        self._history.event(job, EventKind.LEFT if why in ("left", "withdrawn") else EventKind.LOST,
                            f"member {member_id} ({where}) {said}", actions, member=member_id, node=member.node_key,
                            rank=rank, why=why)
        if member.sink is not None and why != "left":
            actions.pushes.append((member.sink, Gone(f"member {member_id} {SAID.get(why, why)}")))
        if why != "withdrawn":  # a member waiting in Join learns at once that it is gone
            actions.wakes.append((job.job_id, MemberGone(member_id)))
        if not job.members:  # the run has ended: kept a while (also across a restart), and the id is free
            if not job.state.over and job.generation > 0:  # the last of a world, with no verdict yet
                left = why == "left"
                job.state = JobState.ENDED if left else JobState.FAILED
                job.reason = f"member {member_id} ({where}) {said}, the last to go"
                self._history.event(job, EventKind.ENDED if left else EventKind.FAILED,
                                    f"{'finished' if left else 'failed'}: {job.reason}", actions, reason=job.reason)
            del self._jobs.live[job.job_id]
            self._shares.give(JOBS, job.creator)
            self._history.end_run(job, actions)
        elif in_world and job.generation > 0 and job.state in (JobState.FORMED, JobState.FORMING):
            self._lost(job, member_id, member, why, actions)
        elif job.state is JobState.FORMING:
            self._forming.maybe_form(job, actions)  # a waiting worker's leaving may be all that held the world back

    def _lost(self, job: Job, member_id: str, member: Member, why: str, actions: Actions, what: str = "") -> None:
        """A member of a formed (or re-forming) world is gone (`what` says so
        when it is a host membership's worker that is)."""
        job.abandoned |= why != "left"
        rank = job.rank_of(member_id, member)
        what = what or f"member {member_id} (node {member.node_key!r}, rank {rank}) {SAID.get(why, why)}"
        n, unit = (job.units, "node") if job.spec.nodes else (job.workers, "worker")
        remain = f"{n} {unit}{'s' * (n != 1)} remain{'s' * (n == 1)}"
        if job.units < job.spec.min_world and why == "left":  # members leaving: the job is finishing
            fixed = job.spec.min_size is None and not job.spec.nodes  # a fixed world ends when its first worker leaves
            reason = (f"{what}, the first of its {job.spec.world_size} workers to go" if fixed else
                      f"{what}; {remain}, below the minimum of {job.spec.min_world}")
            self._forming.stop(job, JobState.ENDED, reason, "finished", actions)
        elif job.units < job.spec.min_world and not job.spec.nodes:
            reason = f"{what}; {remain}, fewer than the minimum of {job.spec.min_world}"
            self._forming.stop(job, JobState.FAILED, reason, "cannot continue", actions)
        elif job.units < job.spec.min_world:  # torchrun's nodes wait for a replacement until their join_timeout, as c10d's do
            reason = f"{what}; {remain}, waiting for {job.spec.min_world - n} more to reach the minimum of {job.spec.min_world}"
            if job.state is JobState.FORMED:
                self._forming.change(job, reason, actions)
            else:
                job.reason = reason
        elif job.state is JobState.FORMED:
            self._forming.change(job, what, actions)
        else:
            job.reason = what
            self._forming.maybe_form(job, actions)

