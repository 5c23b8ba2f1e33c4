"""A job's history: the events the state machine records as it goes, kept
in the job (the last --max-events-per-job), persisted with the transition's
writes and published to the job's watches (watching.py) once durable; and the
runs that ended.

Runs. A job id names one run at a time. When the last member of a run is gone
the run has ended, however it went (finished, failed, closed): it is kept,
described as it ended (who took part, its reason, its events), for
--retain-ended-s and among the last --retain-ended-jobs ended runs, under the
store key '<job id>#<run>' ('#' is not in job ids). The next Join of the id
starts run n + 1, as c10d's rendezvous starts afresh for a reused run id; no
member of the old run is in it, so none of their secrets or generations
serve there. Pure: no asyncio, no grpc."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import NamedTuple

from commctx.common.planning import elide

from ..errors import NotFound
from .actions import Actions
from .deadlines import Deadline, Deadlines
from .model import EventKind, Job, JobEvent, Jobs, JobState, Limits, member_of
from .reports import JobView, NodeView
from .store import DeleteJob, JobRecord, PutEvent, PutJob, TrimEvents


class Kept(NamedTuple):
    """A run that ended, as it is kept."""

    view: JobView  # as it ended: who took part (its last world's nodes), state and reason
    until: float  # the machine's clock when it is forgotten
    events: tuple[JobEvent, ...]
    members: frozenset[str] = frozenset()  # the member ids of its last world: none of them enters a later run


def run_key(job_id: str, run: int) -> str:
    """The store key of an ended run."""
    return f"{job_id}#{run}"


def seated(job: Job) -> frozenset[str]:
    """The member ids seated in the job's last world (a host membership's workers by their member's id)."""
    if job.plan is None:
        return frozenset()
    return frozenset(member_of(wid) for node in job.plan.seats.nodes for wid in node.members)


def ended_view(job: Job, ended_at: float) -> JobView:
    """A run whose last member is gone, as it is kept: its last world's nodes and workers took part."""
    seats = job.plan.seats if job.plan is not None else None
    nodes = tuple(NodeView(n.node_key, n.address, len(n.members), rank, (), (n.address,))
                  for rank, n in enumerate(seats.nodes)) if seats is not None else ()
    state, reason = job.state, job.reason
    if not state.over:  # its members withdrew or left without a verdict (nothing formed, or the job of nodes ran out)
        state, reason = JobState.ENDED, reason or "its members left"
    took_part = sum(n.workers for n in nodes)  # `joined` of a run that ended: the workers of its last world
    return JobView(job.job_id, state, job.generation, job.spec, took_part, 0, nodes, reason, 0.0, len(nodes), seal=job.seal,
                   refused=job.refused.count, last_refused=job.refused.last, run=job.run, started_at=job.started,
                   ended_at=ended_at)


class History:
    """Appending to a job's history; the runs that ended, and finding a job's
    run by id. Its state: the machine's jobs (shared, read), the limits, the
    clocks, and the runs that ended, kept until their deadlines (a heap)."""

    JOIN_COALESCE_S = 1.0  # joins within this long of a job's "joined" event are counted in it

    def __init__(self, jobs: Jobs, limits: Limits, clock: Callable[[], float], wall: Callable[[], float]) -> None:
        self._jobs = jobs
        self._limits = limits
        self._clock = clock
        self._wall = wall  # persisted times (AGE, how long a failed job is kept) survive a restart on it
        # Runs that ended, oldest first, and the kept run numbers of each job id, ascending.
        self._ended: dict[tuple[str, int], Kept] = {}
        self._runs: dict[str, list[int]] = {}
        self._tombstones = Deadlines()  # (job id, run) of ended runs

    def record(self, job: Job, retained_until: float = 0.0) -> JobRecord:
        """The job as the store keeps it (`retained_until`: an ended run's end, on the wall clock)."""
        since = self._wall() - (self._clock() - job.forming_since)
        return JobRecord(job.job_id, job.spec, job.state.value, job.generation, job.reason,
                         job.plan.seats if job.plan is not None else None, (), job.seal, since, retained_until, (),
                         job.run, job.started)

    def find(self, job_id: str) -> Job:
        """The id's run under way.

        Raises:
            NotFound: none; naming the run that ended, if one is kept.
        """
        job = self._jobs.live.get(job_id)
        if job is None:
            kept = self.kept(job_id)
            if kept is not None:  # a member of a run that ended: nothing of it serves in the next
                why = "" if kept.view.seal else f" ({kept.view.reason})"  # a sealed job's reason is for its workers
                raise NotFound(f"job {elide(job_id)} has no run under way: run {kept.view.run} {kept.view.state.value}"
                               f"{why}; a Join starts run {kept.view.run + 1}")
            raise NotFound(f"no job {elide(job_id)} on this server")
        return job

    def event(self, job: Job, kind: EventKind, message: str, actions: Actions, **fields: object) -> None:
        """Appends an event to the job's history (the last max_events_per_job are kept):
        persisted with the transition's writes, then published to its watchers.

        Refusals go apart, into a sample of their own (the last Refusals.KEPT,
        in memory only, never persisted), so that no storm of refused joins,
        a stranger's or a typo's, evicts the job's life: joined, formed,
        reforming, lost, left, failed, ended."""
        now = self._wall()
        events = job.events
        if events.maxlen != self._limits.max_events_per_job:
            job.events = events = collections.deque(events, maxlen=self._limits.max_events_per_job)
        seq = max(events[-1].seq if events else 0, job.refused.events[-1].seq if job.refused.events else 0) + 1
        if kind is EventKind.REFUSED:
            event = JobEvent(seq, now, kind.value, job.generation, message, fields)
            job.refused.events.append(event)
            actions.events.append((job.job_id, event))
            return
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
            event = JobEvent(seq, now, kind.value, job.generation, message, fields)
            first = events[0].seq if len(events) == events.maxlen else None
            events.append(event)
            if first is not None and first // 64 != events[0].seq // 64:  # the store forgets the dropped now and then
                actions.writes.append(TrimEvents(job.job_id, events[0].seq))
        actions.writes.append(PutEvent(job.job_id, event))
        actions.events.append((job.job_id, event))

    # -- runs that ended ------------------------------------------------------------------

    def next_run(self, job_id: str) -> int:
        runs = self._runs.get(job_id)
        return runs[-1] + 1 if runs else 1

    def end_run(self, job: Job, actions: Actions) -> None:
        """The job's last member is gone: its run has ended. Kept unless nothing
        ever formed and nothing went wrong (every member withdrew its Join)."""
        actions.writes.append(DeleteJob(job.job_id))
        actions.events.append((job.job_id, None))  # the live run is gone: its watches end
        if job.generation == 0 and not job.state.over:
            return
        ended = self._wall()
        view = ended_view(job, ended)
        self._keep(view, self._clock() + self._limits.retain_ended_s, tuple(job.events), actions, seated(job))
        key = run_key(job.job_id, job.run)
        record = self.record(job, ended + self._limits.retain_ended_s)
        actions.writes.append(PutJob(record._replace(job_id=key, state=view.state.value, reason=view.reason, ended=ended)))
        actions.writes.extend(PutEvent(key, e) for e in job.events)

    def _keep(self, view: JobView, until: float, events: Iterable[JobEvent], actions: Actions,
              members: frozenset[str] = frozenset()) -> None:
        """Keeps an ended run until `until`, among the last retain_ended_jobs (the oldest go first, from the store too)."""
        self._ended[(view.job_id, view.run)] = Kept(view, until, tuple(events), members)
        runs = self._runs.setdefault(view.job_id, [])
        runs.append(view.run)
        runs.sort()
        self._tombstones.push(until, (view.job_id, view.run))
        while len(self._ended) > self._limits.retain_ended_jobs:
            self._forget(next(iter(self._ended)), actions)

    def _forget(self, run: tuple[str, int], actions: Actions) -> None:
        del self._ended[run]
        runs = self._runs[run[0]]
        runs.remove(run[1])
        if not runs:
            del self._runs[run[0]]
        actions.writes.append(DeleteJob(run_key(*run)))

    def next_deadline(self) -> Deadline | None:
        """When the next kept run may be forgotten (None: none is kept)."""
        return self._tombstones.next()

    def forget_due(self, now: float, actions: Actions) -> None:
        """Forgets the runs kept long enough by `now`."""
        while (entry := self._tombstones.pop_due(now)) is not None:
            kept = self._ended.get(entry[1])
            if kept is not None and kept.until <= now:
                self._forget(entry[1], actions)

    def restore_run(self, record: JobRecord, job: Job, wall: float, actions: Actions) -> None:
        """Keeps an ended run a store held (its key '<job id>#<run>'), or forgets it if its time is up."""
        if record.retained_until <= wall:
            actions.writes.append(DeleteJob(record.job_id))
            return
        job.job_id, _, run = record.job_id.rpartition("#")
        job.run = int(run) if run.isdigit() else 0
        view = ended_view(job, record.ended)
        self._keep(view, self._clock() + record.retained_until - wall, record.events, actions, seated(job))

    def ended_member(self, job_id: str, member_id: str) -> Kept | None:
        """The kept run of the id whose last world held `member_id`, if any."""
        return next((k for r in self._runs.get(job_id, ()) if member_id in (k := self._ended[(job_id, r)]).members), None)

    def kept(self, job_id: str, run: int = 0) -> Kept | None:
        """Run `run` of the id if it ended and is kept (0: the latest kept)."""
        runs = self._runs.get(job_id)
        if not runs:
            return None
        return self._ended.get((job_id, run or runs[-1]))

    def other_runs(self, job_id: str, run: int) -> tuple[int, ...]:
        """The runs of the id besides `run`, the live one and those kept, newest first."""
        live = self._jobs.live.get(job_id)
        return ((live.run,) if live is not None and live.run != run else ()) + tuple(
            r for r in reversed(self._runs.get(job_id, ())) if r != run)

    def run_of(self, job_id: str, run: int = 0) -> tuple[Job | None, Kept | None]:
        """The live run of the id (run 0 or its number), else the kept one.

        Raises:
            NotFound: no such job, or no such run of it.
        """
        job = self._jobs.live.get(job_id)
        if job is not None and run in (0, job.run):
            return job, None
        kept = self.kept(job_id, run)
        if kept is None:
            if run and (job is not None or job_id in self._runs):
                raise NotFound(f"job {elide(job_id)} has no run {run} kept on this server (runs: "
                               f"{', '.join(map(str, self.other_runs(job_id, 0))) or 'none'})")
            raise NotFound(f"no job {elide(job_id)} on this server")
        return None, kept

    def ended(self) -> list[tuple[str, int]]:
        """The (job id, run) of every kept run that ended, oldest first."""
        return list(self._ended)

    def has_runs(self, job_id: str) -> bool:
        """Whether a run of the id that ended is kept."""
        return job_id in self._runs

    def job_ids(self) -> set[str]:
        """The ids of the kept runs that ended."""
        return set(self._runs)
