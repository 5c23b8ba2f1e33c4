"""Sessions: what a member's session and renewals tell the machine (a
session opened, ended, or replaced; a renewal and the spare port it offers; a
failed collective reported; a launcher restarting its workers). The leases
themselves are the lessor's (leases.py); removing members is leaving.py's."""

from __future__ import annotations

from ..errors import BadRequest, Closed, Conflict, Stale
from .actions import Actions
from .forming import Forming
from .history import History
from .leases import Lessor
from .leaving import Leaving
from .model import BROKE_OFF, Gone, Job, Jobs, JobState, Lease, Reforming, Replaced, SessionEvent, member_of
from .store import PutMember, member_record


def serves_store(job: Job, member_id: str, port: int) -> bool:
    """Whether `port` is the one `member_id` serves its world's TCPStore on (its
    spare, spent when it became rank 0): offered again (a session opening with
    the port its Join offered, a renewal sent before its new spare), it is no spare."""
    plan = job.plan
    return plan is not None and plan.master_port == port and member_of(plan.seats.nodes[0].members[0]) == member_id


class Sessions:
    """What members' sessions and renewals tell the machine. Its state: the
    machine's jobs (shared), and the parts it tells: the lessor, and the
    deciders for leaving and forming; runs are looked up in the history."""

    def __init__(self, jobs: Jobs, lessor: Lessor, leaving: Leaving, forming: Forming, history: History) -> None:
        self._jobs = jobs
        self._lessor = lessor
        self._leaving = leaving
        self._forming = forming
        self._history = history

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
        job = self._history.find(job_id)
        member = job.member(member_id, secret)
        if generation < member.generation:
            raise Stale(f"member {member_id} of job {job_id!r} holds generation {member.generation}; a session "
                        f"naming generation {generation} cannot take over its membership")
        older = member.sink  # renew() below takes a DETACHED member back
        missed: list[SessionEvent] = []
        if job.state.over:  # a session opened after its job stopped: told at once, as the others were
            missed.append(Gone(stopped(job), job.state is not JobState.FAILED, job.state is JobState.CLOSED))
        elif job.in_world(member_id):
            if generation < job.generation:  # the world it missed, re-forming or not: its store and next spare come from it
                missed.append(job.world(job.previous_plan))
            if job.state is JobState.FORMING and job.announced:
                missed.append(Reforming(job.generation, job.reason, job.abandoned))
        member.sink = sink
        _, actions = self.renew(job_id, member_id, generation, spare_port)
        if older is not None and older is not sink:
            actions.pushes.append((older, Replaced(f"member {member_id} of job {job_id!r} opened a newer session")))
        return self._lessor.ttl_s, missed, actions

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
        job = self._jobs.live.get(job_id)
        member = job.members.get(member_id) if job is not None else None
        if member is None or member.sink is not sink:
            return actions
        member.sink = None
        if (departed and member.lease in (Lease.FIRST, Lease.RENEWING) and job.failed == job.generation
                and job.in_world(member_id) and len(member.slots) <= 1):  # a host's other workers may take its session over
            self._leaving.remove(job, member_id, BROKE_OFF, actions)
        elif departed and member.lease in (Lease.FIRST, Lease.RENEWING):
            self._lessor.detach(job_id, member_id, member)
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
        job = self._history.find(job_id)
        member = job.member(member_id)
        actions = Actions()
        attach = generation >= member.generation  # a DETACHED member heard from within the grace, unless a stale process
        if member.generation < generation <= job.generation:  # a later one is nonsense, and would lock the member out
            member.generation = generation
        self._lessor.renew(job_id, member_id, member, attach)
        if (spare_port and generation == job.generation and spare_port != member.port
                and not serves_store(job, member_id, spare_port)):
            member.port = spare_port
            job.version += 1
            actions.writes.append(PutMember(job_id, member_record(member_id, member)))
        if job.suspects and member_id in job.suspects and member.port:
            job.suspects.discard(member_id)
            self._forming.maybe_form(job, actions)
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
        job = self._history.find(job_id)
        job.member(member_id)
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
                self._leaving.remove(job, mid, BROKE_OFF, actions)
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
        job = self._history.find(job_id)
        member = job.member(member_id)
        actions = Actions()
        if job.state is JobState.FORMED and generation == job.generation and job.in_world(member_id):
            # A worker failing is often a peer's node dying: seat only survivors
            # that renew after this (sessions renew at once on the Reforming).
            self._forming.change(job, f"node {member.node_key!r} restarts its workers", actions, confirmed=member_id)
        return actions

    def keep_alive(self, job_id: str, member_id: str, generation: int, secret: str | None = None) -> tuple[float, int, Actions]:
        """Renews a member's lease (the unary form), given its secret (None: not checked).

        Returns:
            (lease ttl in seconds, the job's current generation, actions).

        Raises:
            NotFound: unknown job or member, or not its secret.
            Stale: `generation` is neither 0 nor the job's current one.
            Conflict, Closed: the member's run stopped (failed, ended, closed):
                told as a session is, and not renewed, so that the id frees for
                its next run once its members are gone.
        """
        job = self._history.find(job_id)
        job.member(member_id, secret)
        if job.state.over:
            raise (Closed if job.state is JobState.CLOSED else Conflict)(stopped(job))
        if generation and generation != job.generation:
            raise Stale(
                f"member {member_id} of job {job_id!r} holds generation {generation} but the "
                f"current generation is {job.generation}"
            )
        current, actions = self.renew(job_id, member_id, generation)
        return self._lessor.ttl_s, current, actions


def stopped(job: Job) -> str:
    """What a member of a run that stopped is told, by a session or a KeepAlive."""
    verb = {JobState.FAILED: "cannot continue", JobState.ENDED: "finished", JobState.CLOSED: "was closed"}[job.state]
    return f"job {job.job_id!r} {verb}: {job.reason}"
