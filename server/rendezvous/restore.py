"""Restoring: the jobs a store held, loaded after a restart or a failover."""

from __future__ import annotations

import collections
import ipaddress
import logging
from collections.abc import Callable, Iterable

from commctx.common.planning import build_plan

from .actions import Actions
from .admission import add_member
from .forming import Forming
from .history import History
from .leases import Lessor
from .model import Job, Jobs, JobState, Limits
from .params import JoinParams, Slot
from .shares import SERVER
from .store import DeleteJob, JobRecord

log = logging.getLogger("commctx.server")


class Restoring:
    """Loading a store's records into the machine's jobs (shared): their
    members' leases restart with the lessor, the runs that ended go to the
    history, elastic jobs' last calls to forming."""

    def __init__(self, jobs: Jobs, limits: Limits, lessor: Lessor, forming: Forming, history: History,
                 clock: Callable[[], float], wall: Callable[[], float]) -> None:
        self._jobs = jobs
        self._limits = limits
        self._lessor = lessor
        self._forming = forming
        self._history = history
        self._clock = clock
        self._wall = wall

    def restore(self, records: Iterable[JobRecord], grace_s: float) -> tuple[int, Actions]:
        """Loads the jobs a store held after a restart.

        Every lease restarts with `grace_s` to spare (one TTL: a live member
        renews every third of it, and backs off at most that long between
        tries); forming members must re-attach (retry their Join) within it.
        Longer would only keep the members that died before the restart
        seated, and their worlds waiting, for longer. Survivors of a world that
        was re-forming are awaited until they renew (their sessions reconnect)
        or expire.

        Returns:
            How many jobs were restored, and actions (jobs found empty are deleted).
        """
        now, wall = self._clock(), self._wall()
        actions = Actions()
        for record in records:
            spec = record.spec
            job = Job(record.job_id, spec, False, now, record.run, record.started)
            job.state, job.generation, job.reason = JobState(record.state), record.generation, record.reason
            job.seal, job.creator = record.seal, SERVER  # who created it is not stored: it counts against nobody's share
            job.events = collections.deque(record.events, maxlen=self._limits.max_events_per_job)
            if record.since:  # AGE goes on from when it began, not from the restart
                job.forming_since = now - max(0.0, wall - record.since)
            if record.world is not None:
                job.plan = build_plan(record.world, spec.at_size(record.world.world_size))
            for mr in record.members:
                p = JoinParams(job.job_id, spec, mr.node_key, mr.address, mr.port, mr.local_rank, mr.node_rank, False, mr.role,
                               mr.member_id, mr.secret, "", mr.workers, tuple(Slot(*s) for s in mr.slots))
                m = add_member(job, mr.member_id, p, mr.seq)
                self._jobs.members += 1
                job.seated_workers += job.seated(mr.member_id, m)
                self._lessor.grant(job.job_id, mr.member_id, m, now + grace_s)
                self._jobs.seq = max(self._jobs.seq, mr.seq)
            if job.plan is not None:
                job.seat_hosts(mid for mid, m in job.members.items() if m.slots)
            if not job.members:
                if "#" in record.job_id:  # a run that ended (history.py)
                    self._history.restore_run(record, job, wall, actions)
                else:
                    actions.writes.append(DeleteJob(job.job_id))
                continue
            if job.state is JobState.FORMING and job.generation > 0:
                job.suspects, job.announced = set(job.survivors()), True
            job.loopback = ipaddress.ip_address(next(iter(job.members.values())).address).is_loopback
            self._jobs.live[job.job_id] = job
            self._forming.arm_last_call(job)
        return len(self._jobs.live), actions
