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
assignment; otherwise survivors are told at once (Reforming) and get the
assignment when it forms. Survivors keep their node and local ranks where the
new shape allows (the rank rule in planning/world.py).

A worker is bound to its Join call until it is placed in a world (ending the
call withdraws it); placed, it holds a lease that its session renews. Expiry
and leaving are the same transition. A job disappears when its last member
goes. Leases, last calls and kept failed jobs wait in deadline heaps; the
reaper pops only what is due.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from commctx.common.planning import elide

from ..errors import NotFound
from .actions import Actions
from .admission import Admission
from .deadlines import Deadlines
from .forming import Forming, plan_or_error
from .history import Kept, Recording
from .leases import Leases
from .model import Job, Limits, Member
from .params import secret_matches
from .restore import Restoring
from .shares import Guesses, Shares
from .store import JobRecord
from .views import Views

__all__ = ["Actions", "Rendezvous", "plan_or_error"]

log = logging.getLogger("commctx.server")


class Rendezvous(Admission, Forming, Leases, Restoring, Views, Recording):
    """Every job the server holds, and the rules for joining and leaving them:
    one object, its concerns one per module (admission.py, forming.py,
    leases.py, restore.py, views.py, history.py).

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
        self.widest_world = 0  # the most workers of a world formed here: its first leases are the longest
        # The server is stopping: Joins are refused, and sessions that end are not departures.
        self.draining = False
        self.plan_inline_max = plan_inline_max
        self._clock = clock
        self._wall = wall  # persisted times (AGE, how long a failed job is kept) survive a restart on it
        self._new_member_id = new_member_id or (lambda: os.urandom(8).hex())
        self._jobs: dict[str, Job] = {}
        self._held: str | None = None  # why no world may form now (the store refuses writes), or None
        self._seq = 0
        # Runs that ended (history.py), oldest first, and the kept run numbers of each job id, ascending.
        self._ended: dict[tuple[str, int], Kept] = {}
        self._runs: dict[str, list[int]] = {}
        # What a transition that raised still implies (a refused join's event):
        # the executor takes it with the next actions it is given (take_outbox).
        self._outbox = Actions()
        self._leases = Deadlines()  # (job id, member id)
        self._last_calls = Deadlines()  # job id
        self._tombstones = Deadlines()  # (job id, run) of ended runs

    def now(self) -> float:
        """The injected clock: what deadlines are measured on."""
        return self._clock()

    def _job(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            kept = self._kept(job_id)
            if kept is not None:  # a member of a run that ended: nothing of it serves in the next
                why = "" if kept.view.seal else f" ({kept.view.reason})"  # a sealed job's reason is for its workers
                raise NotFound(f"job {elide(job_id)} has no run under way: run {kept.view.run} {kept.view.state.value}"
                               f"{why}; a Join starts run {kept.view.run + 1}")
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
                         job.plan.seating if job.plan is not None else None, (), job.seal, since, retained_until, (),
                         job.run, job.started)
