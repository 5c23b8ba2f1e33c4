"""The rendezvous state machine: synchronous transitions over the in-memory
model, each returning the `Actions` it implies (records to persist, events to
push to sessions, Join waiters to wake, notes for operators). The executor
carries them out in that order; no transition awaits or does I/O.

A job's life, generation by generation:

  FORMING (g)  members join; the world forms as generation g+1 when the spec
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
awaited until they renew or expire. When a host dies, its members' leases run
out one by one; the first expiry finds the others already stale, so the next
world forms without them rather than seating the dead. With nobody awaited
the world forms at once and each survivor gets one message, its new
assignment; otherwise survivors are told at once (Reforming) and get the
assignment when it forms. Survivors keep their node and local ranks where the
new shape allows (the rank rule in planning/world.py).

A member is bound to its Join call until it is seated in a world (ending the
call withdraws it); seated, it holds a lease that its session renews. Expiry
and leaving are the same transition. A job disappears when its last member
goes. Leases, last calls and kept failed jobs wait in deadline heaps; the
reaper pops only what is due.

The machine is parts that own their state, composed as etcd's lessor and
torch's rendezvous state with its actions are: the lessor (leases.py) keeps
every lease and returns those that ran out; deciders take a job and return
the `Actions` it implies: joining (admission.py), forming (forming.py),
leaving (leaving.py), sessions and renewals (sessions.py); the history
(history.py) records events and keeps the runs that ended; views.py answers
questions and restore.py loads a store's records. `Rendezvous` owns the jobs
(model.Jobs, which the parts share) and wires the parts together.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable

from commctx.common.planning import PlanError, WorldPlan

from .actions import Actions
from .admission import Admission
from .deadlines import Deadline, earliest
from .forming import Forming, plan_or_error
from .history import History
from .leases import Lessor
from .leaving import Leaving
from .model import (
    DISCONNECTED,
    EventKind,
    Job,
    JobEvent,
    Jobs,
    Joined,
    Lease,
    Limits,
    Member,
    NewWorld,
    PlanRequest,
    SessionEvent,
)
from .params import JoinParams
from .reports import JobView, Stats, WorkerView
from .restore import Restoring
from .sessions import Sessions
from .shares import SERVER, Caller, Guesses, Shares
from .store import JobRecord
from .views import Views

__all__ = ["Actions", "Rendezvous", "plan_or_error"]

log = logging.getLogger("commctx.server")


class Rendezvous:
    """Every job the server holds, and the rules for joining and leaving them:
    it owns the jobs and wires the parts that decide (see the module's
    docstring), and is the one object the RPC edge, the executor and the
    dashboard call.

    Every method runs to completion synchronously; those that change state
    return `Actions`. The clock is injected.
    """

    # Worlds of more workers are planned off the event loop (a big plan is
    # tens of milliseconds of Python); smaller ones inside the transition.
    PLAN_INLINE_MAX = 2048

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
        # The server is stopping: Joins are refused, and sessions that end are not departures.
        self.draining = False
        self._clock = clock
        self._state = Jobs()
        self._jobs = self._state.live  # the jobs, by id (tests read them)
        self.lessor = Lessor(lease_ttl_s, self.reconnect_grace_s, clock, self._holder)  # every member's lease
        self._history = History(self._state, limits, clock, wall)
        self._forming = Forming(self._state, self.lessor, self._history, clock, plan_inline_max)
        self._leaving = Leaving(self._state, self.shares, self._forming, self._history)
        self._sessions = Sessions(self._state, self.lessor, self._leaving, self._forming, self._history)
        self._admission = Admission(self._state, limits, self.shares, self.guesses, self.lessor, self._forming,
                                    self._leaving, self._history, clock, wall,
                                    new_member_id or (lambda: os.urandom(8).hex()))
        self._restoring = Restoring(self._state, limits, self.lessor, self._forming, self._history, clock, wall)
        self._views = Views(self._state, self.lessor, self._forming, self._history, self.guesses, clock)

    def _holder(self, job_id: str, member_id: str) -> Member | None:
        """The member a lease is for (None: gone), for the lessor."""
        job = self._jobs.get(job_id)
        return job.members.get(member_id) if job is not None else None

    def now(self) -> float:
        """The injected clock: what deadlines are measured on."""
        return self._clock()

    @property
    def widest_world(self) -> int:
        """The most workers of a world formed here: its first leases are the longest."""
        return self.lessor.widest_world

    # -- joining (admission.py) -------------------------------------------------------------

    def join(self, p: JoinParams, caller: Caller = SERVER) -> tuple[Joined, Actions, NewWorld | None]:
        """Admission.join: registers (or re-attaches) a member; forms the world when the spec allows."""
        return self._admission.join(p, caller)

    def withdraw(self, job_id: str, member_id: str) -> Actions:
        """The member's Join call ended: removed unless it was seated (Admission.withdraw)."""
        return self._admission.withdraw(job_id, member_id)

    def answered(self, job_id: str, member_id: str) -> None:
        """The member's Join is answered its world now: a first lease runs at least a TTL from
        here (the world may have formed a while before the answer could leave)."""
        job = self._jobs.get(job_id)
        member = job.members.get(member_id) if job is not None else None
        if member is not None:
            self.lessor.answered(member)

    @property
    def has_outbox(self) -> bool:
        return bool(self._admission.outbox)

    def take_outbox(self) -> Actions:
        """What transitions that raised still implied (refusals' events), to carry out now."""
        return self._admission.take_outbox()

    # -- sessions, renewals and leaving (sessions.py, leaving.py) ---------------------------

    def naming_wait_s(self, open_streams: int) -> float:
        """How long a new session stream may take to name its member (Lessor.naming_wait_s)."""
        return self.lessor.naming_wait_s(open_streams)

    def open_session(self, job_id: str, member_id: str, generation: int, sink: object,
                     spare_port: int = 0, secret: str | None = None) -> tuple[float, list[SessionEvent], Actions]:
        """Sessions.open_session: attaches a session sink to a member and renews its lease."""
        return self._sessions.open_session(job_id, member_id, generation, sink, spare_port, secret)

    def end_session(self, job_id: str, member_id: str, sink: object, how: str) -> tuple[str, Actions]:
        """The session of `sink` ended `how`: "finished" or "cancelled" by its
        client (a departure, as close_session says), "replaced" by a newer one, or
        "server" (this server ended it). While the server drains, every end is the
        server's. Returns how it counts, and close_session's actions."""
        how = "server" if self.draining else how
        return how, self.close_session(job_id, member_id, sink, how in ("finished", "cancelled"))

    def close_session(self, job_id: str, member_id: str, sink: object, departed: bool = False) -> Actions:
        """Sessions.close_session: the session of `sink` ended (`departed`: its client ended it without a Leave)."""
        return self._sessions.close_session(job_id, member_id, sink, departed)

    def renew(self, job_id: str, member_id: str, generation: int, spare_port: int = 0) -> tuple[int, Actions]:
        """Sessions.renew: renews a member's lease; records a spare port it offers."""
        return self._sessions.renew(job_id, member_id, generation, spare_port)

    def keep_alive(self, job_id: str, member_id: str, generation: int,
                   secret: str | None = None) -> tuple[float, int, Actions]:
        """Sessions.keep_alive: renews a member's lease (the unary form), given its secret."""
        return self._sessions.keep_alive(job_id, member_id, generation, secret)

    def report_failure(self, job_id: str, member_id: str, generation: int) -> Actions:
        """Sessions.report_failure: a member's collectives in `generation` failed."""
        return self._sessions.report_failure(job_id, member_id, generation)

    def restart(self, job_id: str, member_id: str, generation: int) -> Actions:
        """Sessions.restart: a member's launcher restarts its workers; the world re-forms."""
        return self._sessions.restart(job_id, member_id, generation)

    def remove_workers(self, job_id: str, member_id: str, indexes: Iterable[int], why: str) -> Actions:
        """Leaving.remove_workers: workers of a host membership are gone.

        Raises:
            NotFound: unknown job or member.
        """
        job = self._history.find(job_id)
        return self._leaving.remove_workers(job, member_id, job.member(member_id), indexes, why)

    def leave(self, job_id: str, member_id: str, secret: str | None = None, job_secret: str | None = None,
              caller: Caller = SERVER, close: bool = False) -> Actions:
        """Removes a member, given its secret and, for a sealed job, the job's
        (None: not checked). With `close`, first closes the job for everyone
        (Leaving.leave).

        Raises:
            Sealed: the job is sealed and `job_secret` does not open it.
            NotFound: unknown job or member, or not its secret.
        """
        job = self._history.find(job_id)
        self.guesses.unseal(job_id, job.seal, job_secret, caller, "this leave's job_secret is missing or wrong")
        return self._leaving.leave(job, member_id, job.member(member_id, secret), caller, close)

    # -- deadlines ----------------------------------------------------------------------------

    def next_deadline(self) -> Deadline | None:
        """The earliest time (on the injected clock) at which `expire_due` may have work (None: nothing waits)."""
        return earliest(self.lessor.next(), self._forming.next_deadline(), self._history.next_deadline())

    def stalled(self, for_s: float) -> None:
        """The event loop stalled for `for_s` seconds: time it could not hear does
        not count against leases (Lessor.deaf)."""
        self.lessor.deaf(self._clock(), for_s)

    def expire_due(self, limit: int = 1000) -> tuple[Actions, bool]:
        """Removes members whose lease ran out (at most `limit` a call, so that
        an expiry storm yields the event loop between calls: Lessor.expired),
        forms elastic worlds whose last call has passed, and forgets runs kept
        long enough.

        Returns:
            The actions, and whether more is due already.
        """
        now = self._clock()
        actions = Actions()
        for job_id, member_id, lease in self.lessor.expired(now, limit):
            self._leaving.remove(self._jobs[job_id], member_id, DISCONNECTED if lease is Lease.DETACHED else "expired",
                                 actions)
        self._forming.last_calls_due(now, actions)
        self._history.forget_due(now, actions)
        due = self.next_deadline()
        return actions, due is not None and due <= now

    # -- worlds (forming.py) -------------------------------------------------------------------

    def plan_wanted(self, request: PlanRequest) -> bool:
        """Whether the plan of `request` would still be used (Forming.plan_wanted)."""
        return self._forming.plan_wanted(request)

    def planned(self, request: PlanRequest, plan: WorldPlan | PlanError) -> Actions:
        """Forming.planned: the plan of `request`, computed off the event loop, is ready."""
        return self._forming.planned(request, plan)

    def hold_worlds(self, why: str | None) -> Actions:
        """Forming.hold_worlds: while `why` is set (the store refuses writes), no world forms."""
        return self._forming.hold_worlds(why)

    def restore(self, records: Iterable[JobRecord], grace_s: float) -> tuple[int, Actions]:
        """Restoring.restore: loads the jobs a store held after a restart."""
        return self._restoring.restore(records, grace_s)

    # -- views (views.py) ----------------------------------------------------------------------

    def live(self, job_id: str) -> bool:
        """Whether a run of the id is under way (not only kept after it ended)."""
        return self._views.live(job_id)

    def world_of(self, job_id: str) -> NewWorld | None:
        """The job's current world, if it has formed."""
        return self._views.world_of(job_id)

    def describe(self, job_id: str, secret: str | None = None, first_node: int = 0, max_nodes: int | None = None,
                 caller: Caller = SERVER, run: int = 0) -> JobView:
        """Views.describe: the job as DescribeJob reports it."""
        return self._views.describe(job_id, secret, first_node, max_nodes, caller, run)

    def workers(self, job_id: str, node_keys: Iterable[str]) -> dict[str, list[WorkerView]]:
        """Views.workers: the workers on the given nodes of a held job, by local rank."""
        return self._views.workers(job_id, node_keys)

    def plan_of(self, job_id: str) -> WorldPlan | None:
        """The job's current world (while re-forming: the one being replaced), if any."""
        return self._views.plan_of(job_id)

    def job_ids(self, ended: bool = False) -> list[str]:
        """Jobs with a run under way (`ended`: or a kept run that ended), sorted."""
        return self._views.job_ids(ended)

    def job_page(self, after: str, size: int, ended: bool = False) -> tuple[list[JobView], bool]:
        """Views.job_page: up to `size` jobs after `after`, and whether more follow."""
        return self._views.job_page(after, size, ended)

    def stats(self) -> Stats:
        """Counts for metrics (linear in the number of jobs, not members)."""
        return self._views.stats()

    def other_runs(self, job_id: str, run: int) -> tuple[int, ...]:
        """The runs of the id besides `run`, the live one and those kept, newest first."""
        return self._history.other_runs(job_id, run)

    def last_event(self, job_id: str) -> JobEvent | None:
        """The job's latest event (None: none, or an unknown job)."""
        return self._views.last_event(job_id)

    def events(self, job_id: str, after: int = 0, limit: int | None = None, secret: str | None = None,
               caller: Caller = SERVER, run: int = 0) -> list[JobEvent]:
        """Views.events: the job's kept events of seq above `after` (at most `limit`)."""
        return self._views.events(job_id, after, limit, secret, caller, run)

    # -- names tests outside this package use -------------------------------------------------

    @property
    def _outbox(self) -> Actions:
        """The admission's outbox (tests/test_dashboard.py records a refusal in it)."""
        return self._admission.outbox

    def _event(self, job: Job, kind: EventKind, message: str, actions: Actions, **fields: object) -> None:
        """History.event (tests/test_dashboard.py records an event with it)."""
        self._history.event(job, kind, message, actions, **fields)
