"""The rendezvous state machine: synchronous transitions over the in-memory
model, each returning the `Actions` it implies (records to persist, events to
push to sessions, Join waiters to wake, notes for operators). The executor
carries them out in that order; no transition awaits or does I/O.

A job's life, generation by generation:

  FORMING (g)  workers join; the world forms as generation g+1 when the spec
               allows it: world_size workers (the maximum) are present, or, for
               an elastic job, at least min_size are and nobody new arrived for
               the last-call window; and no survivor of generation g is awaited.
  FORMED (g)   the world of generation g runs. Elastic jobs below their maximum
               admit joiners, who wait; their arrival re-forms the world.
  FAILED       the joined workers cannot form a valid world, or members of a
               world expired and fewer than min_size remain. Kept, with its
               reason, until every member has gone (and a while longer).
  ENDED        members left (gracefully) and fewer than min_size remain: a
               job finishing. Kept until every member has gone.

Re-forming. A member leaving or expiring, or joiners arriving at an elastic
world, turns FORMED (g) into FORMING (g). Every member holds a spare listening
port the server knows of (offered at Join; rank 0, whose spare becomes the
TCPStore's port, offers a new one on its session), so the next world needs
nothing from its survivors but to be alive. A survivor whose lease was renewed
within the last half TTL is alive (clients renew every third); the others are
awaited until they renew or expire. When a host dies, its workers' leases run
out one by one; the first expiry finds the others already stale, so the next
world forms without them rather than seating the dead. With nobody awaited
the world forms at once and each survivor gets one message, its new
assignment; otherwise survivors are told at once (WorldChange) and get the
assignment when it forms. Survivors keep their node and local ranks where the
new shape allows (the rank rule in planning/world.py).

A worker is bound to its Join call until it is placed in a world (ending the
call withdraws it); placed, it holds a lease that its session renews. Expiry
and leaving are the same transition. A job disappears when its last member
goes. Leases, last calls and kept failed jobs wait in deadline heaps; the
reaper pops only what is due.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import ipaddress
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable

from ..errors import (
    AlreadyExists,
    Closed,
    Conflict,
    InvalidArgument,
    JobFull,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    RendezvousError,
    StaleGeneration,
)
from ..planning import JobSpec, PlanError, WorldPlan, build_plan, elide, plan_world
from .deadlines import Deadlines
from .shares import JOBS, SERVER, Caller, Guesses, Shares
from .model import (
    DISCONNECTED,
    EventKind,
    Gone,
    Job,
    JobEvent,
    JobState,
    JobStopped,
    JobView,
    Joined,
    JoinParams,
    Lease,
    Limits,
    Member,
    MemberGone,
    NewWorld,
    Node,
    NodeView,
    Note,
    PlanRequest,
    Replaced,
    SessionEvent,
    Stats,
    WaitOutcome,
    WorkerView,
    WorldChange,
    job_secret_matches,
    secret_matches,
    worker_id,
)
from .store import DeleteJob, DeleteMember, JobRecord, MemberRecord, PutEvent, PutJob, PutMember, TrimEvents, Write

log = logging.getLogger("commctx.server")

# Why a member was removed ("left", "expired", "withdrawn", DISCONNECTED), as said to people.
_SAID = {DISCONNECTED: "disconnected: session closed without leave"}


class Actions:
    """What a transition implies, for the executor to carry out in this order:
    persist `writes`, hand `notes` to telemetry, put `pushes` in session sinks,
    wake Join waiters with `wakes`, and plan `plans` off the event loop."""

    __slots__ = ("writes", "notes", "pushes", "wakes", "plans", "events")

    def __init__(self) -> None:
        self.writes: list[Write] = []
        self.notes: list[Note] = []
        self.pushes: list[tuple[object, SessionEvent]] = []  # (session sink, event)
        self.wakes: list[tuple[str, WaitOutcome]] = []  # (job id, outcome)
        self.plans: list[PlanRequest] = []
        self.events: list[tuple[str, JobEvent]] = []  # (job id, event) for those watching its history

    def __bool__(self) -> bool:
        return bool(self.writes or self.notes or self.pushes or self.wakes or self.plans or self.events)

    def extend(self, other: Actions) -> None:
        for name in self.__slots__:
            getattr(self, name).extend(getattr(other, name))

    def __repr__(self) -> str:
        return (f"Actions(writes={self.writes!r}, notes={self.notes!r}, pushes={self.pushes!r}, wakes={self.wakes!r}, "
                f"plans={self.plans!r}, events={self.events!r})")


def plan_or_error(candidates: list, spec: JobSpec) -> WorldPlan | PlanError:
    """`plan_world`, any failure as a PlanError: a planner bug fails the one job
    it meets, saying so, instead of a Join half done or a server error."""
    try:
        return plan_world(candidates, spec)
    except PlanError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - a bug; logged with its traceback for the report
        log.exception("planner_failed")
        return PlanError(f"the planner failed on this spec ({type(exc).__name__}: {elide(str(exc))}); "
                         "this is a commctx bug, please report it with the spec")


class Rendezvous:
    """Every job the server holds, and the rules for joining and leaving them.

    Every method runs to completion synchronously; those that change state
    return `Actions`. The clock is injected.
    """

    # Worlds of more workers are planned off the event loop (a 10,000-worker
    # plan is tens of milliseconds of Python); smaller ones inside the transition.
    PLAN_INLINE_MAX = 2048
    # A newly placed member's first lease also covers the time the server takes
    # to open the sessions of its whole world: about a millisecond each in
    # grpc.aio (benchmarks/reform_scale.py), so 10 s more for 10,000 workers.
    # A worker must not lose its seat to the server's own backlog.
    SESSION_OPEN_S = 0.001

    def __init__(
        self,
        *,
        lease_ttl_s: float = 10.0,
        reconnect_grace_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        new_member_id: Callable[[], str] | None = None,
        plan_inline_max: int = PLAN_INLINE_MAX,
        limits: Limits = Limits(),
    ) -> None:
        self.lease_ttl_s = lease_ttl_s
        self.reconnect_grace_s = min(reconnect_grace_s, lease_ttl_s)
        self.limits = limits
        self.shares = Shares(limits)  # what each caller holds (jobs here; Joins waiting and streams at the RPC edge)
        self.guesses = Guesses(clock)  # wrong job secrets, by caller and job
        self._members = 0  # across all jobs
        self.plan_inline_max = plan_inline_max
        self._clock = clock
        self._wall = wall  # persisted times (AGE, how long a failed job is kept) survive a restart on it
        self._new_member_id = new_member_id or (lambda: os.urandom(8).hex())
        self._jobs: dict[str, Job] = {}
        self._held: str | None = None  # why no world may form now (the store refuses writes), or None
        self._seq = 0
        # Jobs that failed, kept a while after their last worker left so that
        # DescribeJob can still say why.
        self._failed: dict[str, tuple[JobView, float, Iterable[JobEvent]]] = {}  # view, until, history
        # What a transition that raised still implies (a refused join's event):
        # the executor takes it with the next actions it is given (take_outbox).
        self._outbox = Actions()
        self._leases = Deadlines()  # (job id, member id)
        self._last_calls = Deadlines()  # job id
        self._tombstones = Deadlines()  # job id

    def now(self) -> float:
        """The injected clock: what deadlines are measured on."""
        return self._clock()

    # -- joining -------------------------------------------------------------

    def join(self, p: JoinParams, caller: Caller = SERVER) -> tuple[Joined, Actions, NewWorld | None]:
        """Registers a worker, or re-attaches one that joined before with the
        same member id; forms the world when the spec allows.

        Returns:
            The membership, the actions, and the world the worker already sits
            in (a re-attached member of a formed world), else None.

        Raises:
            Conflict: the spec, a node rank, a role or the address family
                disagrees with the job, the job has failed or ended, or a
                member id is reused with other parameters.
            AlreadyExists: the local rank or node rank is held by another worker.
            JobFull: the job (or the role) already has all its workers.
            LimitExceeded: the server holds its maximum of members or jobs, or
                the caller its share of jobs (shares.py).
        """
        job = self._jobs.get(p.job_id)
        if job is not None:
            try:
                self._check_seal(job, p, caller)  # first: a stranger learns nothing about a sealed job
                if p.member_id and p.member_id in job.members:
                    return self._reattach(job, p)
                self._check_admissible(job, p)
                node = job.nodes.get(p.node_key)
                if node is not None:
                    self._check_node(job, node, p)
                elif p.node_rank is not None and p.node_rank in job.node_ranks:
                    raise AlreadyExists(
                        f"node_rank {p.node_rank} is already held by node {job.node_ranks[p.node_rank]!r} "
                        f"in job {p.job_id!r}; node {p.node_key!r} cannot take it"
                    )
                self._check_room(p)
            except RendezvousError as exc:
                self._refused(job, p, exc)
                raise
        else:
            self._check_room(p)
        kept = self._failed.get(p.job_id) if job is None else None
        if kept is not None and kept[0].state is JobState.CLOSED:
            raise Closed(f"job {p.job_id!r} was closed: {kept[0].reason}; it takes no more joins for "
                         f"{max(0.0, kept[1] - self._clock()):.0f} s (use another job id)")
        if job is None and len(self._jobs) >= self.limits.max_jobs:
            raise LimitExceeded(f"this server holds its maximum of {self.limits.max_jobs} jobs (--max-jobs); "
                                f"job {p.job_id!r} cannot be created now")
        if job is None:
            p.spec.check_declared(p.job_id, p.role)
            self.shares.take(JOBS, caller)  # last: nothing to give back if it refuses
        now = self._clock()
        actions = Actions()
        if job is None:
            if self._failed.pop(p.job_id, None) is not None:
                actions.events.append((p.job_id, None))  # the failed job of this id is gone: its watches end
            job = self._jobs[p.job_id] = Job(p.job_id, p.spec, p.loopback, now)
            job.seal, job.creator = p.seal, caller
            actions.writes.append(PutJob(self._record(job)))
        member_id = p.member_id or self._new_member_id()
        self._seq += 1
        member = self._add_member(job, member_id, p, self._seq)
        self._members += 1
        job.last_arrival = now
        actions.writes.append(PutMember(job.job_id, _member_record(member_id, member)))
        actions.notes.append(Note("join", {"job": job.job_id, "member": member_id, "node": member.node_key, "role": p.role,
                                           "joined": job.workers, "world_size": job.spec.world_size}))
        what = f"{p.workers} workers of node {p.node_key!r}" if p.workers > 1 else f"a worker of node {p.node_key!r}"
        self._event(job, EventKind.JOINED, f"{what}{f' (role {p.role!r})' if p.role else ''} joined; {job.count()}",
                    actions, member=member_id, node=p.node_key, role=p.role, workers=p.workers)
        if job.state is JobState.FORMED:
            waiting = job.workers - job.placed
            if (job.workers == len(job.members) and not job.spec.nodes) or self._grows(job):
                self._change(job, f"{waiting} worker{'s' * (waiting > 1)} waiting to join can grow the world", actions)
        else:
            self._maybe_form(job, actions)
        self._arm_last_call(job)
        return Joined(job.job_id, member_id, self.lease_ttl_s, job.workers), actions, None

    def _check_room(self, p: JoinParams) -> None:
        if self._members >= self.limits.max_members:
            raise LimitExceeded(f"this server holds its maximum of {self.limits.max_members} members (--max-members); "
                                f"node {p.node_key!r} cannot join job {p.job_id!r} now")

    def _refused(self, job: Job, p: JoinParams, exc: RendezvousError) -> None:
        """Counts a refused join in the job; records it in the job's history
        unless the same refusal was recorded within Refusals.QUIET_S."""
        reason = str(exc)
        held = job.refused.note(reason, self._clock())
        if held is not None:
            more = f" ({held} more like it since the last)" if held else ""
            self._event(job, EventKind.REFUSED, f"refused node {p.node_key!r}: {reason}{more}", self._outbox,
                        node=p.node_key, error=type(exc).__name__, held=held)

    @property
    def has_outbox(self) -> bool:
        return bool(self._outbox)

    def take_outbox(self) -> Actions:
        """What transitions that raised still implied (refusals' events), to carry out now."""
        out, self._outbox = self._outbox, Actions()
        return out

    # -- history -----------------------------------------------------------------

    JOIN_COALESCE_S = 1.0  # joins within this long of a job's "joined" event are counted in it

    def _event(self, job: Job, kind: EventKind, message: str, actions: Actions, **fields: object) -> None:
        """Appends an event to the job's history (the last max_events_per_job are kept):
        persisted with the transition's writes, then published to its watchers."""
        now = self._wall()
        events = job.events
        if events.maxlen != self.limits.max_events_per_job:
            job.events = events = collections.deque(events, maxlen=self.limits.max_events_per_job)
        last = events[-1] if events else None
        if (kind is EventKind.JOINED and last is not None and last.kind == EventKind.JOINED.value
                and last.generation == job.generation and now - last.fields.get("first", last.time) < self.JOIN_COALESCE_S):
            count = last.fields.get("workers", 1) + fields.get("workers", 1)
            first = last.fields.get("first", last.time)
            event = last._replace(time=now, message=f"{count} workers joined in {now - first:.1f} s (the last on node "
                                                    f"{fields.get('node')!r}); {job.count()}",
                                  fields={**fields, "workers": count, "first": first})
            events[-1] = event  # a count that grew: the same seq, replaced
        else:
            event = JobEvent(last.seq + 1 if last is not None else 1, now, kind.value, job.generation, message, fields)
            dropped = len(events) == events.maxlen
            events.append(event)
            if dropped and events[0].seq % 64 == 0:  # the store forgets the dropped ones now and then, not each time
                actions.writes.append(TrimEvents(job.job_id, events[0].seq))
        actions.writes.append(PutEvent(job.job_id, event))
        actions.events.append((job.job_id, event))

    def _unseal(self, job_id: str, seal: str, secret: str | None, caller: Caller, what: str) -> None:
        """Whether `secret` opens the job (None: not asked, for operators and the
        server); wrong secrets are counted by caller and job (shares.Guesses).

        Raises:
            LimitExceeded: the caller gave too many wrong ones for this job lately.
            PermissionDenied: the job is sealed and `secret` does not open it.
        """
        if secret is None:
            return
        self.guesses.check(caller, job_id)
        if not job_secret_matches(seal, secret):
            self.guesses.failed(caller, job_id)
            raise PermissionDenied(f"job {job_id!r} is sealed: {what}")

    def last_event(self, job_id: str) -> JobEvent | None:
        """The job's latest event (None: none, or an unknown job)."""
        job = self._jobs.get(job_id)
        history = job.events if job is not None else self._failed.get(job_id, (None, None, ()))[2]
        return history[-1] if history else None

    def events(self, job_id: str, after: int = 0, limit: int | None = None, secret: str | None = None,
               caller: Caller = SERVER) -> list[JobEvent]:
        """The job's kept events of seq above `after` (at most `limit`), of a
        job held or a failed one kept; for a sealed job, given its secret (None:
        not checked).

        Raises:
            NotFound: an unknown job.
            PermissionDenied: the job is sealed and `secret` does not open it.
        """
        job = self._jobs.get(job_id)
        if job is not None:
            seal, history = job.seal, job.events
        elif job_id in self._failed:
            view, _, history = self._failed[job_id]
            seal = view.seal
        else:
            raise NotFound(f"no job {elide(job_id)} on this server")
        self._unseal(job_id, seal, secret, caller, "give its job_secret to read its events")
        out = []
        for event in reversed(history):  # the newest first: a follower asks for a few after its cursor
            if event.seq <= after:
                break
            out.append(event)
        out.reverse()
        return out if limit is None else out[:limit]

    @staticmethod
    def _add_member(job: Job, member_id: str, p: JoinParams, seq: int) -> Member:
        """Enters a member in the job's node, rank and role bookkeeping (undone by _remove)."""
        node = job.nodes.get(p.node_key)
        if node is None:
            node = job.nodes[p.node_key] = Node(p.node_key, p.address)
        if p.node_rank is not None and node.node_rank is None:
            node.node_rank = p.node_rank
            job.node_ranks[p.node_rank] = node.key
        if p.local_rank is not None:
            node.local_ranks[p.local_rank] = member_id
        if p.workers > 1 or job.spec.nodes:  # a node membership: its node alone
            node.agent = member_id
        node.workers += p.workers
        node.roles[p.role] = node.roles.get(p.role, 0) + p.workers
        job.role_counts[p.role] = job.role_counts.get(p.role, 0) + p.workers
        job.workers += p.workers
        job.version += 1
        member = job.members[member_id] = Member(node, p, seq)
        return member

    def _reattach(self, job: Job, p: JoinParams) -> tuple[Joined, Actions, NewWorld | None]:
        member = job.members[p.member_id]
        same = (member.node_key, member.address, member.local_rank, member.node_rank, member.role, member.workers) == (
            p.node_key, p.address, p.local_rank, p.node_rank, p.role, p.workers)
        if not same or job.spec != p.spec:
            raise Conflict(f"member {p.member_id} of job {job.job_id!r} joined before with other parameters")
        if member.secret != p.secret:
            raise Conflict(f"member {p.member_id} of job {job.job_id!r} joined before with another member_secret; "
                           f"re-attach with the same one, or join with a new member_id")
        actions = Actions()
        joined = Joined(job.job_id, p.member_id, self.lease_ttl_s, job.workers)
        if job.in_world(p.member_id):
            if job.state is JobState.FORMED:
                return joined, actions, NewWorld(job.job_id, job.generation, job.plan, None, job.reason)
            return joined, actions, None
        member.lease, member.lease_deadline = Lease.IN_JOIN, math.inf  # bound to this call again
        if member.port != p.port:
            member.port = p.port
            job.version += 1
            actions.writes.append(PutMember(job.job_id, _member_record(p.member_id, member)))
        self._maybe_form(job, actions)
        return joined, actions, None

    def _check_seal(self, job: Job, p: JoinParams, caller: Caller) -> None:
        self.guesses.check(caller, job.job_id)
        if job.seal and not hmac.compare_digest(job.seal, p.seal):
            self.guesses.failed(caller, job.job_id)
            raise PermissionDenied(f"job {job.job_id!r} is sealed: this join's job_secret is missing or wrong")
        if p.seal and not job.seal:
            raise Conflict(f"job {job.job_id!r} is not sealed, but this join carries a job_secret; "
                           f"every worker of a job passes the same one, or none")

    def _check_admissible(self, job: Job, p: JoinParams) -> None:
        if job.spec != p.spec:
            raise Conflict(f"job {job.job_id!r} has {job.spec.difference(p.spec)}")
        if job.state is JobState.CLOSED:
            raise Closed(f"job {job.job_id!r} was closed: {job.reason}")
        if job.state is JobState.FAILED:
            raise Conflict(f"job {job.job_id!r} cannot form: {job.reason}")
        if job.state is JobState.ENDED:
            raise Conflict(f"job {job.job_id!r} has ended ({job.reason}); use another job id or wait until its members have left")
        if job.spec.nodes:  # a job of nodes: beyond its maximum, as many again wait as standbys
            if job.units >= 2 * job.spec.world_size:
                raise JobFull(f"job {job.job_id!r} has all {job.spec.world_size} nodes and as many standbys; node "
                              f"{p.node_key!r} cannot join it")
        elif job.workers + p.workers > job.spec.world_size:
            if job.workers >= job.spec.world_size:
                raise JobFull(
                    f"job {job.job_id!r} already has all {job.spec.world_size} workers "
                    f"(generation {job.generation}); node {p.node_key!r} cannot join it"
                )
            raise JobFull(f"job {job.job_id!r} has {job.workers} of {job.spec.world_size} workers; node {p.node_key!r} "
                          f"cannot add {p.workers} more")
        job.spec.check_declared(job.job_id, p.role)
        declared = job.spec.role_count(p.role)
        held = job.role_counts.get(p.role, 0)
        if declared is not None and held + p.workers > declared:
            if held >= declared:
                raise JobFull(f"job {job.job_id!r} already has all {declared} workers of role {p.role!r}")
            raise JobFull(f"job {job.job_id!r} has {held} of its {declared} workers of role {p.role!r}; "
                          f"node {p.node_key!r} cannot add {p.workers} more")
        if p.loopback != job.loopback:
            first = next(iter(job.nodes.values()))
            raise Conflict(
                f"job {job.job_id!r}: node {first.key!r} advertises {first.address} but this worker "
                f"(node {p.node_key!r}) advertises {p.address}; a job cannot mix loopback and "
                f"routable addresses, since peers on other hosts cannot reach a loopback address"
            )

    @staticmethod
    def _check_node(job: Job, node: Node, p: JoinParams) -> None:
        if node.agent or p.workers > 1:
            raise AlreadyExists(f"node {node.key!r} of job {job.job_id!r} is already joined"
                                f"{' as a whole node by its launcher' if node.agent else ''}; a node membership "
                                f"(workers > 1) holds its node alone")
        if p.node_rank is not None:
            if node.node_rank is not None and node.node_rank != p.node_rank:
                raise Conflict(
                    f"node {node.key!r} of job {job.job_id!r} has node_rank {node.node_rank} but this "
                    f"worker asked for node_rank {p.node_rank}"
                )
            holder = job.node_ranks.get(p.node_rank)
            if holder is not None and holder != node.key:
                raise AlreadyExists(f"node_rank {p.node_rank} is already held by node {holder!r} in job {job.job_id!r}")
        if p.local_rank is not None and p.local_rank in node.local_ranks:
            raise AlreadyExists(
                f"local_rank {p.local_rank} on node {node.key!r} of job {job.job_id!r} is already held by another worker"
            )

    def withdraw(self, job_id: str, member_id: str) -> Actions:
        """The member's Join call ended. Unless it was placed in a world, this
        removes it; placed, its lease governs."""
        actions = Actions()
        job = self._jobs.get(job_id)
        member = job.members.get(member_id) if job is not None else None
        if member is None or member.lease is not Lease.IN_JOIN or job.in_world(member_id):
            return actions
        self._remove(job, member_id, "withdrawn", actions)
        return actions

    # -- forming ---------------------------------------------------------------

    def _change(self, job: Job, reason: str, actions: Actions, confirmed: str | None = None) -> None:
        """FORMED -> FORMING: the world of this generation is to be replaced.
        With `confirmed`, every other survivor is awaited until it renews."""
        now = self._clock()
        job.state = JobState.FORMING
        job.forming_since = now
        job.reason = reason
        job.announced = False
        stale_before = now + self.lease_ttl_s / 2
        job.suspects = {mid for mid in job.survivors()
                        if job.members[mid].lease_deadline < stale_before or (confirmed is not None and mid != confirmed)}
        actions.notes.append(Note("reforming", {"job": job.job_id, "generation": job.generation, "reason": reason}))
        self._event(job, EventKind.REFORMING, f"generation {job.generation} is re-forming: {reason}", actions, reason=reason)
        self._maybe_form(job, actions)
        if job.state is JobState.FORMING:
            self._announce(job, actions)
            actions.writes.append(PutJob(self._record(job)))

    def _announce(self, job: Job, actions: Actions) -> None:
        """Tells the survivors that the world is re-forming (once per change),
        unless the plan of the next world is already being computed: then its
        assignment, a few milliseconds later, is the one message they need."""
        if job.announced or job.planning == job.version:
            return
        job.announced = True
        change = WorldChange(job.generation, job.reason)
        for mid in job.survivors():
            sink = job.members[mid].session
            if sink is not None:
                actions.pushes.append((sink, change))

    def _formable(self, job: Job) -> int | None:
        """How many workers the next world takes now, or None to keep waiting."""
        spec = job.spec
        if job.state is not JobState.FORMING or job.suspects:
            return None
        if spec.nodes:
            return self._formable_nodes(job)
        n = job.workers
        if n >= spec.world_size:
            n = spec.world_size if spec.admissible(spec.world_size) else None
        elif spec.min_size is None or n < spec.min_size:
            return None
        # The last call collects arrivals; survivors re-forming without
        # newcomers have nobody to wait for.
        elif n > job.placed and self._clock() < job.last_arrival + spec.last_call_s:
            return None
        else:
            n = spec.largest_world(n)
        if n is not None and job.workers != len(job.members):  # node memberships: whole ones only
            n = len(self._candidates(job, n))
            if n < spec.min_world or not spec.admissible(n):
                return None  # they fit no admissible size: wait for others to come or go
        return n

    def _formable_nodes(self, job: Job) -> int | None:
        """_formable for a job of nodes: as many nodes as its maximum allows (the
        survivors first, then in join order), or at least its minimum once the
        last call has passed; in workers, a multiple of its layout's step."""
        spec, n = job.spec, job.units
        if n < spec.min_world:
            return None
        if n < spec.world_size and job.workers > job.placed and self._clock() < job.last_arrival + spec.last_call_s:
            return None  # the last call collects arrivals; survivors re-forming alone have nobody to wait for
        sizes = [job.members[mid].workers for mid in self._member_order(job)][:spec.world_size]
        while len(sizes) >= spec.min_world:
            workers = sum(sizes)
            if workers % spec.step == 0:
                return workers
            sizes.pop()
        return None

    def _maybe_form(self, job: Job, actions: Actions) -> None:
        n = self._formable(job)
        if n is not None:
            self._form(job, n, actions)

    def _grows(self, job: Job) -> bool:
        """Whether the node memberships present fit a world larger than the formed one."""
        if job.spec.nodes:
            return job.plan.num_nodes < job.spec.world_size and job.units > job.plan.num_nodes
        size = job.spec.largest_world(min(job.workers, job.spec.world_size))
        return size is not None and len(self._candidates(job, size)) > job.placed

    @staticmethod
    def _seats(job: Job) -> dict[str, tuple[int, int]]:
        """The (node rank, local rank) in the world being replaced of each member still here."""
        previous, members = job.plan, job.members
        seats: dict[str, tuple[int, int]] = {}
        if previous is not None:
            for node_rank, node in enumerate(previous.seating.nodes):
                for local_rank, mid in enumerate(node.members):
                    if mid in members:
                        seats[mid] = (node_rank, local_rank)
        return seats

    @classmethod
    def _member_order(cls, job: Job, seats: dict[str, tuple[int, int]] | None = None) -> list[str]:
        """Members in the order the next world takes them: survivors first, in
        their previous rank order (the seating's), then newcomers in join order."""
        seats = cls._seats(job) if seats is None else seats
        return [*seats, *(mid for mid in job.members if mid not in seats)] if seats else list(job.members)

    @classmethod
    def _candidates(cls, job: Job, n: int) -> list:
        """The next world's workers, in _member_order; whole members, so at most `n`."""
        members = job.members
        seats = cls._seats(job)
        candidates = []
        for mid in cls._member_order(job, seats):
            m = members[mid]
            if len(candidates) + m.workers <= n:
                candidates += m.candidates(mid, seats.get(mid))
                if len(candidates) == n:
                    break
        return candidates

    def _form(self, job: Job, n: int, actions: Actions) -> None:
        candidates = self._candidates(job, n)
        spec = job.spec.at_size(n)
        if n > self.plan_inline_max:
            if job.planning != job.version:  # else the plan for exactly these candidates is on its way
                job.planning = job.version
                actions.plans.append(PlanRequest(job.job_id, job.version, tuple(candidates), spec))
            return
        self._seat(job, plan_or_error(candidates, spec), actions)

    def planned(self, request: PlanRequest, plan: WorldPlan | PlanError) -> Actions:
        """The plan of `request`, computed off the event loop, is ready. It is
        applied unless the job changed since it was requested; then the job is
        planned again from what it holds now."""
        actions = Actions()
        job = self._jobs.get(request.job_id)
        if job is None or job.planning != request.version:
            return actions  # gone, or superseded by a later request
        job.planning = -1
        if job.version != request.version or self._formable(job) != request.spec.world_size:
            self._maybe_form(job, actions)
            if job.state is JobState.FORMING and job.generation > 0:
                self._announce(job, actions)  # survivors wait longer: tell them now
        else:
            self._seat(job, plan, actions)
        return actions

    def hold_worlds(self, why: str | None) -> Actions:
        """While `why` is set (the store refuses writes), jobs stay FORMING: a
        world nobody could be told of durably is not formed. None lifts the hold
        and forms every job that can form (linear in the number of jobs)."""
        self._held = why
        actions = Actions()
        if why is None:
            for job in list(self._jobs.values()):
                if job.state is JobState.FORMING:
                    self._maybe_form(job, actions)
        return actions

    def _seat(self, job: Job, plan: WorldPlan | PlanError, actions: Actions) -> None:
        """FORMING -> FORMED with `plan` (or FAILED with the reason it could not be planned)."""
        if self._held is not None:
            return  # hold_worlds(None) plans it again
        if isinstance(plan, PlanError):
            self._stop(job, JobState.FAILED, str(plan), "cannot form", actions)
            return
        if plan.master_port == 0:
            # Rank 0's spare port serves an earlier world's store and it has
            # not offered another yet: await it like a survivor not heard from.
            job.suspects.add(plan.seating.nodes[0].members[0])
            self._announce(job, actions)
            return
        now = self._clock()
        previous = job.plan
        reason = job.reason if previous is not None else ""
        job.state = JobState.FORMED
        job.generation += 1
        job.previous_plan, job.plan = previous, plan
        job.reason, job.suspects, job.announced = reason, set(), False
        job.placed = plan.world_size
        members = job.members
        first_lease = now + self.lease_ttl_s + plan.world_size * self.SESSION_OPEN_S
        for mid in plan.ranks:
            m = members.get(mid)  # None: a node membership's further workers (worker_id)
            if m is not None and m.lease is Lease.IN_JOIN:  # newly placed: its first lease starts now
                m.lease, m.lease_deadline = Lease.FIRST, first_lease
                self._queue(job.job_id, mid, m, first_lease)
        rank0 = plan.seating.nodes[0].members[0]
        members[rank0].port = 0  # it now serves the TCPStore; rank 0 offers a new spare
        actions.writes.append(PutMember(job.job_id, _member_record(rank0, members[rank0])))
        formed_in_s, job.forming_since = now - job.forming_since, now  # the record keeps the formed world's start
        actions.writes.append(PutJob(self._record(job)))
        world = NewWorld(job.job_id, job.generation, plan, previous, reason)
        if previous is not None:
            change = WorldChange(job.generation - 1, reason)
            for mid, m in members.items():
                if m.session is not None:
                    if mid in plan.ranks:
                        actions.pushes.append((m.session, world))
                    elif mid in previous.ranks:  # a survivor this world has no seat for: it waits for the next
                        actions.pushes.append((m.session, change))
        actions.wakes.append((job.job_id, world))
        actions.notes.append(Note("formed", {"job": job.job_id, "generation": job.generation, "world_size": plan.world_size,
                                             "nodes": plan.num_nodes, "seconds": round(formed_in_s, 3)}))
        self._event(job, EventKind.FORMED, f"generation {job.generation} formed: {plan.world_size} worker"
                                           f"{'s' * (plan.world_size != 1)} on {plan.num_nodes} node{'s' * (plan.num_nodes != 1)} "
                                           f"in {formed_in_s:.2f} s" + (f" ({reason})" if reason else ""),
                    actions, world_size=plan.world_size, nodes=plan.num_nodes, seconds=round(formed_in_s, 3), reason=reason)

    def _stop(self, job: Job, state: JobState, reason: str, verb: str, actions: Actions) -> None:
        """The job cannot go on: FAILED, ENDED or CLOSED. Every session and waiter hears why."""
        job.state, job.reason, job.suspects = state, reason, set()
        failed, closed = state is JobState.FAILED, state is JobState.CLOSED
        actions.notes.append(Note("failed" if failed else "ended", {"job": job.job_id, "reason": reason}))
        self._event(job, EventKind.FAILED if failed else EventKind.ENDED,
                    f"{'failed' if failed else 'closed' if closed else 'finished'}: {reason}", actions, reason=reason)
        actions.writes.append(PutJob(self._record(job)))
        gone = Gone(f"job {job.job_id!r} {verb}: {reason}", not failed, closed)
        actions.pushes.extend((m.session, gone) for m in job.members.values() if m.session is not None)
        stopped = f"job {job.job_id!r} was closed: {reason}" if closed else f"job {job.job_id!r} cannot form: {reason}"
        actions.wakes.append((job.job_id, JobStopped(stopped, closed)))

    def _arm_last_call(self, job: Job) -> None:
        if job.state is JobState.FORMING and job.spec.min_size is not None and not job.last_call_armed:
            job.last_call_armed = True
            self._last_calls.push(job.last_arrival + job.spec.last_call_s, job.job_id)

    # -- sessions, leases and leaving --------------------------------------------

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
            StaleGeneration: the session names a generation older than one the
                member's sessions named before (a stale process): it takes nothing over.
        """
        job = self._job(job_id)
        member = self._member(job, member_id, secret)
        if generation < member.generation:
            raise StaleGeneration(f"member {member_id} of job {job_id!r} holds generation {member.generation}; a session "
                                  f"naming generation {generation} cannot take over its membership")
        older = member.session  # renew() below takes a DETACHED member back
        missed: list[SessionEvent] = []
        if job.state.over:  # a session opened after its job stopped: told at once, as the others were
            verb = {JobState.FAILED: "cannot continue", JobState.ENDED: "finished", JobState.CLOSED: "was closed"}[job.state]
            missed.append(Gone(f"job {job_id!r} {verb}: {job.reason}", job.state is not JobState.FAILED,
                               job.state is JobState.CLOSED))
        elif job.in_world(member_id):
            if job.state is JobState.FORMED and generation < job.generation:
                missed.append(NewWorld(job_id, job.generation, job.plan, job.previous_plan, job.reason))
            elif job.state is JobState.FORMING and job.announced:
                missed.append(WorldChange(job.generation, job.reason))
        member.session = sink
        _, actions = self.renew(job_id, member_id, generation, spare_port)
        if older is not None and older is not sink:
            actions.pushes.append((older, Replaced(f"member {member_id} of job {job_id!r} opened a newer session")))
        return self.lease_ttl_s, missed, actions

    def close_session(self, job_id: str, member_id: str, sink: object, departed: bool = False) -> Actions:
        """The session of `sink` ended. `departed`: the client ended it (it
        cancelled the stream, or its connection broke, as when its process is
        killed) without a Leave; then, unless a new session reattaches within
        the reconnect grace, the member is removed as an expired lease is. Any
        other end (the server stopping or handing over, a newer session) leaves
        the lease to run on. A paused process keeps its connection: only its
        lease finds it.

        Returns:
            Actions (none to carry out, but the grace's deadline may be the next one).
        """
        actions = Actions()
        job = self._jobs.get(job_id)
        member = job.members.get(member_id) if job is not None else None
        if member is None or member.session is not sink:
            return actions
        member.session = None
        if departed and member.lease in (Lease.FIRST, Lease.RENEWING):
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
            InvalidArgument: a spare port out of range.
            NotFound: unknown job or member.
        """
        if not 0 <= spare_port <= 65535:
            raise InvalidArgument(f"spare_port {spare_port} is out of range 1..65535 (0: unchanged)")
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
        if spare_port and generation == job.generation and spare_port != member.port:
            member.port = spare_port
            job.version += 1
            actions.writes.append(PutMember(job_id, _member_record(member_id, member)))
        if job.suspects and member_id in job.suspects and member.port:
            job.suspects.discard(member_id)
            self._maybe_form(job, actions)
        return job.generation, actions

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
            # that renew after this (sessions renew at once on the WorldChange).
            self._change(job, f"node {member.node_key!r} restarts its workers", actions, confirmed=member_id)
        return actions

    def keep_alive(self, job_id: str, member_id: str, generation: int, secret: str | None = None) -> tuple[float, int, Actions]:
        """Renews a member's lease (the unary form), given its secret (None: not checked).

        Returns:
            (lease ttl in seconds, the job's current generation, actions).

        Raises:
            NotFound: unknown job or member, or not its secret.
            StaleGeneration: `generation` is neither 0 nor the job's current one.
        """
        job = self._job(job_id)
        self._member(job, member_id, secret)
        if generation and generation != job.generation:
            raise StaleGeneration(
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
            PermissionDenied: the job is sealed and `job_secret` does not open it.
            NotFound: unknown job or member, or not its secret.
        """
        job = self._job(job_id)
        self._unseal(job_id, job.seal, job_secret, caller, "this leave's job_secret is missing or wrong")
        member = self._member(job, member_id, secret)
        actions = Actions()
        if close and job.state is not JobState.CLOSED:
            self._stop(job, JobState.CLOSED, f"node {member.node_key!r} closed it (its launcher shut the run down)",
                       "was closed", actions)
        self._remove(job, member_id, "left", actions)
        return actions

    def next_deadline(self) -> float:
        """The earliest time (on the injected clock) at which `expire_due` may have work."""
        return min(self._leases.next(), self._last_calls.next(), self._tombstones.next())

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
            member.queued = math.inf
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
        while (entry := self._tombstones.pop_due(now)) is not None:
            kept = self._failed.get(entry[1])
            if kept is not None and kept[1] <= now:
                del self._failed[entry[1]]
                actions.writes.append(DeleteJob(entry[1]))
                actions.events.append((entry[1], None))  # gone: its watches end
        return actions, self.next_deadline() <= now

    def _remove(self, job: Job, member_id: str, why: str, actions: Actions) -> None:
        member = job.members.pop(member_id)
        self._members -= 1
        job.version += 1
        in_world = job.in_world(member_id)
        job.placed -= in_world * member.workers
        job.workers -= member.workers
        job.suspects.discard(member_id)
        node = job.nodes[member.node_key]
        node.workers -= member.workers
        node.roles[member.role] -= member.workers
        job.role_counts[member.role] -= member.workers
        if member.local_rank is not None:
            node.local_ranks.pop(member.local_rank, None)
        if node.workers == 0:
            del job.nodes[node.key]
            if node.node_rank is not None:
                job.node_ranks.pop(node.node_rank, None)
        actions.writes.append(DeleteMember(job.job_id, member_id))
        actions.notes.append(Note("removed", {"job": job.job_id, "member": member_id, "why": why}))
        rank = job.plan.ranks.get(member_id) if in_world else None
        where = f"node {member.node_key!r}" + (f", rank {rank}" if rank is not None else "")
        said = "withdrew (its Join call ended before it was placed)" if why == "withdrawn" else _SAID.get(why, why)
        self._event(job, EventKind.LEFT if why in ("left", "withdrawn") else EventKind.LOST,
                    f"member {member_id} ({where}) {said}", actions, member=member_id, node=member.node_key,
                    rank=rank, why=why)
        if member.session is not None and why != "left":
            actions.pushes.append((member.session, Gone(f"member {member_id} {_SAID.get(why, why)}")))
        if why != "withdrawn":  # a member waiting in Join learns at once that it is gone
            actions.wakes.append((job.job_id, MemberGone(member_id)))
        if not job.members:
            del self._jobs[job.job_id]
            self.shares.give(JOBS, job.creator)
            if job.state in (JobState.FAILED, JobState.CLOSED):  # kept a while (also across a restart) to say why
                self._retain(job, self.limits.retain_ended_s, actions)
                actions.writes.append(PutJob(self._record(job, self._wall() + self.limits.retain_ended_s)))
            else:
                actions.writes.append(DeleteJob(job.job_id))
                actions.events.append((job.job_id, None))  # gone: its watches end
        elif in_world and job.generation > 0 and job.state in (JobState.FORMED, JobState.FORMING):
            self._lost(job, member_id, member, why, actions)
        elif job.state is JobState.FORMING:
            self._maybe_form(job, actions)  # a waiting worker's leaving may be all that held the world back

    def _retain(self, job: Job, for_s: float, actions: Actions) -> None:
        """Keeps a failed job without workers for `for_s` seconds (at most
        retain_ended_jobs of them: the oldest go first, from the store too)."""
        until = self._clock() + for_s
        self._failed[job.job_id] = (self._view(job), until, job.events)
        while len(self._failed) > self.limits.retain_ended_jobs:
            oldest = next(iter(self._failed))
            del self._failed[oldest]
            actions.writes.append(DeleteJob(oldest))
            actions.events.append((oldest, None))
        self._tombstones.push(until, job.job_id)

    def _lost(self, job: Job, member_id: str, member: Member, why: str, actions: Actions) -> None:
        """A member of a formed (or re-forming) world is gone."""
        rank = job.plan.ranks.get(member_id)
        what = f"member {member_id} (node {member.node_key!r}, rank {rank}) {_SAID.get(why, why)}"
        n, unit = (job.units, "node") if job.spec.nodes else (job.workers, "worker")
        remain = f"{n} {unit}{'s' * (n != 1)} remain{'s' * (n == 1)}"
        if job.units < job.spec.min_world and why == "left":  # members leaving: the job is finishing
            reason = f"{what} and {remain} (the job needs {job.spec.min_world} to go on)"
            self._stop(job, JobState.ENDED, reason, "finished", actions)
        elif job.units < job.spec.min_world:
            reason = f"{what}; {remain}, fewer than the minimum of {job.spec.min_world}"
            self._stop(job, JobState.FAILED, reason, "cannot continue", actions)
        elif job.state is JobState.FORMED:
            self._change(job, what, actions)
        else:
            job.reason = what
            self._maybe_form(job, actions)

    # -- restart -----------------------------------------------------------------

    def restore(self, records: Iterable[JobRecord], grace_s: float) -> tuple[int, Actions]:
        """Loads the jobs a store held after a restart.

        Leases restart with `grace_s` to spare; forming members must re-attach
        (retry their Join) within it. Survivors of a world that was re-forming
        are awaited until they renew (their sessions reconnect) or expire.

        Returns:
            How many jobs were restored, and actions (jobs found empty are deleted).
        """
        now, wall = self._clock(), self._wall()
        actions = Actions()
        for record in records:
            spec = record.spec
            job = Job(record.job_id, spec, False, now)
            job.state, job.generation, job.reason = JobState(record.state), record.generation, record.reason
            job.seal, job.creator = record.seal, SERVER  # who created it is not stored: it counts against nobody's share
            job.events = collections.deque(record.events, maxlen=self.limits.max_events_per_job)
            if record.since:  # AGE goes on from when it began, not from the restart
                job.forming_since = now - max(0.0, wall - record.since)
            if record.world is not None:
                job.plan = build_plan(record.world, spec.at_size(record.world.world_size))
            for mr in record.members:
                p = JoinParams(job.job_id, spec, mr.node_key, mr.address, mr.port, mr.local_rank, mr.node_rank, False, mr.role,
                               mr.member_id, mr.secret, "", mr.workers)
                m = self._add_member(job, mr.member_id, p, mr.seq)
                self._members += 1
                placed = job.in_world(mr.member_id)
                job.placed += placed * m.workers
                m.lease, m.lease_deadline = Lease.FIRST, now + (self.lease_ttl_s if placed else 0) + grace_s
                self._queue(job.job_id, mr.member_id, m, m.lease_deadline)
                self._seq = max(self._seq, mr.seq)
            if not job.members:
                if job.state in (JobState.FAILED, JobState.CLOSED) and record.retained_until > wall:
                    self._retain(job, record.retained_until - wall, actions)
                else:
                    actions.writes.append(DeleteJob(job.job_id))
                continue
            if job.state is JobState.FORMING and job.generation > 0:
                job.suspects, job.announced = set(job.survivors()), True
            job.loopback = ipaddress.ip_address(next(iter(job.members.values())).address).is_loopback
            self._jobs[job.job_id] = job
            self._arm_last_call(job)
        return len(self._jobs), actions

    # -- reading -----------------------------------------------------------------

    def world_of(self, job_id: str) -> NewWorld | None:
        """The job's current world, if it has formed."""
        job = self._jobs.get(job_id)
        if job is None or job.state is not JobState.FORMED:
            return None
        return NewWorld(job.job_id, job.generation, job.plan, None, job.reason)

    def describe(self, job_id: str, secret: str | None = None, first_node: int = 0, max_nodes: int | None = None,
                 caller: Caller = SERVER) -> JobView:
        """The job as DescribeJob reports it, with nodes [first_node, first_node
        + max_nodes) of its order; for a sealed job, given its secret (None: not
        checked, for operators and the server itself). Costs what _node_page does.

        Raises:
            NotFound: an unknown job.
            PermissionDenied: the job is sealed and `secret` does not open it.
        """
        job = self._jobs.get(job_id)
        if job is None and job_id in self._failed:
            view = self._failed[job_id][0]
        else:
            view = self._view(self._job(job_id), first_node, max_nodes)
        self._unseal(job_id, view.seal, secret, caller, "give its job_secret to describe it")
        if job is None and (first_node or max_nodes is not None):
            view = dataclasses.replace(view, nodes=view.nodes[first_node:None if max_nodes is None else first_node + max_nodes])
        return view

    @staticmethod
    def _node_page(job: Job, first: int, count: int | None) -> list[tuple[str, int | None]]:
        """Nodes [first, first + count) of the job's DescribeJob order, with their
        node ranks: the formed world's in node-rank order, then the others in the
        order they joined. A page among the world's nodes costs O(first + count):
        the first page of a job of 100,000 nodes is as cheap after a change as
        before it. A page past them also walks the nodes present once."""
        stop = None if count is None else first + count
        if job.state is not JobState.FORMED:
            return [(k, job.nodes[k].node_rank) for k in itertools.islice(job.nodes, first, stop)]
        present = job.nodes
        ranked = ((n.node_key, n.node_rank) for n in job.plan.nodes if n.node_key in present)
        page = list(itertools.islice(ranked, first, stop))
        if stop is not None and len(page) == count:
            return page
        # Past the world's nodes: those waiting for the next generation, in join order.
        if job.node_order is None or job.node_order[0] != job.generation:
            job.node_order = (job.generation, frozenset(n.node_key for n in job.plan.nodes))
        in_plan = job.node_order[1]
        skip = max(0, first - sum(1 for n in job.plan.nodes if n.node_key in present))
        waiting = (k for k in present if k not in in_plan)
        return page + [(k, None) for k in itertools.islice(waiting, skip, None if stop is None else skip + count - len(page))]

    def _view(self, job: Job, first_node: int = 0, max_nodes: int | None = None) -> JobView:
        formed = job.state is JobState.FORMED
        page = self._node_page(job, first_node, max_nodes) if max_nodes != 0 else []  # ListJobs: no nodes
        nodes = []
        for k, rank in page:
            node = job.nodes[k]
            nodes.append(NodeView(k, node.address, node.workers, rank, tuple(sorted((r, c) for r, c in node.roles.items() if c))))
        if job.state.over:
            reason = job.reason
        elif formed:
            reason = ""
        elif job.suspects:
            reason = (f"re-forming ({job.reason}): {len(job.suspects)} survivors not heard from since the change are "
                      f"awaited; {job.shortfall()}")
        else:
            reason = f"waiting: {job.shortfall()}"
        if self._held is not None and job.state is JobState.FORMING:
            reason = f"held: the server cannot write its state ({self._held}); worlds form once a write succeeds; {reason}"
        return JobView(
            job_id=job.job_id,
            state=job.state,
            generation=job.generation,
            spec=job.spec,
            joined=job.workers,
            missing=max(job.spec.min_world - job.units, 0) if job.state is JobState.FORMING else 0,
            nodes=tuple(nodes),
            reason=reason,
            forming_for_s=self._clock() - job.forming_since,
            num_nodes=len(job.nodes),
            missing_nodes=tuple(k for k in job.spec.expected_nodes if k not in job.nodes),
            waiting=job.workers - job.placed if formed else 0,
            not_ready=len(job.suspects),
            seal=job.seal,
            refused=job.refused.count,
            last_refused=job.refused.last,
        )

    def workers(self, job_id: str, node_keys: Iterable[str]) -> dict[str, list[WorkerView]]:
        """The workers on the given nodes of a held job (a failed one kept has
        none), by local rank: linear in the job's members.

        Raises:
            NotFound: an unknown job.
        """
        job = self._jobs.get(job_id)
        if job is None:
            if job_id in self._failed:
                return {k: [] for k in node_keys}
            raise NotFound(f"no job {elide(job_id)} on this server")
        out: dict[str, list[WorkerView]] = {k: [] for k in node_keys}
        now, plan = self._clock(), job.plan
        for mid, m in job.members.items():
            seats = out.get(m.node_key)
            if seats is None:
                continue
            age = now - (m.lease_deadline - self.lease_ttl_s) if m.lease is Lease.RENEWING else None
            for i in range(m.workers):
                wid = worker_id(mid, i)
                p = plan.placement(wid) if plan is not None else None
                local = p.local_rank if p is not None else (i if m.workers > 1 else m.local_rank)
                seats.append(WorkerView(wid, local, p.rank if p is not None else None, m.role, m.lease.value, age))
        for seats in out.values():
            seats.sort(key=lambda w: (w.local_rank is None, w.local_rank or 0))
        return out

    def plan_of(self, job_id: str) -> WorldPlan | None:
        """The job's current world (while re-forming: the one being replaced), if any."""
        job = self._jobs.get(job_id)
        return job.plan if job is not None else None

    def job_ids(self) -> list[str]:
        """Jobs held, and failed jobs still described, sorted."""
        return sorted({*self._jobs, *self._failed})

    def stats(self) -> Stats:
        """Counts for metrics (linear in the number of jobs, not members)."""
        members = waiting = 0
        for job in self._jobs.values():
            members += job.workers  # workers, as `waiting`: a node membership counts its workers
            waiting += job.workers - job.placed
        oldest = self._oldest_lease()
        age = 0.0 if oldest == math.inf else max(0.0, self._clock() - (oldest - self.lease_ttl_s))
        return Stats(len(self._jobs), members, waiting, age)

    def _oldest_lease(self) -> float:
        """The earliest lease deadline, bringing stale heap entries up to date on the way."""
        while (top := self._leases.next()) != math.inf:
            entry = self._leases.pop_due(top)
            job_id, member_id = entry[1]
            job = self._jobs.get(job_id)
            member = job.members.get(member_id) if job is not None else None
            if member is None or entry[0] != member.queued:
                continue
            member.queued = math.inf
            if member.lease is Lease.IN_JOIN:
                continue
            self._queue(job_id, member_id, member, member.lease_deadline)
            if member.lease_deadline == top:
                return top
        return math.inf

    def _queue(self, job_id: str, member_id: str, member: Member, deadline: float) -> None:
        """Makes sure the lease heap holds an entry for the member due by
        `deadline`: pushed only when its live entry is due later (a stretched
        first lease, a grace shorter than the lease), so a renewal costs no push."""
        if deadline < member.queued:
            member.queued = deadline
            self._leases.push(deadline, (job_id, member_id))

    def _job(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"no job {elide(job_id)} on this server")
        return job

    @staticmethod
    def _member(job: Job, member_id: str, secret: str | None = None) -> Member:
        """The member, if `secret` is its secret (None: not asked, a call on
        an already authenticated session). A wrong secret gets the answer an
        unknown member gets."""
        member = job.members.get(member_id)
        if member is None or (secret is not None and not secret_matches(member.secret, secret)):
            raise NotFound(
                f"member {elide(member_id)} is not in job {job.job_id!r} (it left, its lease expired, "
                f"or it never joined); join again"
            )
        return member

    def _record(self, job: Job, retained_until: float = 0.0) -> JobRecord:
        since = self._wall() - (self._clock() - job.forming_since)
        return JobRecord(job.job_id, job.spec, job.state.value, job.generation, job.reason,
                         job.plan.seating if job.plan is not None else None, (), job.seal, since, retained_until)


def _member_record(member_id: str, m: Member) -> MemberRecord:
    return MemberRecord(member_id, m.seq, m.node_key, m.address, m.port, m.local_rank, m.node_rank, m.role, m.secret, m.workers)
