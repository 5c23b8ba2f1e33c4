"""Forming: when a job's next world forms, who sits in it, and what a job that
cannot go on tells its members (FORMING -> FORMED, FAILED, ENDED, CLOSED).
A decider: it is given a job and adds to the `Actions` it is given or
returns; the plans of big worlds come back to it through `planned`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple

from commctx.common.planning import Candidate, JobSpec, PlanError, WorldPlan, elide, plan_world

from .actions import Actions
from .deadlines import Deadline, Deadlines
from .history import History
from .leases import Lessor
from .model import (
    EventKind,
    Gone,
    Job,
    Jobs,
    JobState,
    JobStopped,
    Lease,
    NewWorld,
    Note,
    PlanRequest,
    Reforming,
    member_of,
    worker_id,
)
from .params import Slot
from .store import PutJob, PutMember, member_record

log = logging.getLogger("commctx.server")


class NodeWorkers(NamedTuple):
    """A node membership's workers as the planner sees them, not yet made: a
    1,024-worker node is one object in the transition, and its candidates are
    made where the world is planned (off the event loop for a big world)."""

    member_id: str
    node_key: str
    address: str
    port: int
    node_rank: int | None
    role: str
    workers: int
    prev_node_rank: int | None  # its node rank in the world being replaced

    def candidates(self) -> list[Candidate]:
        """Its workers, local ranks 0..workers-1 (model.Member.candidates)."""
        return [Candidate(worker_id(self.member_id, i), self.node_key, self.address, self.port, i, self.node_rank, self.role,
                          self.prev_node_rank) for i in range(self.workers)]


class HostWorkers(NamedTuple):
    """A host membership's workers as the planner sees them, not yet made (as NodeWorkers)."""

    member_id: str
    node_key: str
    address: str
    port: int
    node_rank: int | None
    slots: tuple[Slot, ...]
    prev_node_rank: int | None  # its node rank in the world being replaced
    before: tuple[str, ...]  # the ids seated on that node then, by local rank (() if none)

    def candidates(self) -> list[Candidate]:
        """Its workers, each with its own seat before (model.Member.candidates)."""
        where = {wid: i for i, wid in enumerate(self.before)}
        out = []
        for s in self.slots:
            wid = worker_id(self.member_id, s.index)
            local = where.get(wid)
            out.append(Candidate(wid, self.node_key, self.address, self.port, s.local_rank, self.node_rank, s.role,
                                 None if local is None else self.prev_node_rank, local))
        return out


Unit = Candidate | NodeWorkers | HostWorkers  # a world's candidates, a node or host membership's as one


def expand(candidates: Iterable[Unit]) -> list[Candidate]:
    """The candidates of a world, each node or host membership's workers made."""
    out: list[Candidate] = []
    for c in candidates:
        if type(c) is Candidate:
            out.append(c)
        else:
            out += c.candidates()
    return out


def plan_or_error(candidates: Iterable[Unit], spec: JobSpec) -> WorldPlan | PlanError:
    """`plan_world` of the candidates (node and host memberships' made here), any failure
    as a PlanError: a planner bug fails the one job it meets, saying so,
    instead of a Join half done or a server error."""
    try:
        return plan_world(expand(candidates), spec)
    except PlanError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - a bug; logged with its traceback for the report
        log.exception("planner_failed")
        return PlanError(f"the planner failed on this spec ({type(exc).__name__}: {elide(str(exc))}); "
                         "this is a commctx bug, please report it with the spec")


class Forming:
    """Re-forming a world, choosing its members, seating the plan, stopping a
    job. Its state: the machine's jobs (shared), why worlds are held (`held`),
    the heap of elastic jobs' last calls, and where plans are made (inline up
    to `plan_inline_max` workers); it grants first leases through the lessor
    and records events in the history."""

    def __init__(self, jobs: Jobs, lessor: Lessor, history: History, clock: Callable[[], float],
                 plan_inline_max: int) -> None:
        self._jobs = jobs
        self._lessor = lessor
        self._history = history
        self._clock = clock
        self.plan_inline_max = plan_inline_max
        self.held: str | None = None  # why no world may form now (the store refuses writes), or None
        self._last_calls = Deadlines()  # job id

    def change(self, job: Job, reason: str, actions: Actions, confirmed: str | None = None) -> None:
        """FORMED -> FORMING: the world of this generation is to be replaced.
        With `confirmed`, every other survivor is awaited until it renews."""
        now = self._clock()
        job.state = JobState.FORMING
        job.forming_since = now
        job.reason = reason
        job.announced = False
        lately = self._lessor.lately
        job.suspects = {mid for mid in job.survivors()
                        if not lately(job.members[mid], now) or (confirmed is not None and mid != confirmed)}
        actions.notes.append(Note("reforming", {"job": job.job_id, "generation": job.generation, "reason": reason}))
        self._history.event(job, EventKind.REFORMING, f"generation {job.generation} is re-forming: {reason}", actions,
                            reason=reason)
        self.maybe_form(job, actions)
        if job.state is JobState.FORMING:
            self.announce(job, actions)
            actions.writes.append(PutJob(self._history.record(job)))

    def announce(self, job: Job, actions: Actions) -> None:
        """Tells the survivors that the world is re-forming (once per change),
        unless the plan of the next world is already being computed: then its
        assignment, a few milliseconds later, is the one message they need."""
        if job.announced or job.planning == job.version:
            return
        job.announced = True
        change = Reforming(job.generation, job.reason, job.abandoned)
        for mid in job.survivors():
            sink = job.members[mid].sink
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
        elif n > job.seated_workers and self._clock() < job.last_arrival + spec.last_call_s:
            return None
        else:
            n = spec.largest_world(n)
        if n is not None and job.workers != len(job.members):  # node memberships: whole ones only
            n = self._candidates(job, n, made=False)[1]
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
        if n < spec.world_size and job.workers > job.seated_workers and self._clock() < job.last_arrival + spec.last_call_s:
            return None  # the last call collects arrivals; survivors re-forming alone have nobody to wait for
        sizes = [job.members[mid].workers for mid in self._member_order(job)][:spec.world_size]
        while len(sizes) >= spec.min_world:
            workers = sum(sizes)
            if workers % spec.step == 0:
                return workers
            sizes.pop()
        return None

    def maybe_form(self, job: Job, actions: Actions) -> None:
        n = self._formable(job)
        if n is not None:
            self._form(job, n, actions)

    def grows(self, job: Job) -> bool:
        """Whether the node memberships present fit a world larger than the formed one."""
        if job.spec.nodes:
            return job.plan.num_nodes < job.spec.world_size and job.units > job.plan.num_nodes
        size = job.spec.largest_world(min(job.workers, job.spec.world_size))
        return size is not None and self._candidates(job, size, made=False)[1] > job.seated_workers

    @staticmethod
    def _seats(job: Job) -> dict[str, tuple[int, int]]:
        """The (node rank, local rank) in the world being replaced of each
        member still here, in rank order; a node or host membership's, which
        holds its node alone, is its node's (node rank, 0): its workers' seats
        are made with their candidates (NodeWorkers, HostWorkers). Linear in
        the members and nodes, not in the workers."""
        previous, members = job.plan, job.members
        seats: dict[str, tuple[int, int]] = {}
        if previous is not None:
            for node_rank, node in enumerate(previous.seats.nodes):
                first = node.members[0]
                m = members.get(member_of(first))
                if m is not None and (m.slots or (m.workers > 1 and first in members)):
                    seats[member_of(first)] = (node_rank, 0)  # its other workers are not members
                    continue
                for local_rank, wid in enumerate(node.members):
                    if wid in members:
                        seats[wid] = (node_rank, local_rank)
        return seats

    @classmethod
    def _member_order(cls, job: Job, seats: dict[str, tuple[int, int]] | None = None) -> list[str]:
        """Members in the order the next world takes them: survivors first, in
        their previous rank order (the seats'), then newcomers in join order;
        in a job of nodes, those of callers that hold seats before strangers'."""
        seats = cls._seats(job) if seats is None else seats
        if not seats:
            return list(job.members)
        members = job.members
        survivors = dict.fromkeys(seats)  # member ids (_seats), host memberships' too
        newcomers = [mid for mid in members if mid not in survivors]
        if job.spec.nodes and newcomers:  # a team's own replacement before a stranger's standby
            teams = {members[mid].caller for mid in survivors if mid in members}
            newcomers.sort(key=lambda mid: members[mid].caller not in teams)  # stable: join order within each
        return [*survivors, *newcomers]

    @classmethod
    def _candidates(cls, job: Job, n: int, made: bool = True) -> tuple[list[Unit], int]:
        """The next world's workers, in _member_order, and how many; whole members,
        so at most `n`; a node or host membership's as one unit (expand makes its
        workers). Not `made`: the count alone (the list is empty)."""
        members = job.members
        seats = cls._seats(job)
        nodes = job.plan.seats.nodes if job.plan is not None else ()
        candidates: list[Unit] = []
        count = 0
        for mid in cls._member_order(job, seats):
            m = members[mid]
            if m.workers == 1 and not m.slots:  # most members (ten thousand at a re-form): no list for each
                if count < n:
                    if made:
                        candidates.append(m.candidate(mid, seats.get(mid)))
                    count += 1
            elif count + m.workers <= n:
                seat = seats.get(mid)
                if not made:
                    pass
                elif m.slots:
                    candidates.append(HostWorkers(mid, m.node_key, m.address, m.port, m.node_rank, m.slots,
                                                  seat[0] if seat else None, nodes[seat[0]].members if seat else ()))
                else:
                    candidates.append(NodeWorkers(mid, m.node_key, m.address, m.port, m.node_rank, m.role, m.workers,
                                                  seat[0] if seat else None))
                count += m.workers
            if count == n:
                break
        return candidates, count

    def _form(self, job: Job, n: int, actions: Actions) -> None:
        candidates = self._candidates(job, n)[0]
        spec = job.spec.at_size(n)
        if n > self.plan_inline_max:
            if job.planning != job.version:  # else the plan for exactly these candidates is on its way
                job.planning = job.version
                actions.plans.append(PlanRequest(job.job_id, job.version, tuple(candidates), spec))
            return
        self._seat(job, plan_or_error(candidates, spec), actions)

    def plan_wanted(self, request: PlanRequest) -> bool:
        """Whether the plan of `request` would still be used (planned would not drop it)."""
        job = self._jobs.live.get(request.job_id)
        return job is not None and job.planning == request.version

    def planned(self, request: PlanRequest, plan: WorldPlan | PlanError) -> Actions:
        """The plan of `request`, computed off the event loop, is ready. It is
        applied unless the job changed since it was requested; then the job is
        planned again from what it holds now."""
        actions = Actions()
        job = self._jobs.live.get(request.job_id)
        if job is None or job.planning != request.version:
            return actions  # gone, or superseded by a later request
        job.planning = -1
        if job.version != request.version or self._formable(job) != request.spec.world_size:
            self.maybe_form(job, actions)
            if job.state is JobState.FORMING and job.generation > 0:
                self.announce(job, actions)  # survivors wait longer: tell them now
        else:
            self._seat(job, plan, actions)
        return actions

    def hold_worlds(self, why: str | None) -> Actions:
        """While `why` is set (the store refuses writes), jobs stay FORMING: a
        world nobody could be told of durably is not formed. None lifts the hold
        and forms every job that can form (linear in the number of jobs)."""
        self.held = why
        actions = Actions()
        if why is None:
            for job in list(self._jobs.live.values()):
                if job.state is JobState.FORMING:
                    self.maybe_form(job, actions)
        return actions

    def _seat(self, job: Job, plan: WorldPlan | PlanError, actions: Actions) -> None:
        """FORMING -> FORMED with `plan` (or FAILED with the reason it could not be planned)."""
        if self.held is not None:
            return  # hold_worlds(None) plans it again
        if isinstance(plan, PlanError):
            self.stop(job, JobState.FAILED, str(plan), "cannot form", actions)
            return
        if plan.master_port == 0:
            # Rank 0's spare port serves an earlier world's store and it has
            # not offered another yet: await it like a survivor not heard from.
            job.suspects.add(member_of(plan.seats.nodes[0].members[0]))
            self.announce(job, actions)
            return
        now = self._clock()
        previous, previous_hosts = job.plan, job.hosts or {}
        reason = job.reason if previous is not None else ""
        job.state = JobState.FORMED
        job.generation += 1
        job.previous_plan, job.plan = previous, plan
        job.reason, job.suspects, job.announced = reason, set(), False
        job.formed_abandoned, job.abandoned = job.abandoned, False
        job.seated_workers = plan.world_size
        members = job.members
        first_lease = self._lessor.first_lease(now, plan.world_size)
        hosts: dict[str, int] = {}  # host memberships seated: how many of their workers
        for node in plan.seats.nodes:
            seated = node.members
            first = members.get(member_of(seated[0]))
            if first is not None and (first.slots or (first.workers > 1 and seated[0] in members)):
                if first.slots:  # a node or host membership holds its node alone: one look at it
                    hosts[member_of(seated[0])] = len(seated)
                seated = seated[:1]
            for wid in seated:
                mid, m = member_of(wid), members.get(member_of(wid))
                if m is None:
                    continue
                if m.lease is Lease.IN_JOIN:  # newly seated: its first lease starts now
                    self._lessor.grant(job.job_id, mid, m, first_lease)
        job.seat_hosts(hosts, hosts)
        rank0 = member_of(plan.seats.nodes[0].members[0])
        members[rank0].port = 0  # it now serves the TCPStore; rank 0 offers a new spare
        actions.writes.append(PutMember(job.job_id, member_record(rank0, members[rank0])))
        formed_in_s, job.forming_since = now - job.forming_since, now  # the record keeps the formed world's start
        actions.writes.append(PutJob(self._history.record(job)))
        world = NewWorld(job.job_id, job.generation, plan, previous, reason, job.formed_abandoned, job.hosts, job.run)
        if previous is not None:
            change = Reforming(job.generation - 1, reason, job.formed_abandoned)
            for mid, m in members.items():
                if m.sink is not None:
                    if world.has_seat(mid):
                        actions.pushes.append((m.sink, world))
                    elif mid in previous.ranks or mid in previous_hosts:  # a survivor this world has no seat for: it waits
                        actions.pushes.append((m.sink, change))
        actions.wakes.append((job.job_id, world))
        actions.notes.append(Note("formed", {"job": job.job_id, "generation": job.generation, "world_size": plan.world_size,
                                             "nodes": plan.num_nodes, "seconds": round(formed_in_s, 3)}))
        message = (f"generation {job.generation} formed: {plan.world_size} worker{'s' * (plan.world_size != 1)} on "
                   f"{plan.num_nodes} node{'s' * (plan.num_nodes != 1)} in {formed_in_s:.2f} s"
                   + (f" ({reason})" if reason else ""))
        self._history.event(job, EventKind.FORMED, message, actions, world_size=plan.world_size, nodes=plan.num_nodes,
                            seconds=round(formed_in_s, 3), reason=reason)

    def stop(self, job: Job, state: JobState, reason: str, verb: str, actions: Actions) -> None:
        """The job cannot go on: FAILED, ENDED or CLOSED. Every session and waiter hears why."""
        job.state, job.reason, job.suspects = state, reason, set()
        failed, closed = state is JobState.FAILED, state is JobState.CLOSED
        actions.notes.append(Note("failed" if failed else "ended", {"job": job.job_id, "reason": reason}))
        self._history.event(job, EventKind.FAILED if failed else EventKind.ENDED,
                            f"{'failed' if failed else 'closed' if closed else 'finished'}: {reason}", actions, reason=reason)
        actions.writes.append(PutJob(self._history.record(job)))
        gone = Gone(f"job {job.job_id!r} {verb}: {reason}", not failed, closed)
        actions.pushes.extend((m.sink, gone) for m in job.members.values() if m.sink is not None)
        stopped = f"job {job.job_id!r} was closed: {reason}" if closed else f"job {job.job_id!r} cannot form: {reason}"
        actions.wakes.append((job.job_id, JobStopped(stopped, closed)))

    def arm_last_call(self, job: Job) -> None:
        """Waits for a forming elastic job's last call (once armed, until it comes due)."""
        if job.state is JobState.FORMING and job.spec.min_size is not None and not job.last_call_armed:
            job.last_call_armed = True
            self._last_calls.push(job.last_arrival + job.spec.last_call_s, job.job_id)

    def last_calls_due(self, now: float, actions: Actions) -> None:
        """Forms the elastic worlds whose last call has passed by `now`."""
        while (entry := self._last_calls.pop_due(now)) is not None:
            job = self._jobs.live.get(entry[1])
            if job is None:
                continue
            job.last_call_armed = False
            if job.state is JobState.FORMING and job.spec.min_size is not None:
                if now < job.last_arrival + job.spec.last_call_s:
                    self.arm_last_call(job)
                else:
                    self.maybe_form(job, actions)

    def next_deadline(self) -> Deadline | None:
        """The earliest last call waiting (it may be stale; None: none)."""
        return self._last_calls.next()
