"""The rendezvous model: jobs, nodes and members as the state machine holds
them, and the values that cross its boundary (assignments, session events,
waiter outcomes, views; the validated requests are params.py's). Pure: no
asyncio, no grpc."""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from commctx.common.planning import Candidate, JobSpec, PlannedGroup, Seat, WorldPlan, elide

from ..errors import NotFound
from .deadlines import Deadline
from .params import JoinParams, role_counts, secret_matches


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one server holds at most (each a flag and COMMCTX_* variable; server/config.py)."""

    max_jobs: int = 10_000
    max_members: int = 200_000  # across all jobs
    max_spec_bytes: int = 64 * 1024
    max_spec_rules: int = 1024  # roles + group rules + cpu twins + expected nodes
    max_join_wait_s: float = 3600.0
    max_streams: int = 200_000  # open Session streams
    retain_ended_jobs: int = 1000  # failed jobs kept (after their last worker left) so DescribeJob can say why
    retain_ended_s: float = 300.0  # ... and for how long
    max_connection_age_s: float = 3600.0  # then GOAWAY; calls in flight get max_join_wait_s + 1 s more
    max_events_per_job: int = 1000  # a job's history keeps its last this many events
    caller_share: float = 0.25  # what one caller (token, client certificate or peer address) may hold of each limit
    # Workers one job holds (its world, standbys and joiners waiting): 2**17, a 100,000-GPU world and room to
    # grow or stand by; an unbounded world would hold the event loop for as long as it takes to plan.
    max_world_size: int = 131_072
    max_workers_per_caller: int = 131_072  # workers one caller holds, waiting or seated: one largest world at once


class JobState(enum.Enum):
    FORMING = "forming"
    FORMED = "formed"
    FAILED = "failed"
    ENDED = "ended"
    CLOSED = "closed"  # a member closed it (torchrun's shutdown): no more joins; kept a while after its last member

    @property
    def over(self) -> bool:
        """Whether the job can no longer form (its members are told, and leave)."""
        return self in (JobState.FAILED, JobState.ENDED, JobState.CLOSED)


class Lease(enum.Enum):
    """Where a member's lease stands, as etcd's lessor names its states."""

    IN_JOIN = "in join"  # bound to its Join call: ending the call withdraws it; no deadline
    FIRST = "first"  # seated, not renewed since: a first lease, stretched while its world's sessions open
    RENEWING = "renewing"  # renewed since seated: its deadline is its last renewal + TTL
    DETACHED = "detached"  # its session ended without a Leave: gone at the grace's end unless a new session reattaches


# Why a member whose session ended without a Leave, and was not back within the
# reconnect grace, was removed (beside "left", "expired" and "withdrawn").
DISCONNECTED = "disconnected"
# Why one was removed at once: its session ended without a Leave after a peer
# reported that its world's collectives failed (no reconnect grace).
BROKE_OFF = "broke off"


class EventKind(str, enum.Enum):
    """What a job's event records (its history, as ListEvents and the dashboard show it)."""

    JOINED = "joined"  # workers joined (consecutive joins within a second are one event, counted)
    REFUSED = "refused"  # a join was refused (a storm of the same refusal is counted, not stored each time)
    FORMED = "formed"  # a generation formed: its size, nodes and how long it took
    REFORMING = "reforming"  # the formed world is being replaced, and why
    LOST = "lost"  # a member expired, or its session closed without a Leave
    LEFT = "left"  # a member left (or withdrew its Join before it was seated)
    FAILED = "failed"  # the job cannot form or go on
    ENDED = "ended"  # members left and too few remain: the job finished


class JobEvent(NamedTuple):
    """One entry of a job's history. `seq` counts from 1 per job; `time` is
    wall-clock seconds since the epoch; `fields` holds the structured details
    (member, node, rank, why, world_size, nodes, seconds, count, ...)."""

    seq: int
    time: float
    kind: str  # an EventKind value
    generation: int  # the job's generation when it happened (a formed event: the new one)
    message: str
    fields: Mapping[str, Any] = {}


class Joined(NamedTuple):
    job_id: str
    member_id: str
    lease_ttl_s: float
    joined: int


class SeatInWorld(NamedTuple):
    """A worker's seat in one world, and what its Assignment says of that
    world (the server's view of the Assignment it is sent)."""

    job_id: str
    generation: int
    seat: Seat
    plan: WorldPlan
    changed_groups: tuple[str, ...] = ()
    previous_rank: int | None = None
    reason: str = ""  # why this generation formed ("" for a job's first world)
    previous_lost: bool = False  # members of the previous world went without a Leave
    worker: int = 0  # a host membership's worker: its index
    groups: tuple[PlannedGroup, ...] = ()  # its groups in the plan (plan.groups_of(seat)), when known


@dataclasses.dataclass(frozen=True, slots=True)
class NewWorld:
    """A world that formed: the event pushed to its survivors, and what its
    Join waiters wake to. Each member's SeatInWorld is derived on demand, by
    whoever delivers it, so forming a world of ten thousand costs the state
    machine one object rather than ten thousand."""

    job_id: str
    generation: int
    plan: WorldPlan
    previous: WorldPlan | None  # the world it replaces
    reason: str = ""
    lost: bool = False  # members of the world it replaces went without a Leave
    hosts: Mapping[str, tuple[int, ...]] | None = None  # seated host memberships' worker indexes (None: none)
    run: int = 1  # the run of the job it belongs to: (job_id, run, generation) names one world

    def has_seat(self, member_id: str) -> bool:
        """Whether the member sits in this world (whole: members are seated whole or not at all)."""
        return member_id in self.plan.ranks or (self.hosts is not None and member_id in self.hosts)

    def seat_of(self, member_id: str, worker: int = 0) -> SeatInWorld | None:
        """The seat of `member_id` (a seated worker's id: worker_id), whose host worker index is `worker`."""
        p = self.plan.seat_of(member_id)
        if p is None:
            return None
        before = self.previous.seat_of(member_id) if self.previous is not None else None
        groups = self.plan.groups_of(p)
        changed = self.changed_groups(groups, before)
        return SeatInWorld(self.job_id, self.generation, p, self.plan, changed, before.rank if before else None,
                           self.reason, self.lost, worker, groups)

    def host_seats(self, member_id: str) -> list[SeatInWorld]:
        """A seated host membership's workers' seats, in its order."""
        return [self.seat_of(worker_id(member_id, i), i) for i in (self.hosts or {}).get(member_id, ())]

    def changed_groups(self, groups: tuple[PlannedGroup, ...], before: Seat | None) -> tuple[str, ...]:
        """The modes of `groups` (a worker's in this world) whose members differ
        from those of its groups at `before`, its place in the previous world."""
        if before is None:
            return tuple(g.mode for g in groups)
        # RankSets are canonical: equal runs mean equal members, with no list expanded.
        old = {g.mode: g.ranks for g in self.previous.groups_of(before)}
        return tuple(g.mode for g in groups if old.get(g.mode) != g.ranks)


class Reforming(NamedTuple):
    """The world of `generation` is being re-formed and the next one cannot form yet."""

    generation: int
    reason: str
    lost: bool = False  # members of that world went without a Leave: its collectives may block on them


class Gone(NamedTuple):
    """The member is gone, or its job cannot continue. Final."""

    reason: str
    ended: bool = False  # the job ended because members left (it finished), not a failure
    closed: bool = False  # the job was closed: the run is over for every member


class Replaced(NamedTuple):
    """The member opened a newer session: this one ends (no departure)."""

    reason: str


SessionEvent = Reforming | NewWorld | Gone | Replaced


class JobStopped(NamedTuple):
    """Waiter outcome: the job failed, ended or was closed; every waiter hears why."""

    reason: str
    closed: bool = False


class MemberGone(NamedTuple):
    """Waiter outcome: this member left or expired while waiting."""

    member_id: str


WaitOutcome = NewWorld | JobStopped | MemberGone


class PlanRequest(NamedTuple):
    """A world too big to plan inside a transition: the executor plans it off
    the event loop and hands the result to `Rendezvous.planned`."""

    job_id: str
    version: int  # the job's version the candidates were taken at
    candidates: tuple  # Candidates; a node membership's as one NodeWorkers (forming.py), made off the loop
    spec: JobSpec  # at the world's size


class Note(NamedTuple):
    """Something operators hear of (a log line, a metric): `event` and its fields."""

    event: str
    fields: Mapping[str, Any]


class Member:
    # Few objects per member: thousands of these outlive the join burst, and
    # each small object pins the allocator page it landed on.
    __slots__ = ("node_key", "address", "port", "local_rank", "node_rank", "role", "seq", "lease", "lease_deadline", "queued",
                 "generation", "sink", "secret", "workers", "slots", "caller", "held")

    def __init__(self, node: Node, p: JoinParams, seq: int) -> None:
        self.node_key = node.key
        self.address = node.address if p.address == node.address else p.address
        self.port = p.port  # its spare listening port; 0 once used as rank 0's, until it offers another
        self.local_rank = p.local_rank
        self.node_rank = p.node_rank
        self.role = p.role
        self.seq = seq  # join order, kept across restarts
        self.lease = Lease.IN_JOIN
        self.lease_deadline: Deadline | None = None  # when the lease runs out (None: IN_JOIN, its Join call binds it)
        self.queued: Deadline | None = None  # the deadline of its live entry in the lease heap (later entries are stale)
        self.generation = 0  # the latest generation its session said it holds
        self.sink: Any = None  # the queue of its open Session stream: the executor puts its events in it
        self.secret = p.secret  # digest of its secret ("": none)
        self.workers = p.workers  # >1: a node membership, seated as local ranks 0..workers-1 (worker_id)
        self.slots = p.slots  # a host membership's workers, each seated as "<member id>/<index>"; () otherwise
        self.caller = ""  # the Caller.key of its Join ("": the server's, or restored: not kept)
        self.held = 0  # the workers counted against that caller's --max-workers-per-caller (given back when it goes)

    def roles(self) -> list[tuple[str, int]]:
        """The workers it holds, as (role, how many)."""
        return role_counts(self.role, self.workers, self.slots)

    def worker_ids(self, member_id: str) -> list[str]:
        """The ids its workers are seated under."""
        if self.slots:
            return [worker_id(member_id, s.index) for s in self.slots]
        return [worker_id(member_id, i) for i in range(self.workers)]

    def candidate(self, member_id: str, seat: tuple[int, int] | None = None) -> Candidate:
        """A single-worker member as the planner sees it; `seat` is its (node
        rank, local rank) in the world being replaced."""
        return Candidate(member_id, self.node_key, self.address, self.port, self.local_rank, self.node_rank, self.role,
                         *(seat or (None, None)))

    def candidates(self, member_id: str, seats: Mapping[str, tuple[int, int]]) -> list[Candidate]:
        """This member's workers as the planner sees them, with their (node
        rank, local rank) in the world being replaced (`seats`, by worker id):
        a host membership's each its own, a node membership's its node's."""
        if self.slots:
            return [Candidate(wid, self.node_key, self.address, self.port, s.local_rank, self.node_rank, s.role,
                              *seats.get(wid, (None, None))) for s, wid in zip(self.slots, self.worker_ids(member_id))]
        seat = seats.get(member_id)
        if self.workers == 1:
            return [self.candidate(member_id, seat)]
        return [Candidate(worker_id(member_id, i), self.node_key, self.address, self.port, i, self.node_rank, self.role,
                          seat[0] if seat else None) for i in range(self.workers)]


def worker_id(member_id: str, index: int) -> str:
    """The id under which a worker is seated: for a node membership's worker of
    local rank `index`, the member id itself for 0 (so the membership's
    seat is its first worker's) and "<member id>/<index>" for the others;
    for a host membership's worker `index` (from 1), "<member id>/<index>".
    Never a member id but for a node membership's first worker."""
    return member_id if index == 0 else f"{member_id}/{index}"


def member_of(worker: str) -> str:
    """The member id of a seated worker's id (worker_id's inverse)."""
    return worker.partition("/")[0]


class Node:
    __slots__ = ("key", "address", "node_rank", "local_ranks", "workers", "roles", "agent", "host", "addresses")

    def __init__(self, key: str, address: str, host: str = "") -> None:
        self.key = key
        self.address = address
        self.addresses = (address,)  # every address its members gave, the first first
        self.host = host  # the machine that gave its key (JoinParams.host; "": a key pinned on purpose, not checked)
        self.node_rank: int | None = None
        self.local_ranks: dict[int, str] = {}  # explicit local rank -> member id
        self.workers = 0
        self.roles: dict[str, int] = {}  # workers per role
        self.agent = ""  # the node membership that holds the whole node, if any


class Job:
    __slots__ = (
        "job_id", "spec", "state", "generation", "members", "nodes", "node_ranks", "plan", "previous_plan",
        "reason", "forming_since", "last_arrival", "loopback", "role_counts", "seated_workers", "suspects", "announced",
        "last_call_armed", "version", "planning", "seal", "node_order", "workers", "events", "refused", "creator",
        "failed", "abandoned", "formed_abandoned", "hosts", "run", "started",
    )

    def __init__(self, job_id: str, spec: JobSpec, loopback: bool, now: float, run: int = 1, started: float = 0.0) -> None:
        self.job_id = job_id
        self.run = run  # which run of this job id: a finished, failed or closed run's id takes a new one once its members are gone
        self.started = started  # wall-clock time of its first Join
        self.spec = spec
        self.state = JobState.FORMING
        self.generation = 0
        self.members: dict[str, Member] = {}  # insertion order = join order
        self.workers = 0  # workers of all members (a node membership counts its workers)
        self.nodes: dict[str, Node] = {}
        self.node_ranks: dict[int, str] = {}  # explicit node rank -> node key
        self.plan: WorldPlan | None = None  # the current world's (while re-forming: the one being replaced)
        self.previous_plan: WorldPlan | None = None  # the world `plan` replaced (for a late session's changed_groups)
        self.reason = ""  # why it failed or ended; while re-forming, why; once formed, why this generation formed
        self.forming_since = now
        self.last_arrival = now
        self.loopback = loopback
        self.role_counts: dict[str, int] = {}
        self.seated_workers = 0  # workers that are in `plan`
        self.suspects: set[str] = set()  # re-forming: survivors not heard from lately, awaited before forming
        self.announced = False  # re-forming: survivors were told the world cannot form at once
        self.last_call_armed = False
        self.version = 0  # bumped whenever who is in the job, or a member's port, changes
        self.planning = -1  # the version a plan is being computed for off the loop, or -1
        self.seal = ""  # digest of the job secret ("": an open job)
        self.node_order: tuple[int, frozenset[str]] | None = None  # the node keys of `plan`, by generation (Rendezvous._node_page)
        self.events: collections.deque[JobEvent] = collections.deque()  # its history, the last max_events_per_job
        self.refused: Refusals = Refusals()
        self.creator: Any = None  # the Caller whose Join created it (shares.py); restored jobs: the server
        self.failed = 0  # a generation whose collectives a member reported failed (0: none): no reconnect grace in it
        # A member of the world being replaced went without a Leave (its lease
        # expired, its session closed): a collective of that world may block on
        # it, and its survivors end them (Reforming.lost, NewWorld.lost).
        self.abandoned = False
        self.formed_abandoned = False  # `abandoned` of the world this generation replaced
        self.hosts: dict[str, tuple[int, ...]] | None = None  # host memberships seated in `plan`: their workers' indexes

    @property
    def units(self) -> int:
        """What its sizes count: workers, or (a job of nodes) node memberships."""
        return len(self.members) if self.spec.nodes else self.workers

    def count(self) -> str:
        """'3 of 8 workers', or '2 of 4 nodes (10 workers)' for a job of nodes."""
        if self.spec.nodes:
            return f"{len(self.members)} of {self.spec.world_size} nodes ({self.workers} workers)"
        return f"{self.workers} of {self.spec.world_size} workers"

    def in_world(self, member_id: str, member: Member | None = None) -> bool:
        """Whether the member holds a seat in `plan` (the current world, or the
        one being replaced); a host membership's workers are seated under
        ids of their own (`member`: the member, when it is no longer held)."""
        plan = self.plan
        if plan is None:
            return False
        if member_id in plan.ranks:
            return True
        m = member or self.members.get(member_id)
        return m is not None and any(worker_id(member_id, s.index) in plan.ranks for s in m.slots)

    def seated(self, member_id: str, member: Member) -> int:
        """How many of the member's workers sit in `plan`."""
        if self.plan is None:
            return 0
        if not member.slots:
            return member.workers if member_id in self.plan.ranks else 0
        return sum(worker_id(member_id, s.index) in self.plan.ranks for s in member.slots)

    def rank_of(self, member_id: str, member: Member) -> int | None:
        """The member's (first seated worker's) global rank in `plan`, if seated."""
        if self.plan is None:
            return None
        for wid in member.worker_ids(member_id) if member.slots else (member_id,):
            rank = self.plan.ranks.get(wid)
            if rank is not None:
                return rank
        return None

    def seat_hosts(self, member_ids: Iterable[str], counts: Mapping[str, int] | None = None) -> None:
        """Sets `hosts`: which workers of these host memberships sit in `plan`, in each one's order
        (`counts`: how many of each sit there, where known: when all do, none is looked up)."""
        ranks, members, counts = self.plan.ranks, self.members, counts or {}
        hosts = {mid: tuple(s.index for s in members[mid].slots if counts.get(mid) == len(members[mid].slots)
                            or worker_id(mid, s.index) in ranks) for mid in member_ids}
        self.hosts = {mid: seated for mid, seated in hosts.items() if seated} or None

    def world(self, previous: WorldPlan | None = None) -> NewWorld:
        """`plan` as the world of this generation (for a late session: with the one it replaced)."""
        return NewWorld(self.job_id, self.generation, self.plan, previous, self.reason,
                        self.formed_abandoned if previous is not None else False, self.hosts, self.run)

    def member(self, member_id: str, secret: str | None = None) -> Member:
        """The member, if `secret` is its secret (None: not asked, a call on
        an already authenticated session). A wrong secret gets the answer an
        unknown member gets.

        Raises:
            NotFound: no such member, or not its secret.
        """
        member = self.members.get(member_id)
        if member is None or (secret is not None and not secret_matches(member.secret, secret)):
            raise NotFound(
                f"member {elide(member_id)} is not in job {self.job_id!r} (it left, its lease expired, "
                f"or it never joined); join again"
            )
        return member

    def survivors(self) -> list[str]:
        """Members seated in `plan` that are still here."""
        return [mid for mid in self.members if self.in_world(mid)]

    def shortfall(self) -> str:
        nodes = ", ".join(f"{n.key}×{n.workers}" for n in list(self.nodes.values())[:16])
        if len(self.nodes) > 16:
            nodes += f", ... ({len(self.nodes)} nodes)"
        missing = self.spec.min_world - self.units
        what = f"{self.count()} joined (nodes present: {nodes or 'none'})"
        if self.spec.min_size is not None:
            return what + (f"; {missing} missing for the minimum of {self.spec.min_size}" if missing > 0 else "; waiting for the last call")
        return f"{what}; {missing} missing"


@dataclasses.dataclass(eq=False)
class Jobs:
    """The jobs a machine holds, as its parts share them (the Rendezvous owns it)."""

    live: dict[str, Job] = dataclasses.field(default_factory=dict)  # each job id's run under way
    members: int = 0  # across all jobs (--max-members)
    seq: int = 0  # the join order of the latest member, kept across restarts


class Refusals:
    """The joins a job refused: how many, the last one's reason, and when each
    reason was last recorded as an event (a storm of one reason is counted
    between two events of it, not stored each time)."""

    __slots__ = ("count", "last", "recorded", "held", "events")
    QUIET_S = 10.0  # the same reason is recorded at most once per this many seconds
    KEPT = 64  # reasons remembered (the oldest forgotten first), and refusal events kept: apart from the job's life

    def __init__(self) -> None:
        self.events: collections.deque[JobEvent] = collections.deque(maxlen=self.KEPT)  # in memory only: a sample
        self.count = 0
        self.last = ""
        self.recorded: dict[str, float] = {}  # reason -> when its last event was recorded
        self.held: dict[str, int] = {}  # reason -> refusals of it since that event

    def note(self, reason: str, now: float) -> int | None:
        """Counts a refusal. Returns how many like it were held back since its
        last event when this one is to be recorded, else None (counted only)."""
        self.count += 1
        self.last = reason
        last = self.recorded.get(reason)
        if last is not None and now - last < self.QUIET_S:
            self.held[reason] = self.held.get(reason, 0) + 1
            return None
        self.recorded.pop(reason, None)
        self.recorded[reason] = now
        while len(self.recorded) > self.KEPT:
            self.held.pop(next(iter(self.recorded)), None)
            del self.recorded[next(iter(self.recorded))]
        return self.held.pop(reason, 0)
