"""Job membership: the rendezvous state machine, leases, sessions and waiting.

A job's life, generation by generation:

  FORMING (g)  workers join; the world forms as generation g+1 when the spec
               allows it: world_size workers (the maximum) are present, or, for
               an elastic job, at least min_size are and nobody new arrived for
               the last-call window; and every survivor of generation g has
               re-armed (sent a ready port).
  FORMED (g)   the world of generation g runs. Elastic jobs below their maximum
               admit joiners, who wait; their arrival re-forms the world.
  FAILED       the joined workers cannot form a valid world, or members of a
               world expired and fewer than min_size remain. Kept, with its
               reason, until every member has gone (and a while longer).
  ENDED        members left (gracefully) and fewer than min_size remain: a
               job finishing. Kept until every member has gone.

A member leaving or expiring, or joiners arriving at an elastic world, turns
FORMED (g) into FORMING (g): survivors are told at once on their sessions and
keep their node and local ranks where the new shape allows.

A worker is bound to its Join call until it is placed in a world (ending the
call withdraws it); placed, it holds a lease that its session renews. Expiry
and leaving are the same transition. A job disappears when its last member
goes.

All mutation is synchronous on the server's event loop, so no locks are
needed; waiting is the only coroutine. The clock is injected; every change is
written through the store.

Values built once per join (JoinParams, Joined, Assignment) are NamedTuples:
as immutable as frozen dataclasses and several times cheaper to construct,
which shows at ten thousand joins a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import ipaddress
import math
import os
import time
from collections.abc import Callable
from typing import NamedTuple

from .assignment import MemberSpec, PlanError, Placement, WorldPlan, node_sort_key, plan_world
from .errors import AlreadyExists, Conflict, JobFull, NotFound, StaleGeneration, WaitTimeout
from .groups import expand
from .spec import JobSpec
from .store import NullStore, Store, StoredJob, StoredMember
from .telemetry import Events


class JoinParams(NamedTuple):
    """A validated join request."""

    job_id: str
    spec: JobSpec
    node_key: str
    address: str
    master_port: int
    local_rank: int | None = None
    node_rank: int | None = None
    loopback: bool = False  # whether `address` is a loopback address
    role: str = ""
    member_id: str = ""  # client-chosen, to re-attach; empty: the server picks


class JobState(enum.Enum):
    FORMING = "forming"
    FORMED = "formed"
    FAILED = "failed"
    ENDED = "ended"


class Joined(NamedTuple):
    job_id: str
    member_id: str
    lease_ttl_s: float
    joined: int


class Assignment(NamedTuple):
    """A member's seat in the world of one generation."""

    job_id: str
    generation: int
    placement: Placement
    plan: WorldPlan
    changed_groups: tuple[str, ...] = ()
    previous_rank: int | None = None


class WorldChange(NamedTuple):
    generation: int  # the generation being replaced
    reason: str


class Gone(NamedTuple):
    reason: str


SessionEvent = WorldChange | Assignment | Gone


@dataclasses.dataclass(frozen=True, slots=True)
class NodeView:
    node_key: str
    address: str
    workers: int
    node_rank: int | None
    roles: tuple[tuple[str, int], ...] = ()  # workers per role, by role name


@dataclasses.dataclass(frozen=True, slots=True)
class JobView:
    """What DescribeJob reports."""

    job_id: str
    state: JobState
    generation: int
    spec: JobSpec
    joined: int
    missing: int
    nodes: tuple[NodeView, ...]
    reason: str
    forming_for_s: float
    missing_nodes: tuple[str, ...] = ()  # expected node keys not present
    waiting: int = 0  # joined a formed world, wait for the next generation
    not_ready: int = 0  # survivors that have not re-armed yet


class _Member:
    # Few objects per member: thousands of these outlive the join burst, and
    # each small object pins the allocator page it landed on.
    __slots__ = ("node_key", "address", "master_port", "local_rank", "node_rank", "role", "seq",
                 "lease_deadline", "in_world", "ready", "outbox")

    def __init__(self, node: _Node, p: JoinParams, seq: int) -> None:
        self.node_key = node.key
        self.address = node.address if p.address == node.address else p.address
        self.master_port = p.master_port  # the port to serve the store on if it becomes rank 0
        self.local_rank = p.local_rank
        self.node_rank = p.node_rank
        self.role = p.role
        self.seq = seq  # join order, kept across restarts
        self.lease_deadline = math.inf  # bound to its Join call until placed
        self.in_world = False  # placed in the current (or, while re-forming, the previous) world
        self.ready = True  # survivors of a changed world are not, until they re-arm
        self.outbox: asyncio.Queue[SessionEvent] | None = None  # the member's open session

    def spec(self, member_id: str, previous: Placement | None) -> MemberSpec:
        return MemberSpec(
            member_id, self.node_key, self.address, self.master_port, self.local_rank, self.node_rank, self.role,
            previous.node_rank if previous else None, previous.local_rank if previous else None,
        )

    def stored(self, member_id: str) -> StoredMember:
        return StoredMember(member_id, self.seq, self.node_key, self.address, self.master_port,
                            self.local_rank, self.node_rank, self.role, self.in_world)


class _Node:
    __slots__ = ("key", "address", "node_rank", "local_ranks", "workers")

    def __init__(self, key: str, address: str) -> None:
        self.key = key
        self.address = address
        self.node_rank: int | None = None
        self.local_ranks: dict[int, str] = {}  # explicit local rank -> member id
        self.workers = 0


class _Job:
    __slots__ = (
        "job_id", "spec", "state", "generation", "members", "nodes", "node_ranks", "plan", "world",
        "reason", "forming_since", "last_arrival", "loopback", "waiters", "timer", "timer_at", "role_counts",
        "not_ready", "placed",
    )

    def __init__(self, job_id: str, spec: JobSpec, loopback: bool, now: float) -> None:
        self.job_id = job_id
        self.spec = spec
        self.state = JobState.FORMING
        self.generation = 0
        self.members: dict[str, _Member] = {}  # insertion order = join order
        self.nodes: dict[str, _Node] = {}
        self.node_ranks: dict[int, str] = {}  # explicit node rank -> node key
        self.plan: WorldPlan | None = None  # the current world's (while re-forming: the previous one's)
        self.world: tuple[MemberSpec, ...] = ()  # the plan's input, which recomputes it exactly
        self.reason = ""
        self.forming_since = now
        self.last_arrival = now
        self.loopback = loopback
        self.role_counts: dict[str, int] = {}
        self.not_ready = 0  # survivors that have not re-armed (counts: both are checked on every join)
        self.placed = 0  # members with in_world set
        # Waiting Join calls and their deadlines. One timer per job, armed for
        # the earliest deadline, rather than one per worker: the loop's timer
        # heap is costly at ten thousand entries.
        self.waiters: dict[asyncio.Future[None], float] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf

    async def wait(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Returns at the next notify(); raises TimeoutError at `deadline`."""
        waiter = loop.create_future()
        self.waiters[waiter] = deadline
        if deadline < self.timer_at:
            self._arm(loop, deadline)
        try:
            await waiter
        finally:
            self.waiters.pop(waiter, None)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.timer_at = (None, math.inf) if at == math.inf else (loop.call_at(at, self._expire_waiters, loop), at)

    def _expire_waiters(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer, self.timer_at = None, math.inf
        now = loop.time()
        for waiter, deadline in list(self.waiters.items()):
            if deadline <= now and not waiter.done():
                waiter.set_exception(TimeoutError())
        pending = [d for w, d in self.waiters.items() if not w.done()]
        if pending:
            self._arm(loop, min(pending))

    def notify(self) -> None:
        """Wakes every waiting Join; they re-check the state."""
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self.timer is not None:
            self.timer.cancel()
            self.timer, self.timer_at = None, math.inf

    def push(self, member: _Member, event: SessionEvent) -> None:
        if member.outbox is not None:
            member.outbox.put_nowait(event)

    def shortfall(self) -> str:
        nodes = ", ".join(f"{n.key}×{n.workers}" for n in self.nodes.values()) or "none"
        missing = self.spec.min_world - len(self.members)
        what = f"{len(self.members)} of {self.spec.world_size} workers joined (nodes present: {nodes})"
        if self.spec.min_size is not None:
            return what + (f"; {missing} missing for the minimum of {self.spec.min_size}" if missing > 0 else "; waiting for the last call")
        return f"{what}; {missing} missing"

    def stored(self) -> StoredJob:
        return StoredJob(self.job_id, self.spec, self.state.value, self.generation, self.reason, self.world)


class Rendezvous:
    """Every job the server holds, and the rules for joining and leaving them."""

    def __init__(
        self,
        *,
        lease_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        new_member_id: Callable[[], str] | None = None,
        events: Events | None = None,
        store: Store | None = None,
    ) -> None:
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._new_member_id = new_member_id or (lambda: os.urandom(8).hex())
        self._events = events or Events()
        self._store = store or NullStore()
        self._jobs: dict[str, _Job] = {}
        self._seq = 0
        # Jobs that failed, kept a while after their last worker left so that
        # DescribeJob can still say why.
        self._failed: dict[str, tuple[JobView, float]] = {}
        self.failed_job_ttl_s = 300.0

    # -- joining -------------------------------------------------------------

    def join(self, p: JoinParams) -> Joined:
        """Registers a worker, or re-attaches one that joined before with the
        same member id; forms the world when the spec allows.

        Raises:
            Conflict: the spec, a node rank, a role or the address family
                disagrees with the job, the job has failed, or a member id is
                reused with other parameters.
            AlreadyExists: the local rank or node rank is held by another worker.
            JobFull: the job (or the role) already has all its workers.
        """
        job = self._jobs.get(p.job_id)
        if job is not None and p.member_id in job.members:
            return self._reattach(job, p)
        if job is not None:
            self._check_admissible(job, p)
        node = job.nodes.get(p.node_key) if job is not None else None
        if node is not None:
            self._check_node(job, node, p)
        elif job is not None and p.node_rank is not None and p.node_rank in job.node_ranks:
            raise AlreadyExists(
                f"node_rank {p.node_rank} is already held by node {job.node_ranks[p.node_rank]!r} "
                f"in job {p.job_id!r}; node {p.node_key!r} cannot take it"
            )

        now = self._clock()
        if job is None:
            declared = p.spec.role_count(p.role)
            if declared == 0:
                roles = ", ".join(f"{r}:{c}" for r, c in p.spec.roles)
                raise Conflict(f"job {p.job_id!r} declares roles {roles} but this worker joined as role {p.role!r}")
            self._failed.pop(p.job_id, None)
            job = self._jobs[p.job_id] = _Job(p.job_id, p.spec, p.loopback, now)
            self._store.save_job(job.stored())
        member_id = p.member_id or self._new_member_id()
        self._seq += 1
        member = self._add_member(job, member_id, p, self._seq)
        job.last_arrival = now
        self._store.save_member(job.job_id, member.stored(member_id))
        self._events.joined(job.job_id, member_id, member.node_key, p.role, len(job.members), job.spec.world_size)
        if job.state is JobState.FORMED:
            waiting = len(job.members) - job.placed
            self._reform(job, f"{waiting} worker{'s' * (waiting > 1)} waiting to join can grow the world")
        self._maybe_form(job)
        return Joined(job.job_id, member_id, self.lease_ttl_s, len(job.members))

    @staticmethod
    def _add_member(job: _Job, member_id: str, p: JoinParams, seq: int) -> _Member:
        """Enters a member in the job's node, rank and role bookkeeping (undone by _remove)."""
        node = job.nodes.get(p.node_key)
        if node is None:
            node = job.nodes[p.node_key] = _Node(p.node_key, p.address)
        if p.node_rank is not None and node.node_rank is None:
            node.node_rank = p.node_rank
            job.node_ranks[p.node_rank] = node.key
        if p.local_rank is not None:
            node.local_ranks[p.local_rank] = member_id
        node.workers += 1
        job.role_counts[p.role] = job.role_counts.get(p.role, 0) + 1
        member = job.members[member_id] = _Member(node, p, seq)
        return member

    def _reattach(self, job: _Job, p: JoinParams) -> Joined:
        member = job.members[p.member_id]
        same = (member.node_key, member.address, member.local_rank, member.node_rank, member.role) == (
            p.node_key, p.address, p.local_rank, p.node_rank, p.role)
        if not same or job.spec != p.spec:
            raise Conflict(f"member {p.member_id} of job {job.job_id!r} joined before with other parameters")
        if not member.in_world:
            member.master_port = p.master_port
            member.lease_deadline = math.inf  # bound to this call again
        return Joined(job.job_id, p.member_id, self.lease_ttl_s, len(job.members))

    def _check_admissible(self, job: _Job, p: JoinParams) -> None:
        if job.spec != p.spec:
            raise Conflict(f"job {job.job_id!r} has {job.spec.difference(p.spec)}")
        if job.state is JobState.FAILED:
            raise Conflict(f"job {job.job_id!r} cannot form: {job.reason}")
        if job.state is JobState.ENDED:
            raise Conflict(f"job {job.job_id!r} has ended ({job.reason}); use another job id or wait until its members have left")
        if len(job.members) >= job.spec.world_size:
            raise JobFull(
                f"job {job.job_id!r} already has all {job.spec.world_size} workers "
                f"(generation {job.generation}); node {p.node_key!r} cannot join it"
            )
        declared = job.spec.role_count(p.role)
        if declared is not None and job.role_counts.get(p.role, 0) >= declared:
            if declared == 0:
                roles = ", ".join(f"{r}:{c}" for r, c in job.spec.roles)
                raise Conflict(f"job {job.job_id!r} declares roles {roles} but this worker joined as role {p.role!r}")
            raise JobFull(f"job {job.job_id!r} already has all {declared} workers of role {p.role!r}")
        if p.loopback != job.loopback:
            first = next(iter(job.nodes.values()))
            raise Conflict(
                f"job {job.job_id!r}: node {first.key!r} advertises {first.address} but this worker "
                f"(node {p.node_key!r}) advertises {p.address}; a job cannot mix loopback and "
                f"routable addresses, since peers on other hosts cannot reach a loopback address"
            )

    def _check_node(self, job: _Job, node: _Node, p: JoinParams) -> None:
        if p.node_rank is not None:
            if node.node_rank is not None and node.node_rank != p.node_rank:
                raise Conflict(
                    f"node {node.key!r} of job {job.job_id!r} has node_rank {node.node_rank} but this "
                    f"worker asked for node_rank {p.node_rank}"
                )
            holder = job.node_ranks.get(p.node_rank)
            if holder is not None and holder != node.key:
                raise AlreadyExists(
                    f"node_rank {p.node_rank} is already held by node {holder!r} in job {job.job_id!r}"
                )
        if p.local_rank is not None and p.local_rank in node.local_ranks:
            raise AlreadyExists(
                f"local_rank {p.local_rank} on node {node.key!r} of job {job.job_id!r} is already "
                f"held by member {node.local_ranks[p.local_rank]}"
            )

    # -- forming ---------------------------------------------------------------

    def _reform(self, job: _Job, reason: str) -> None:
        """FORMED -> FORMING: tell every survivor, who must re-arm."""
        job.state = JobState.FORMING
        job.forming_since = self._clock()
        for member in job.members.values():
            if member.in_world and member.ready:
                member.ready = False
                job.not_ready += 1
            if member.in_world:
                job.push(member, WorldChange(job.generation, reason))
        self._events.reforming(job.job_id, job.generation, reason)
        self._store.save_job(job.stored())

    def _formable(self, job: _Job) -> int | None:
        """How many workers the next world takes now, or None to keep waiting."""
        spec = job.spec
        if job.state is not JobState.FORMING or job.not_ready:
            return None
        n = len(job.members)
        if n >= spec.world_size:
            return spec.world_size if spec.admissible(spec.world_size) else None
        if spec.min_size is None or n < spec.min_size:
            return None
        # The last call collects arrivals; survivors re-forming without
        # newcomers have nobody to wait for.
        if n > job.placed and self._clock() < job.last_arrival + spec.last_call_s:
            return None
        return next((k for k in range(n, spec.min_size - 1, -1) if spec.admissible(k)), None)

    def _maybe_form(self, job: _Job) -> None:
        n = self._formable(job)
        if n is not None:
            self._form(job, n)

    def _form(self, job: _Job, n: int) -> None:
        previous = job.plan
        ordered = sorted(
            job.members.items(),
            key=lambda item: (0, previous.ranks[item[0]]) if previous is not None and item[0] in previous.ranks else (1, item[1].seq),
        )
        chosen = ordered[:n]
        inputs = [m.spec(mid, previous.placement(mid) if previous is not None else None) for mid, m in chosen]
        try:
            plan = plan_world(inputs, job.spec.at_size(n))
        except PlanError as exc:
            job.state = JobState.FAILED
            job.reason = str(exc)
            self._events.failed(job.job_id, job.reason)
            self._store.save_job(job.stored())
            for m in job.members.values():
                job.push(m, Gone(f"job {job.job_id!r} cannot form: {job.reason}"))
            job.notify()
            return
        now = self._clock()
        job.state = JobState.FORMED
        job.generation += 1
        job.plan, job.world, job.reason = plan, tuple(inputs), ""
        placed = set(plan.ranks)
        job.not_ready, job.placed = 0, len(placed)
        for mid, m in job.members.items():
            was_in_world, m.in_world, m.ready = m.in_world, mid in placed, True
            if m.in_world and (not was_in_world or m.lease_deadline == math.inf):
                m.lease_deadline = now + self.lease_ttl_s
        self._store.save_job(job.stored())
        for mid, m in chosen:
            self._store.save_member(job.job_id, m.stored(mid))
            if previous is not None and m.outbox is not None:
                job.push(m, self._assignment(job, mid, previous))
        self._store.flush()  # the world is durable before anyone is told of it
        self._events.formed(job.job_id, job.generation, plan.world_size, plan.num_nodes, now - job.forming_since)
        job.forming_since = now
        job.notify()

    def _assignment(self, job: _Job, member_id: str, previous: WorldPlan | None) -> Assignment:
        plan = job.plan
        p = plan.placement(member_id)
        before = previous.placement(member_id) if previous is not None else None
        if before is None:
            changed = tuple(g.mode for g in plan.groups_of(p))
        else:
            old = {g.mode: expand(g.ranks) for g in previous.groups_of(before)}
            changed = tuple(g.mode for g in plan.groups_of(p) if old.get(g.mode) != expand(g.ranks))
        return Assignment(job.job_id, job.generation, p, plan, changed, before.rank if before else None)

    def tick(self) -> None:
        """Forms worlds whose last-call window has passed (the reaper calls this)."""
        for job in list(self._jobs.values()):
            if job.state is JobState.FORMING and job.spec.min_size is not None:
                self._maybe_form(job)

    async def wait_assignment(self, job_id: str, member_id: str, timeout_s: float | None) -> Assignment:
        """Waits until the member is placed in a world.

        Raises:
            NotFound: the member is gone (left, expired).
            Conflict: the job failed to form; the message says why.
            WaitTimeout: not placed within `timeout_s`; the message says who is missing.
        """
        job = self._job(job_id)
        loop = asyncio.get_running_loop()
        deadline = math.inf if timeout_s is None else loop.time() + timeout_s
        while True:
            if member_id not in job.members or self._jobs.get(job_id) is not job:
                raise NotFound(f"member {member_id} left job {job_id!r} while waiting")
            if job.state in (JobState.FAILED, JobState.ENDED):
                raise Conflict(f"job {job_id!r} cannot form: {job.reason}")
            if job.state is JobState.FORMED and job.plan is not None and member_id in job.plan.ranks:
                return self._assignment(job, member_id, None)
            try:
                await job.wait(loop, deadline)
            except TimeoutError:
                raise WaitTimeout(
                    f"job {job_id!r} did not form within {timeout_s:g} s: {self.describe(job_id).reason}"
                ) from None

    def withdraw(self, job_id: str, member_id: str) -> None:
        """The member's Join call ended. Unless it was placed in a world, this
        removes it; placed, its lease governs."""
        job = self._jobs.get(job_id)
        if job is None or member_id not in job.members:
            return
        member = job.members[member_id]
        if member.in_world or member.lease_deadline != math.inf:
            return
        self._remove(job, member_id, "withdrawn", wake=False)

    # -- sessions, leases and leaving --------------------------------------------

    def open_session(self, job_id: str, member_id: str, generation: int) -> tuple[asyncio.Queue[SessionEvent], float]:
        """Attaches a session to a member; what it missed is queued at once.

        Raises:
            NotFound: unknown job or member.
        """
        job = self._job(job_id)
        member = self._member(job, member_id)
        outbox: asyncio.Queue[SessionEvent] = asyncio.Queue()
        member.outbox = outbox
        member.lease_deadline = self._clock() + self.lease_ttl_s
        if job.state is JobState.FORMED and member.in_world and generation < job.generation:
            outbox.put_nowait(self._assignment(job, member_id, None))
        elif job.state is JobState.FORMING and member.in_world and not member.ready:
            outbox.put_nowait(WorldChange(job.generation, job.reason or "the world is re-forming"))
        return outbox, self.lease_ttl_s

    def close_session(self, job_id: str, member_id: str, outbox: asyncio.Queue[SessionEvent]) -> None:
        job = self._jobs.get(job_id)
        member = job.members.get(member_id) if job is not None else None
        if member is not None and member.outbox is outbox:
            member.outbox = None  # the lease runs on; a new session may take over

    def renew(self, job_id: str, member_id: str, generation: int, ready_port: int = 0) -> int:
        """Renews a member's lease; a ready port re-arms a survivor.

        Returns:
            The job's current generation.

        Raises:
            NotFound: unknown job or member.
        """
        job = self._job(job_id)
        member = self._member(job, member_id)
        member.lease_deadline = self._clock() + self.lease_ttl_s
        if ready_port and job.state is JobState.FORMING and not member.ready and generation == job.generation:
            member.ready = True
            job.not_ready -= 1
            member.master_port = ready_port
            self._maybe_form(job)
        return job.generation

    def keep_alive(self, job_id: str, member_id: str, generation: int) -> tuple[float, int]:
        """Renews a member's lease (the unary form).

        Returns:
            (lease ttl in seconds, the job's current generation).

        Raises:
            NotFound: unknown job or member.
            StaleGeneration: `generation` is neither 0 nor the job's current one.
        """
        job = self._job(job_id)
        self._member(job, member_id)
        if generation and generation != job.generation:
            raise StaleGeneration(
                f"member {member_id} of job {job_id!r} holds generation {generation} but the "
                f"current generation is {job.generation}"
            )
        return self.lease_ttl_s, self.renew(job_id, member_id, generation)

    def leave(self, job_id: str, member_id: str) -> None:
        """Removes a member.

        Raises:
            NotFound: unknown job or member.
        """
        job = self._job(job_id)
        self._member(job, member_id)
        self._remove(job, member_id, "left")

    def expire(self) -> list[tuple[str, str]]:
        """Removes every member whose lease has run out; returns (job, member) pairs."""
        now = self._clock()
        expired = [
            (job, mid)
            for job in self._jobs.values()
            for mid, m in job.members.items()
            if m.lease_deadline < now
        ]
        for job, mid in expired:
            if mid in job.members:
                self._remove(job, mid, "expired")
        for job_id in [j for j, (_, until) in self._failed.items() if until < now]:
            del self._failed[job_id]
        return [(job.job_id, mid) for job, mid in expired]

    def _remove(self, job: _Job, member_id: str, why: str, *, wake: bool = True) -> None:
        member = job.members.pop(member_id)
        job.not_ready -= not member.ready
        job.placed -= member.in_world
        self._events.removed(job.job_id, member_id, why)
        node = job.nodes[member.node_key]
        node.workers -= 1
        job.role_counts[member.role] -= 1
        if member.local_rank is not None:
            node.local_ranks.pop(member.local_rank, None)
        if node.workers == 0:
            del job.nodes[node.key]
            if node.node_rank is not None:
                job.node_ranks.pop(node.node_rank, None)
        self._store.delete_member(job.job_id, member_id)
        if member.outbox is not None and why != "left":
            member.outbox.put_nowait(Gone(f"member {member_id} {why}"))
        if not job.members:
            if job.state is JobState.FAILED:
                self._failed[job.job_id] = (self.describe(job.job_id), self._clock() + self.failed_job_ttl_s)
            del self._jobs[job.job_id]
            self._store.delete_job(job.job_id)
        elif member.in_world and job.generation > 0 and job.state in (JobState.FORMED, JobState.FORMING):
            self._lost(job, member_id, member, why)
        elif job.state is JobState.FORMING:
            self._maybe_form(job)  # a waiting worker's leaving may be all that held the world back
        if wake:  # a waiting member that expired or left learns it at once
            job.notify()

    def _lost(self, job: _Job, member_id: str, member: _Member, why: str) -> None:
        """A member of a formed (or re-forming) world is gone."""
        rank = job.plan.ranks.get(member_id) if job.plan is not None else None
        what = f"member {member_id} (node {member.node_key!r}, rank {rank}) {why}"
        if len(job.members) < job.spec.min_world:
            job.reason = f"{what}; {len(job.members)} workers remain, fewer than the minimum of {job.spec.min_world}"
            if why == "left":
                job.state = JobState.ENDED
                self._events.ended(job.job_id, job.reason)
            else:
                job.state = JobState.FAILED
                self._events.failed(job.job_id, job.reason)
            self._store.save_job(job.stored())
            for m in job.members.values():
                job.push(m, Gone(f"job {job.job_id!r} cannot continue: {job.reason}"))
        elif job.state is JobState.FORMED:
            self._reform(job, what)
        else:
            job.reason = what
            self._maybe_form(job)

    # -- restart -----------------------------------------------------------------

    def restore(self, grace_s: float) -> int:
        """Loads every job from the store after a restart. Leases restart with
        `grace_s` to spare; forming members must re-attach (retry their Join)
        within it. Returns the number of jobs restored."""
        now = self._clock()
        for stored in self._store.load():
            spec = stored.spec
            job = _Job(stored.job_id, spec, False, now)
            job.state, job.generation, job.reason, job.world = JobState(stored.state), stored.generation, stored.reason, tuple(stored.world)
            if job.world:
                job.plan = plan_world(list(job.world), spec.at_size(len(job.world)))
            for sm in sorted(stored.members, key=lambda m: m.seq):
                p = JoinParams(job.job_id, spec, sm.node_key, sm.address, sm.master_port, sm.local_rank, sm.node_rank, False, sm.role)
                m = self._add_member(job, sm.member_id, p, sm.seq)
                m.in_world = sm.in_world
                job.placed += sm.in_world
                m.ready = not (job.state is JobState.FORMING and sm.in_world and job.generation > 0)
                job.not_ready += not m.ready
                m.lease_deadline = now + (self.lease_ttl_s if sm.in_world else 0) + grace_s
                self._seq = max(self._seq, sm.seq)
            if job.members:
                job.loopback = ipaddress.ip_address(next(iter(job.members.values())).address).is_loopback
                self._jobs[job.job_id] = job
            else:
                self._store.delete_job(job.job_id)
        return len(self._jobs)

    # -- reading -----------------------------------------------------------------

    def describe(self, job_id: str) -> JobView:
        """Raises NotFound for an unknown job."""
        if job_id not in self._jobs and job_id in self._failed:
            return self._failed[job_id][0]
        job = self._job(job_id)
        roles: dict[str, dict[str, int]] = {}
        for m in job.members.values():
            per_node = roles.setdefault(m.node_key, {})
            per_node[m.role] = per_node.get(m.role, 0) + 1
        in_plan = job.plan is not None and job.state is JobState.FORMED
        if in_plan:
            ranked = {n.node_key: n.node_rank for n in job.plan.nodes}
            keys = sorted(job.nodes, key=lambda k: (ranked.get(k, math.inf), node_sort_key(k)))
        else:
            keys = sorted(job.nodes, key=node_sort_key)
        nodes = tuple(
            NodeView(k, job.nodes[k].address, job.nodes[k].workers,
                     ranked.get(k) if in_plan else job.nodes[k].node_rank, tuple(sorted(roles.get(k, {}).items())))
            for k in keys
        )
        not_ready = job.not_ready
        waiting = sum(1 for m in job.members.values() if not m.in_world) if job.state is JobState.FORMED else 0
        if job.state in (JobState.FAILED, JobState.ENDED):
            reason = job.reason
        elif job.state is JobState.FORMED:
            reason = ""
        elif not_ready:
            reason = f"re-forming ({job.reason}): {not_ready} survivors have not re-armed yet; {job.shortfall()}"
        else:
            reason = f"waiting: {job.shortfall()}"
        return JobView(
            job_id=job.job_id,
            state=job.state,
            generation=job.generation,
            spec=job.spec,
            joined=len(job.members),
            missing=max(job.spec.min_world - len(job.members), 0) if job.state is JobState.FORMING else 0,
            nodes=nodes,
            reason=reason,
            forming_for_s=self._clock() - job.forming_since,
            missing_nodes=tuple(k for k in job.spec.expected_nodes if k not in job.nodes),
            waiting=waiting,
            not_ready=not_ready,
        )

    def job_ids(self) -> list[str]:
        """Jobs held, and failed jobs still described, sorted."""
        return sorted({*self._jobs, *self._failed})

    def stats(self) -> dict[str, float]:
        """Counts for metrics: jobs, members, waiting members, oldest keep-alive age."""
        now = self._clock()
        members = waiting = 0
        oldest = math.inf
        for job in self._jobs.values():
            members += len(job.members)
            for m in job.members.values():
                if not m.in_world:
                    waiting += 1
                elif m.lease_deadline < oldest:
                    oldest = m.lease_deadline
        age = 0.0 if oldest == math.inf else max(0.0, now - (oldest - self.lease_ttl_s))
        return {"jobs": len(self._jobs), "members": members, "waiting": waiting, "oldest_keepalive_s": age}

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"no job {job_id!r} on this server")
        return job

    @staticmethod
    def _member(job: _Job, member_id: str) -> _Member:
        member = job.members.get(member_id)
        if member is None:
            raise NotFound(
                f"member {member_id!r} is not in job {job.job_id!r} (it left, its lease expired, "
                f"or it never joined); join again"
            )
        return member
