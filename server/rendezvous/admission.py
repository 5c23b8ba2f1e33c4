"""Admission: who may join a job and on what terms; what a Join, a re-attaching
Join, a refused one and a withdrawn one do to the job. A decider: it is given
a Join's parameters and returns the `Actions` they imply."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

from ..errors import AlreadyExists, Closed, Conflict, Full, LimitExceeded, Refusal, Sealed, Stale
from .actions import Actions
from .forming import Forming
from .history import History
from .leases import Lessor
from .leaving import Leaving
from .model import EventKind, Job, Jobs, JobState, Joined, Lease, Limits, Member, NewWorld, Node, Note, worker_id
from .params import JoinParams, Slot, check_world_size
from .sessions import serves_store
from .shares import JOBS, SERVER, WORKERS, Caller, Guesses, Shares
from .store import PutJob, PutMember, member_record

log = logging.getLogger("commctx.server")


def add_member(job: Job, member_id: str, p: JoinParams, seq: int) -> Member:
    """Enters a member in the job's node, rank and role bookkeeping (undone by Leaving.remove)."""
    node = job.nodes.get(p.node_key)
    if node is None:
        node = job.nodes[p.node_key] = Node(p.node_key, p.address, p.host)
    elif p.address not in node.addresses:
        node.addresses += (p.address,)
    if p.node_rank is not None and node.node_rank is None:
        node.node_rank = p.node_rank
        job.node_ranks[p.node_rank] = node.key
    if p.local_rank is not None:
        node.local_ranks[p.local_rank] = member_id
    if p.workers > 1 or p.slots or job.spec.nodes:  # a node or host membership: its node alone
        node.agent = member_id
    member = job.members[member_id] = Member(node, p, seq)
    count_in(job, node, member_id, p.slots, p.roles())
    return member


def count_in(job: Job, node: Node, member_id: str, slots: tuple[Slot, ...], roles: list[tuple[str, int]]) -> None:
    """Counts workers joining (a member's, or a host membership's newcomers) in the node, role and job bookkeeping."""
    for s in slots:
        if s.local_rank is not None:
            node.local_ranks[s.local_rank] = worker_id(member_id, s.index)
    for role, count in roles:
        node.workers += count
        node.roles[role] = node.roles.get(role, 0) + count
        job.role_counts[role] = job.role_counts.get(role, 0) + count
        job.workers += count
    job.version += 1


class Admission:
    """Joining, re-attaching, the checks a Join passes, and withdrawing a Join
    that ended unseated. Its state: the machine's jobs (shared), the limits and
    callers' shares a Join is held to, the wrong-secret counts, how member ids
    are made, and the outbox: what a refused Join still implies (its event),
    which the executor takes with the next actions (`take_outbox`)."""

    def __init__(self, jobs: Jobs, limits: Limits, shares: Shares, guesses: Guesses, lessor: Lessor, forming: Forming,
                 leaving: Leaving, history: History, clock: Callable[[], float], wall: Callable[[], float],
                 new_member_id: Callable[[], str]) -> None:
        self._jobs = jobs
        self._limits = limits
        self._shares = shares
        self._guesses = guesses
        self._lessor = lessor
        self._forming = forming
        self._leaving = leaving
        self._history = history
        self._clock = clock
        self._wall = wall
        self._new_member_id = new_member_id
        self.outbox = Actions()

    def join(self, p: JoinParams, caller: Caller = SERVER) -> tuple[Joined, Actions, NewWorld | None]:
        """Registers a member, or re-attaches one that joined before with the
        same member id; forms the world when the spec allows.

        Returns:
            The membership, the actions, and the world the member already sits
            in (a re-attached member of a formed world), else None.

        Raises:
            Conflict: the spec, a node rank, a role or the address family
                disagrees with the job, the job has failed or ended, or a
                member id is reused with other parameters.
            AlreadyExists: the local rank or node rank is held by another worker.
            Full: the job (or the role) already has all its workers.
            LimitExceeded: the server holds its maximum of members or jobs, or
                the caller its share of jobs (shares.py).
        """
        job = self._jobs.live.get(p.job_id)
        if job is not None:
            try:
                self._check_seal(job, p, caller)  # first: a stranger learns nothing about a sealed job
                if p.member_id and p.member_id in job.members:
                    return self._reattach(job, p)
                self._check_not_ended(p)
                self._check_admissible(job, p)
                if job.spec.nodes and not caller.exempt:
                    self._check_standby(job, p, caller)
                node = job.nodes.get(p.node_key)
                if node is not None:
                    self._check_node(job, node, p)
                elif p.node_rank is not None and p.node_rank in job.node_ranks:
                    raise AlreadyExists(
                        f"node_rank {p.node_rank} is already held by node {job.node_ranks[p.node_rank]!r} "
                        f"in job {p.job_id!r}; node {p.node_key!r} cannot take it"
                    )
                self._check_room(p)
            except Refusal as exc:
                self._refused(job, p, exc)
                raise
        else:
            self._check_not_ended(p)
            check_world_size(p, 0, self._limits.max_world_size)
            self._check_room(p)
        if job is None and len(self._jobs.live) >= self._limits.max_jobs:
            raise LimitExceeded(f"this server holds its maximum of {self._limits.max_jobs} jobs (--max-jobs); "
                                f"job {p.job_id!r} cannot be created now")
        self._shares.take(WORKERS, caller, p.workers)  # the workers a caller holds, waiting or seated (--max-workers-per-caller)
        if job is None:
            try:
                for role, _ in p.roles():
                    p.spec.check_declared(p.job_id, role)
                self._shares.take(JOBS, caller)  # last: nothing to give back if it refuses
            except Exception:
                self._shares.give(WORKERS, caller, p.workers)
                raise
        now = self._clock()
        actions = Actions()
        if job is None:  # a new run of this id: an earlier one that ended stays kept, as one of its runs
            job = self._jobs.live[p.job_id] = Job(p.job_id, p.spec, p.loopback, now, self._history.next_run(p.job_id),
                                                  self._wall())
            job.seal, job.creator = p.seal, caller
            actions.writes.append(PutJob(self._history.record(job)))
        member_id = p.member_id or self._new_member_id()
        self._jobs.seq += 1
        member = add_member(job, member_id, p, self._jobs.seq)
        member.caller, member.held = caller.key, 0 if caller.exempt else p.workers
        self._jobs.members += 1
        job.last_arrival = now
        actions.writes.append(PutMember(job.job_id, member_record(member_id, member)))
        actions.notes.append(Note("join", {"job": job.job_id, "member": member_id, "node": member.node_key, "role": p.role,
                                           "joined": job.workers, "world_size": job.spec.world_size}))
        what = f"{p.workers} workers of node {p.node_key!r}" if p.workers > 1 else f"a worker of node {p.node_key!r}"
        self._history.event(job, EventKind.JOINED, f"{what}{f' (role {p.role!r})' if p.role else ''} joined; {job.count()}",
                            actions, member=member_id, node=p.node_key, role=p.role, workers=p.workers)
        if job.state is JobState.FORMED:
            waiting = job.workers - job.seated_workers
            if (job.workers == len(job.members) and not job.spec.nodes) or self._forming.grows(job):
                self._forming.change(job, f"{waiting} worker{'s' * (waiting > 1)} waiting to join can grow the world", actions)
        else:
            self._forming.maybe_form(job, actions)
        self._forming.arm_last_call(job)
        return Joined(job.job_id, member_id, self._lessor.ttl_s, job.workers), actions, None

    def _check_not_ended(self, p: JoinParams) -> None:
        """A Join re-attaching to a member of a run that ended does not enter the next run."""
        kept = self._history.ended_member(p.job_id, p.member_id) if p.member_id else None
        if kept is not None:
            raise Stale(f"member {p.member_id} belongs to run {kept.view.run} of job {p.job_id!r}, which "
                        f"{kept.view.state.value}: a worker of a run that ended cannot enter a later one; join anew "
                        f"(without its member id) to take part in the next")

    def _check_room(self, p: JoinParams) -> None:
        if self._jobs.members >= self._limits.max_members:
            raise LimitExceeded(f"this server holds its maximum of {self._limits.max_members} members (--max-members); "
                                f"node {p.node_key!r} cannot join job {p.job_id!r} now")

    def _refused(self, job: Job, p: JoinParams, exc: Refusal) -> None:
        """Counts a refused join in the job; records it in the job's history
        unless the same refusal was recorded within Refusals.QUIET_S."""
        reason = str(exc)
        held = job.refused.note(reason, self._clock())
        if held is not None:
            more = f" ({held} more like it since the last)" if held else ""
            self._history.event(job, EventKind.REFUSED, f"refused node {p.node_key!r}: {reason}{more}", self.outbox,
                                node=p.node_key, error=type(exc).__name__, held=held)

    def take_outbox(self) -> Actions:
        """What transitions that raised still implied (refusals' events), to carry out now."""
        out, self.outbox = self.outbox, Actions()
        return out

    def _reattach(self, job: Job, p: JoinParams) -> tuple[Joined, Actions, NewWorld | None]:
        member = job.members[p.member_id]
        newcomers = self._newcomers(job, member, p)
        if member.secret != p.secret:
            raise Conflict(f"member {p.member_id} of job {job.job_id!r} joined before with another member_secret; "
                           f"re-attach with the same one, or join with a new member_id")
        actions = Actions()
        if newcomers:
            self._admit_workers(job, p.member_id, member, newcomers, actions)
        joined = Joined(job.job_id, p.member_id, self._lessor.ttl_s, job.workers)
        seated = job.seated(p.member_id, member) == member.workers
        if seated and job.state in (JobState.FORMED, JobState.FORMING):
            # Seated: its Join is its word (the lease runs from now), answered with the world it sits in. A
            # world re-forming is one whose answer this member missed (a Join cut by a partition or a
            # failover): it hears the re-form on its session next, as the members answered in time did
            # (Sessions.open_session), and offers a spare port from there, as rank 0 must: its Join's port
            # serves that world's store. Holding the Join for the next world instead would wait for ever on
            # the spare of a rank 0 that never heard of its world.
            self._lessor.renew(job.job_id, p.member_id, member, attach=True)
            if job.state is JobState.FORMING:
                self._heard(job, p, member, actions)  # the next world may form, with it, now
            if job.seated(p.member_id, member) == member.workers:  # told as the world was told (previous rank, changes)
                return joined, actions, job.world(job.previous_plan)
            self._lessor.bind(member)  # (a next world formed without it: it waits for the one after)
            return joined, actions, None
        if not seated and job.in_world(p.member_id):  # a host membership's newcomers wait for the next world; its lease stays
            return joined, actions, None
        # Bound to this call again (a newcomer), which holds it until its world; withdraw gives the lease back.
        self._lessor.bind(member)
        self._heard(job, p, member, actions)
        return joined, actions, None

    def _heard(self, job: Job, p: JoinParams, member: Member, actions: Actions) -> None:
        """A re-attaching Join is its member's word: its port is a spare (unless it
        serves its world's store), and a survivor awaited before the re-form is heard
        from; a world forms, or grows, if it can now."""
        if member.port != p.port and not serves_store(job, p.member_id, p.port):
            member.port = p.port
            job.version += 1
            actions.writes.append(PutMember(job.job_id, member_record(p.member_id, member)))
        if p.member_id in job.suspects and member.port:
            job.suspects.discard(p.member_id)
        self._grow_or_form(job, actions)  # a joiner restored beside a formed world, say, grows it

    def _newcomers(self, job: Job, member: Member, p: JoinParams) -> tuple[Slot, ...]:
        """The workers a host membership's re-attaching Join adds (every worker
        it held must be listed again, alike); () for any other member.

        Raises:
            Conflict: the Join differs from the first in anything else.
        """
        same = (member.node_key, member.address, member.local_rank, member.node_rank, member.role) == (
            p.node_key, p.address, p.local_rank, p.node_rank, p.role)
        if same and job.spec == p.spec and bool(member.slots) == bool(p.slots):
            if not p.slots and member.workers == p.workers:
                return ()
            held = {s.index: s for s in member.slots}
            given = {s.index: s for s in p.slots}
            if p.slots and all(given.get(i) == s for i, s in held.items()):
                return tuple(s for s in p.slots if s.index not in held)
        raise Conflict(f"member {p.member_id} of job {job.job_id!r} joined before with other parameters")

    def _admit_workers(self, job: Job, member_id: str, member: Member, newcomers: tuple[Slot, ...], actions: Actions) -> None:
        """A host membership's newcomers join: as joiners are admitted, counted
        and, in a formed world, grow it (the membership's lease runs on).

        Raises:
            Conflict, Closed, Full: as for a Join (_check_admissible). (Their local ranks
                are the membership's to give: the Join's list was checked whole.)
        """
        node = job.nodes[member.node_key]
        p = JoinParams(job.job_id, job.spec, member.node_key, member.address, member.port, loopback=job.loopback,
                       workers=len(newcomers), slots=newcomers)
        self._check_admissible(job, p)
        member.slots += newcomers
        member.workers += len(newcomers)
        count_in(job, node, member_id, newcomers, p.roles())
        job.last_arrival = self._clock()
        actions.writes.append(PutMember(job.job_id, member_record(member_id, member)))
        self._history.event(job, EventKind.JOINED, f"{len(newcomers)} worker{'s' * (len(newcomers) > 1)} of host "
                                                   f"{member.node_key!r} joined; {job.count()}", actions,
                            member=member_id, node=member.node_key, workers=len(newcomers))
        self._grow_or_form(job, actions)

    def _grow_or_form(self, job: Job, actions: Actions) -> None:
        """Workers waiting beside a formed world that they can grow re-form it; a
        forming world forms if it can (an elastic one, after its last call)."""
        if job.state is JobState.FORMED and self._forming.grows(job):
            waiting = job.workers - job.seated_workers
            self._forming.change(job, f"{waiting} worker{'s' * (waiting > 1)} waiting to join can grow the world", actions)
        elif job.state is JobState.FORMING:
            self._forming.maybe_form(job, actions)
        self._forming.arm_last_call(job)

    def _check_seal(self, job: Job, p: JoinParams, caller: Caller) -> None:
        if job.seal and not hmac.compare_digest(job.seal, p.seal):
            self._guesses.check(caller, job.job_id)  # only guessers are slowed: a right secret always passes
            self._guesses.failed(caller, job.job_id)
            raise Sealed(f"job {job.job_id!r} is sealed: this join's job_secret is missing or wrong")
        if p.seal and not job.seal:
            raise Conflict(f"job {job.job_id!r} is not sealed, but this join carries a job_secret; "
                           f"every worker of a job passes the same one, or none")

    def _check_admissible(self, job: Job, p: JoinParams) -> None:
        if job.spec != p.spec:
            raise Conflict(f"job {job.job_id!r} has {job.spec.difference(p.spec)}")
        if job.state is JobState.CLOSED:
            raise Closed(f"job {job.job_id!r} was closed: {job.reason}; its id takes a new run once its "
                         f"{len(job.members)} member{'s' * (len(job.members) != 1)} {'are' if len(job.members) != 1 else 'is'} gone")
        if job.state is JobState.FAILED:
            raise Conflict(f"job {job.job_id!r} cannot form: {job.reason}")
        if job.state is JobState.ENDED:
            raise Conflict(f"job {job.job_id!r} has ended ({job.reason}); use another job id or wait until its members have left")
        if job.spec.nodes:  # a job of nodes: beyond its maximum, standbys wait (_check_standby)
            if job.units >= 3 * job.spec.world_size:
                raise Full(f"job {job.job_id!r} has all {job.spec.world_size} nodes and twice as many standbys; node "
                              f"{p.node_key!r} cannot join it")
        elif job.workers + p.workers > job.spec.world_size:
            if job.workers >= job.spec.world_size:
                raise Full(
                    f"job {job.job_id!r} already has all {job.spec.world_size} workers "
                    f"(generation {job.generation}); node {p.node_key!r} cannot join it"
                )
            raise Full(f"job {job.job_id!r} has {job.workers} of {job.spec.world_size} workers; node {p.node_key!r} "
                          f"cannot add {p.workers} more")
        check_world_size(p, job.workers, self._limits.max_world_size)
        for role, count in p.roles():
            job.spec.check_declared(job.job_id, role)
            declared = job.spec.role_count(role)
            held = job.role_counts.get(role, 0)
            if declared is not None and held + count > declared:
                if held >= declared:
                    raise Full(f"job {job.job_id!r} already has all {declared} workers of role {role!r}")
                raise Full(f"job {job.job_id!r} has {held} of its {declared} workers of role {role!r}; "
                              f"node {p.node_key!r} cannot add {count} more")
        if p.loopback != job.loopback:
            first = next(iter(job.nodes.values()))
            raise Conflict(
                f"job {job.job_id!r}: node {first.key!r} advertises {first.address} but this worker "
                f"(node {p.node_key!r}) advertises {p.address}; a job cannot mix loopback and "
                f"routable addresses, since peers on other hosts cannot reach a loopback address"
            )

    @staticmethod
    def _check_standby(job: Job, p: JoinParams, caller: Caller) -> None:
        """A node beyond a job's maximum waits as a standby. A caller that holds
        seats in the job (its replacements) may park as many standbys as there
        are seats; any other caller at most half as many (at least one), and
        only while the job holds fewer than as many standbys as seats: strangers
        cannot crowd out a team's own replacements (who are also seated before
        strangers' standbys, forming.py).

        Raises:
            Full: naming the caller's standbys and the cap.
        """
        seats = job.spec.world_size
        if job.units < seats:
            return
        in_world = [job.in_world(mid) for mid, m in job.members.items() if m.caller == caller.key]  # the caller's members
        seated, standbys = any(in_world), in_world.count(False)
        cap = seats if seated else max(1, seats // 2)
        if standbys >= cap or (not seated and job.units >= 2 * seats):
            raise Full(f"job {job.job_id!r} has all {seats} nodes and {job.units - seats} standbys, {standbys} of them "
                       f"{caller.shown}'s, which {'holds seats in it' if seated else 'holds no seat in it'}: at most {cap} "
                       f"(node {p.node_key!r}; {len(in_world)} members of this caller)")

    @staticmethod
    def _check_node(job: Job, node: Node, p: JoinParams) -> None:
        if p.host and node.host and p.host != node.host:  # the default key of two machines alike: hostname and machine id
            raise Conflict(f"node key {p.node_key!r} of job {job.job_id!r} arrives from two machines: a worker at "
                           f"{node.address} joined under it, and this one at {p.address} is on another machine (its "
                           f"boot id differs); give each machine its own node_key, or make their hostnames or "
                           f"/etc/machine-id differ (cloned images share one)")
        if node.agent or p.workers > 1 or p.slots:
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
        """The member's Join call ended. Unless it was seated in a world, this
        removes it; seated, its lease governs."""
        actions = Actions()
        job = self._jobs.live.get(job_id)
        member = job.members.get(member_id) if job is not None else None
        if member is None or member.lease is not Lease.IN_JOIN:
            return actions
        if job.in_world(member_id):  # seated, its call held it: its lease runs again from now
            self._lessor.release(job_id, member_id, member)
            return actions
        self._leaving.remove(job, member_id, "withdrawn", actions)
        return actions
