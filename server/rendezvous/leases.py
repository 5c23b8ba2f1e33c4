"""Leases: sessions, renewals and the deadlines that end memberships. A
member's lease is in one of the named states of model.Lease; its deadline
waits in a heap (deadlines.py) whose entries are lazy: a renewal pushes
nothing, and `_queue` pushes only a deadline earlier than the member's live
entry (leaving a stretched first lease, a reconnect grace).

A mixin of `Rendezvous` (machine.py): one concern of the state machine per
file; the state is the machine's."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..errors import BadRequest, Stale
from .actions import Actions
from .deadlines import Deadline, earliest
from .model import (
    BROKE_OFF,
    DISCONNECTED,
    EventKind,
    Gone,
    Job,
    JobState,
    Lease,
    Member,
    MemberGone,
    Note,
    Reforming,
    Replaced,
    SessionEvent,
    member_of,
    worker_id,
)
from .shares import JOBS, SERVER, WORKERS, Caller
from .store import DeleteMember, PutMember, member_record

log = logging.getLogger("commctx.server")

# Why a member was removed ("left", "expired", "withdrawn", DISCONNECTED, BROKE_OFF), as said to people.
_SAID = {DISCONNECTED: "disconnected: session closed without leave",
         BROKE_OFF: "disconnected: session closed without leave after its world's collectives failed"}


def serves_store(job: Job, member_id: str, port: int) -> bool:
    """Whether `port` is the one `member_id` serves its world's TCPStore on (its
    spare, spent when it became rank 0): offered again (a session opening with
    the port its Join offered, a renewal sent before its new spare), it is no spare."""
    plan = job.plan
    return plan is not None and plan.master_port == port and member_of(plan.seating.nodes[0].members[0]) == member_id


class Leases:
    """Sessions, renewals, restarts, leaving, and expiry; removing a member and what its loss does."""

    def naming_wait_s(self, open_streams: int) -> float:
        """How long a new session stream may take to name its member: the lease
        TTL, stretched as a world's first lease is by the time the server takes
        to open that many streams (a whole world's sessions open at once), and
        never shorter than the longest first lease granted here (the widest
        world's): a stream is not closed while the member it would name still
        holds its seat."""
        return self.lease_ttl_s + max(open_streams, self.widest_world) * self.SESSION_OPEN_S

    def open_session(self, job_id: str, member_id: str, generation: int, sink: object,
                     spare_port: int = 0, secret: str | None = None) -> tuple[float, list[SessionEvent], Actions]:
        """Attaches a session sink to a member and renews its lease. `secret`
        must be the member's (None: not checked; the RPC edge always checks).

        A member holds one session: an older one still open is ended (Replaced),
        and its end is no departure. A member whose session closed without a
        Leave (DETACHED) takes its seat back here, within the reconnect grace:
        nothing is announced.

        Returns:
            The lease TTL, the events the member missed (to send first), and actions.

        Raises:
            NotFound: unknown job or member, or not its secret.
            Stale: the session names a generation older than one the
                member's sessions named before (a stale process): it takes nothing over.
        """
        job = self._job(job_id)
        member = self._member(job, member_id, secret)
        if generation < member.generation:
            raise Stale(f"member {member_id} of job {job_id!r} holds generation {member.generation}; a session "
                                  f"naming generation {generation} cannot take over its membership")
        older = member.session  # renew() below takes a DETACHED member back
        missed: list[SessionEvent] = []
        if job.state.over:  # a session opened after its job stopped: told at once, as the others were
            verb = {JobState.FAILED: "cannot continue", JobState.ENDED: "finished", JobState.CLOSED: "was closed"}[job.state]
            missed.append(Gone(f"job {job_id!r} {verb}: {job.reason}", job.state is not JobState.FAILED,
                               job.state is JobState.CLOSED))
        elif job.in_world(member_id):
            if job.state is JobState.FORMED and generation < job.generation:
                missed.append(job.world(job.previous_plan))
            elif job.state is JobState.FORMING and job.announced:
                missed.append(Reforming(job.generation, job.reason, job.abandoned))
        member.session = sink
        _, actions = self.renew(job_id, member_id, generation, spare_port)
        if older is not None and older is not sink:
            actions.pushes.append((older, Replaced(f"member {member_id} of job {job_id!r} opened a newer session")))
        return self.lease_ttl_s, missed, actions

    def end_session(self, job_id: str, member_id: str, sink: object, how: str) -> tuple[str, Actions]:
        """The session of `sink` ended `how`: "finished" or "cancelled" by its
        client (a departure, as close_session says), "replaced" by a newer one, or
        "server" (this server ended it). While the server drains, every end is the
        server's. Returns how it counts, and close_session's actions."""
        how = "server" if self.draining else how
        return how, self.close_session(job_id, member_id, sink, how in ("finished", "cancelled"))

    def close_session(self, job_id: str, member_id: str, sink: object, departed: bool = False) -> Actions:
        """The session of `sink` ended. `departed`: the client ended it (it
        cancelled the stream, or its connection broke, as when its process is
        killed) without a Leave; then, unless a new session reattaches within
        the reconnect grace, the member is removed as an expired lease is; at
        once, with no grace, when a peer reported its world's collectives
        failed (report_failure), unless it is a host membership, whose other
        workers take its session over within the grace. Any other end (the server stopping or handing
        over, a newer session) leaves the lease to run on. A paused process
        keeps its connection: only its lease finds it.

        Returns:
            Actions: the removal's, or none (but the grace's deadline may be the next one).
        """
        actions = Actions()
        job = self._jobs.get(job_id)
        member = job.members.get(member_id) if job is not None else None
        if member is None or member.session is not sink:
            return actions
        member.session = None
        if (departed and member.lease in (Lease.FIRST, Lease.RENEWING) and job.failed == job.generation
                and job.in_world(member_id) and len(member.slots) <= 1):  # a host's other workers may take its session over
            self._remove(job, member_id, BROKE_OFF, actions)
        elif departed and member.lease in (Lease.FIRST, Lease.RENEWING):
            member.lease = Lease.DETACHED
            member.lease_deadline = min(member.lease_deadline, self._clock() + self.reconnect_grace_s)
            self._queue(job_id, member_id, member, member.lease_deadline)
        return actions

    def renew(self, job_id: str, member_id: str, generation: int, spare_port: int = 0) -> tuple[int, Actions]:
        """Renews a member's lease; records a spare port it offers for a later world.

        A spare port counts only from a member that holds the current
        generation (an older message may still carry a port that rank 0 has
        since given to the TCPStore).

        Returns:
            The job's current generation, and actions.

        Raises:
            BadRequest: a spare port out of range.
            NotFound: unknown job or member.
        """
        if not 0 <= spare_port <= 65535:
            raise BadRequest(f"spare_port {spare_port} is out of range 1..65535 (0: unchanged)")
        job = self._job(job_id)
        member = self._member(job, member_id)
        actions = Actions()
        if member.lease is Lease.DETACHED and generation >= member.generation:
            member.lease = Lease.RENEWING  # heard from within the grace (a KeepAlive, or a session reattaching)
        if member.generation < generation <= job.generation:  # a later one is nonsense, and would lock the member out
            member.generation = generation
        if member.lease is Lease.RENEWING:  # the common case: the heap entry is lazy, nothing is pushed
            member.lease_deadline = self._clock() + self.lease_ttl_s
        elif member.lease is Lease.FIRST:
            # Leaving a first lease, which may be stretched far past TTL: the one
            # push this costs makes last renewal + TTL the bound from now on.
            member.lease, member.lease_deadline = Lease.RENEWING, self._clock() + self.lease_ttl_s
            self._queue(job_id, member_id, member, member.lease_deadline)
        # IN_JOIN: bound to its Join call; DETACHED with an older generation: a stale process, the grace runs on
        if (spare_port and generation == job.generation and spare_port != member.port
                and not serves_store(job, member_id, spare_port)):
            member.port = spare_port
            job.version += 1
            actions.writes.append(PutMember(job_id, member_record(member_id, member)))
        if job.suspects and member_id in job.suspects and member.port:
            job.suspects.discard(member_id)
            self._maybe_form(job, actions)
        return job.generation, actions

    def report_failure(self, job_id: str, member_id: str, generation: int) -> Actions:
        """A member's collectives in `generation` failed: a peer's connection
        broke, which a killed process's does at once. Members of that world
        whose session closed without a Leave (DETACHED) are removed now rather
        than at the end of their reconnect grace, and so is one whose session
        closes so later in the generation (close_session). A process that is
        alive and whose connection to this server merely broke has the grace
        back in the next generation; in this one its peers' collectives failed
        anyway. Ignored unless `generation` is the job's current one and the
        member sits in its world; the first report of a generation does the
        work (one pass over the world), later ones nothing.

        Raises:
            NotFound: unknown job or member.
        """
        job = self._job(job_id)
        self._member(job, member_id)
        actions = Actions()
        if (generation == job.generation == job.failed or generation != job.generation or not job.in_world(member_id)
                or job.state not in (JobState.FORMED, JobState.FORMING)):
            return actions
        job.failed = generation
        # (a host membership of several workers is left its grace: another of its workers takes its session over)
        detached = [mid for mid in job.survivors()
                    if job.members[mid].lease is Lease.DETACHED and len(job.members[mid].slots) <= 1]
        for mid in detached:
            if mid in job.members:  # not gone with the job (a world below its minimum fails, taking every member)
                self._remove(job, mid, BROKE_OFF, actions)
        return actions

    def remove_workers(self, job_id: str, member_id: str, indexes: Iterable[int], why: str) -> Actions:
        """Workers of a host membership are gone (`why`: DISCONNECTED, their
        process ended; "expired", it went silent; "left"): they leave its seat as single members would,
        the world re-forming around them by the rank rule; the membership
        keeps its lease and its other workers. Its last worker takes the
        membership with it. Indexes it does not hold are ignored.

        Raises:
            NotFound: unknown job or member.
        """
        job = self._job(job_id)
        member = self._member(job, member_id)
        actions = Actions()
        wanted = set(indexes)
        gone = tuple(s for s in member.slots if s.index in wanted)
        if not gone:
            return actions
        if len(gone) == len(member.slots):
            self._remove(job, member_id, why, actions)
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
        job.placed -= len(seated)
        job.version += 1
        actions.writes.append(PutMember(job_id, member_record(member_id, member)))
        said = {"left": "left", "expired": "expired: its process went silent for a lease"}.get(
            why, "disconnected: its process ended without a leave")
        kind = EventKind.LEFT if why == "left" else EventKind.LOST
        for s in gone:
            rank = ranks.get(worker_id(member_id, s.index))
            where = f"node {member.node_key!r}" + (f", rank {rank}" if rank is not None else "")
            actions.notes.append(Note("removed", {"job": job_id, "member": member_id, "worker": s.index, "why": why}))
            self._event(job, kind, f"worker {s.index} of host member {member_id} ({where}) {said}", actions,
                        member=member_id, worker=s.index, node=member.node_key, rank=rank, why=why)
        if seated and job.generation > 0 and job.state in (JobState.FORMED, JobState.FORMING):
            (first, rank), more = seated[0], len(seated) - 1
            what = (f"worker {first.index} of host member {member_id} (node {member.node_key!r}, rank {rank})"
                    f"{f' and {more} more' if more else ''} {said}")
            self._lost(job, member_id, member, why, actions, what)
        elif job.state is JobState.FORMING:
            self._maybe_form(job, actions)
        return actions

    def restart(self, job_id: str, member_id: str, generation: int) -> Actions:
        """A member's launcher restarts its workers after a failure: the world of
        `generation` re-forms (generation + 1) with the members that renew their
        lease now, so that every node restarts into a fresh world and a dead one
        is left out once its lease runs out. Ignored unless `generation` is the
        job's current, formed one: members asking at once cause one re-form.

        Raises:
            NotFound: unknown job or member.
        """
        job = self._job(job_id)
        member = self._member(job, member_id)
        actions = Actions()
        if job.state is JobState.FORMED and generation == job.generation and job.in_world(member_id):
            # A worker failing is often a peer's node dying: seat only survivors
            # that renew after this (sessions renew at once on the Reforming).
            self._change(job, f"node {member.node_key!r} restarts its workers", actions, confirmed=member_id)
        return actions

    def keep_alive(self, job_id: str, member_id: str, generation: int, secret: str | None = None) -> tuple[float, int, Actions]:
        """Renews a member's lease (the unary form), given its secret (None: not checked).

        Returns:
            (lease ttl in seconds, the job's current generation, actions).

        Raises:
            NotFound: unknown job or member, or not its secret.
            Stale: `generation` is neither 0 nor the job's current one.
        """
        job = self._job(job_id)
        self._member(job, member_id, secret)
        if generation and generation != job.generation:
            raise Stale(
                f"member {member_id} of job {job_id!r} holds generation {generation} but the "
                f"current generation is {job.generation}"
            )
        current, actions = self.renew(job_id, member_id, generation)
        return self.lease_ttl_s, current, actions

    def leave(self, job_id: str, member_id: str, secret: str | None = None, job_secret: str | None = None,
              caller: Caller = SERVER, close: bool = False) -> Actions:
        """Removes a member, given its secret and, for a sealed job, the job's
        (None: not checked). With `close`, first closes the job for everyone
        (torchrun's shutdown of the run): CLOSED, every member and waiter told,
        later joins refused while the job is kept.

        Raises:
            Sealed: the job is sealed and `job_secret` does not open it.
            NotFound: unknown job or member, or not its secret.
        """
        job = self._job(job_id)
        self._unseal(job_id, job.seal, job_secret, caller, "this leave's job_secret is missing or wrong")
        member = self._member(job, member_id, secret)
        actions = Actions()
        if close and not (job.in_world(member_id, member) or caller.exempt):  # a standby, or a worker still waiting
            log.info("close_ignored", extra={"fields": {"job": job_id, "member": member_id, "node": member.node_key}})
            close = False  # it leaves; the run is its world's to close (or the admin's)
        if close and job.state is not JobState.CLOSED:
            self._stop(job, JobState.CLOSED, f"node {member.node_key!r} closed it (its launcher shut the run down)",
                       "was closed", actions)
        self._remove(job, member_id, "left", actions)
        return actions

    def next_deadline(self) -> Deadline | None:
        """The earliest time (on the injected clock) at which `expire_due` may have work (None: nothing is due ever)."""
        return earliest(self._leases.next(), self._last_calls.next(), self._tombstones.next())

    def expire_due(self, limit: int = 1000) -> tuple[Actions, bool]:
        """Removes members whose lease ran out, forms elastic worlds whose last
        call has passed, and forgets failed jobs kept long enough.

        At most `limit` members are removed, and `2 * limit` lease entries
        looked at, per call, so that an expiry storm (or ten thousand leases
        of one world coming up for their lazy check at once) yields the event
        loop between calls.

        Returns:
            The actions, and whether more is due already.
        """
        now = self._clock()
        actions = Actions()
        removed = popped = 0
        while removed < limit and popped < 2 * limit:
            entry = self._leases.pop_due(now)
            if entry is None:
                break
            popped += 1
            job_id, member_id = entry[1]
            job = self._jobs.get(job_id)
            member = job.members.get(member_id) if job is not None else None
            if member is None or entry[0] != member.queued:
                continue  # gone, or a stale entry (its live one is earlier or later)
            member.queued = None
            if member.lease is Lease.IN_JOIN:
                continue  # bound to a Join call again
            if member.lease_deadline > now:
                self._queue(job_id, member_id, member, member.lease_deadline)  # renewed since: wait for the new deadline
                continue
            self._remove(job, member_id, DISCONNECTED if member.lease is Lease.DETACHED else "expired", actions)
            removed += 1
        while (entry := self._last_calls.pop_due(now)) is not None:
            job = self._jobs.get(entry[1])
            if job is None:
                continue
            job.last_call_armed = False
            if job.state is JobState.FORMING and job.spec.min_size is not None:
                if now < job.last_arrival + job.spec.last_call_s:
                    self._arm_last_call(job)
                else:
                    self._maybe_form(job, actions)
        self._forget_due(now, actions)
        due = self.next_deadline()
        return actions, due is not None and due <= now

    def _remove(self, job: Job, member_id: str, why: str, actions: Actions) -> None:
        member = job.members.pop(member_id)
        self._members -= 1
        if member.held:
            self.shares.give(WORKERS, Caller(member.caller, ""), member.held)
        job.version += 1
        in_world = job.in_world(member_id, member)
        job.placed -= job.seated(member_id, member)
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
        said = "withdrew (its Join call ended before it was placed)" if why == "withdrawn" else _SAID.get(why, why)
        self._event(job, EventKind.LEFT if why in ("left", "withdrawn") else EventKind.LOST,
                    f"member {member_id} ({where}) {said}", actions, member=member_id, node=member.node_key,
                    rank=rank, why=why)
        if member.session is not None and why != "left":
            actions.pushes.append((member.session, Gone(f"member {member_id} {_SAID.get(why, why)}")))
        if why != "withdrawn":  # a member waiting in Join learns at once that it is gone
            actions.wakes.append((job.job_id, MemberGone(member_id)))
        if not job.members:  # the run has ended: kept a while (also across a restart), and the id is free
            if not job.state.over and job.generation > 0:  # the last of a world, with no verdict yet
                left = why == "left"
                job.state = JobState.ENDED if left else JobState.FAILED
                job.reason = f"member {member_id} ({where}) {said}, the last to go"
                self._event(job, EventKind.ENDED if left else EventKind.FAILED, f"{'finished' if left else 'failed'}: {job.reason}",
                            actions, reason=job.reason)
            del self._jobs[job.job_id]
            self.shares.give(JOBS, job.creator)
            self._end_run(job, actions)
        elif in_world and job.generation > 0 and job.state in (JobState.FORMED, JobState.FORMING):
            self._lost(job, member_id, member, why, actions)
        elif job.state is JobState.FORMING:
            self._maybe_form(job, actions)  # a waiting worker's leaving may be all that held the world back

    def _lost(self, job: Job, member_id: str, member: Member, why: str, actions: Actions, what: str = "") -> None:
        """A member of a formed (or re-forming) world is gone (`what` says so
        when it is a host membership's worker that is)."""
        job.abandoned |= why != "left"
        rank = job.rank_of(member_id, member)
        what = what or f"member {member_id} (node {member.node_key!r}, rank {rank}) {_SAID.get(why, why)}"
        n, unit = (job.units, "node") if job.spec.nodes else (job.workers, "worker")
        remain = f"{n} {unit}{'s' * (n != 1)} remain{'s' * (n == 1)}"
        if job.units < job.spec.min_world and why == "left":  # members leaving: the job is finishing
            fixed = job.spec.min_size is None and not job.spec.nodes  # a fixed world ends when its first worker leaves
            reason = (f"{what}, the first of its {job.spec.world_size} workers to go" if fixed else
                      f"{what}; {remain}, below the minimum of {job.spec.min_world}")
            self._stop(job, JobState.ENDED, reason, "finished", actions)
        elif job.units < job.spec.min_world and not job.spec.nodes:
            reason = f"{what}; {remain}, fewer than the minimum of {job.spec.min_world}"
            self._stop(job, JobState.FAILED, reason, "cannot continue", actions)
        elif job.units < job.spec.min_world:  # torchrun's nodes wait for a replacement until their join_timeout, as c10d's do
            reason = f"{what}; {remain}, waiting for {job.spec.min_world - n} more to reach the minimum of {job.spec.min_world}"
            if job.state is JobState.FORMED:
                self._change(job, reason, actions)
            else:
                job.reason = reason
        elif job.state is JobState.FORMED:
            self._change(job, what, actions)
        else:
            job.reason = what
            self._maybe_form(job, actions)

    def _queue(self, job_id: str, member_id: str, member: Member, deadline: float) -> None:
        """Makes sure the lease heap holds an entry for the member due by
        `deadline`: pushed only when its live entry is due later (a stretched
        first lease, a grace shorter than the lease), so a renewal costs no push."""
        if member.queued is None or deadline < member.queued:
            member.queued = deadline
            self._leases.push(deadline, (job_id, member_id))

    def _oldest_lease(self) -> Deadline | None:
        """The earliest lease deadline (None: no lease runs), bringing stale heap entries up to date on the way."""
        while (top := self._leases.next()) is not None:
            entry = self._leases.pop_due(top)
            job_id, member_id = entry[1]
            job = self._jobs.get(job_id)
            member = job.members.get(member_id) if job is not None else None
            if member is None or entry[0] != member.queued:
                continue
            member.queued = None
            if member.lease is Lease.IN_JOIN:
                continue
            self._queue(job_id, member_id, member, member.lease_deadline)
            if member.lease_deadline == top:
                return top
        return None
