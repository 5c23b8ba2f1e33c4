"""Views: what the machine answers about its jobs (DescribeJob, ListJobs,
ListEvents, the dashboard, metrics), built from its state without changing it."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable

from commctx.common.planning import WorldPlan, elide

from ..errors import NotFound
from .forming import Forming
from .history import History
from .leases import Lessor
from .model import Job, JobEvent, Jobs, JobState, NewWorld, worker_id
from .reports import JobView, NodeView, Stats, WorkerView
from .shares import SERVER, Caller, Guesses

log = logging.getLogger("commctx.server")

# Pages, as gRPC and HTTP serve them: jobs and events per page; nodes per description.
PAGE_SIZE, MAX_PAGE_SIZE = 100, 1000
NODE_PAGE_SIZE, MAX_NODE_PAGE_SIZE = 1000, 10_000


def page_key(view: JobView) -> str:
    """A ListJobs page token naming the run `view` ends a page with: '<job id>#<run>'."""
    return f"{view.job_id}#{view.run}"


def page_entry(token: str) -> tuple[str, int]:
    """A page_key as job_page orders runs ('<id>' alone: after the id's runs)."""
    job_id, _, run = token.rpartition("#")
    return (job_id, -int(run)) if job_id and run.isdigit() else (token, 1)


class Views:
    """Describing jobs, their nodes, workers and events, and the server's
    counts. It reads the machine's jobs (shared), kept runs (the history),
    leases (the lessor) and whether worlds are held (forming); it changes
    nothing but the wrong-secret counts of callers (`guesses`)."""

    def __init__(self, jobs: Jobs, lessor: Lessor, forming: Forming, history: History, guesses: Guesses,
                 clock: Callable[[], float]) -> None:
        self._jobs = jobs
        self._lessor = lessor
        self._forming = forming
        self._history = history
        self._guesses = guesses
        self._clock = clock

    def live(self, job_id: str) -> bool:
        """Whether a run of the id is under way (not only kept after it ended)."""
        return job_id in self._jobs.live

    def world_of(self, job_id: str) -> NewWorld | None:
        """The job's current world, if it has formed."""
        job = self._jobs.live.get(job_id)
        if job is None or job.state is not JobState.FORMED:
            return None
        return job.world()

    def describe(self, job_id: str, secret: str | None = None, first_node: int = 0, max_nodes: int | None = None,
                 caller: Caller = SERVER, run: int = 0) -> JobView:
        """The job as DescribeJob reports it, with nodes [first_node, first_node
        + max_nodes) of its order; for a sealed job, given its secret (None: not
        checked, for operators and the server itself). `run`: 0 the live run of
        the id, else the latest kept; or that run. Costs what _node_page does.

        Raises:
            NotFound: an unknown job or run.
            Sealed: the job is sealed and `secret` does not open it.
        """
        job, kept = self._history.run_of(job_id, run)
        view = self._view(job, first_node, max_nodes) if job is not None else kept.view
        self._guesses.unseal(job_id, view.seal, secret, caller, "give its job_secret to describe it")
        if job is None and (first_node or max_nodes is not None):
            view = dataclasses.replace(view, nodes=view.nodes[first_node:None if max_nodes is None else first_node + max_nodes])
        return dataclasses.replace(view, other_runs=self._history.other_runs(job_id, view.run))

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
            nodes.append(NodeView(k, node.address, node.workers, rank, tuple(sorted((r, c) for r, c in node.roles.items() if c)),
                                  node.addresses))
        if job.state.over:
            reason = job.reason
        elif formed:
            reason = ""
        elif job.suspects:
            reason = (f"re-forming ({job.reason}): {len(job.suspects)} survivors not heard from since the change are "
                      f"awaited; {job.shortfall()}")
        else:
            reason = f"waiting: {job.shortfall()}"
        held = self._forming.held
        if held is not None and job.state is JobState.FORMING:
            reason = f"held: the server cannot write its state ({held}); worlds form once a write succeeds; {reason}"
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
            waiting=job.workers - job.seated_workers if formed else 0,
            not_ready=len(job.suspects),
            seal=job.seal,
            refused=job.refused.count,
            last_refused=job.refused.last,
            run=job.run,
            started_at=job.started,
        )

    def workers(self, job_id: str, node_keys: Iterable[str]) -> dict[str, list[WorkerView]]:
        """The workers on the given nodes of a held job (a failed one kept has
        none), by local rank: linear in the job's members.

        Raises:
            NotFound: an unknown job.
        """
        job = self._jobs.live.get(job_id)
        if job is None:
            if self._history.has_runs(job_id):
                return {k: [] for k in node_keys}
            raise NotFound(f"no job {elide(job_id)} on this server")
        out: dict[str, list[WorkerView]] = {k: [] for k in node_keys}
        now, plan = self._clock(), job.plan
        for mid, m in job.members.items():
            seats = out.get(m.node_key)
            if seats is None:
                continue
            age = self._lessor.age(m, now)
            if m.slots:  # a host membership: each worker its own role, and local rank if its launcher fixed one
                held = [(worker_id(mid, s.index), s.role, s.local_rank) for s in m.slots]
            else:
                held = [(worker_id(mid, i), m.role, i if m.workers > 1 else m.local_rank) for i in range(m.workers)]
            for wid, role, fixed in held:
                p = plan.seat_of(wid) if plan is not None else None
                local = p.local_rank if p is not None else fixed
                seats.append(WorkerView(wid, local, p.rank if p is not None else None, role, m.lease.value, age))
        for seats in out.values():
            seats.sort(key=lambda w: (w.local_rank is None, w.local_rank or 0))
        return out

    def plan_of(self, job_id: str) -> WorldPlan | None:
        """The job's current world (while re-forming: the one being replaced), if any."""
        job = self._jobs.live.get(job_id)
        return job.plan if job is not None else None

    def job_ids(self, ended: bool = False) -> list[str]:
        """Jobs with a run under way (`ended`: or a kept run that ended), sorted."""
        return sorted({*self._jobs.live, *self._history.job_ids()}) if ended else sorted(self._jobs.live)

    def job_page(self, after: str, size: int, ended: bool = False) -> tuple[list[JobView], bool]:
        """Up to `size` jobs (their views without nodes) after `after` ("": from
        the first), and whether more follow: each id's live run;
        with `ended`, every kept run that ended too, after the live one, newest
        first (`after`: the last entry's page_key)."""
        if not ended:
            ids = self.job_ids()
            start = bisect.bisect_right(ids, after) if after else 0
            return [self.describe(j, max_nodes=0) for j in ids[start:start + size]], start + size < len(ids)
        entries = sorted([*((j, -job.run) for j, job in self._jobs.live.items()), *((j, -r) for j, r in self._history.ended())])
        start = bisect.bisect_right(entries, page_entry(after)) if after else 0
        return [self.describe(j, max_nodes=0, run=-r) for j, r in entries[start:start + size]], start + size < len(entries)

    def stats(self) -> Stats:
        """Counts for metrics (linear in the number of jobs, not members)."""
        members = waiting = 0
        for job in self._jobs.live.values():
            members += job.workers  # workers, as `waiting`: a node membership counts its workers
            waiting += job.workers - job.seated_workers
        oldest = self._lessor.oldest()
        age = 0.0 if oldest is None else max(0.0, self._clock() - (oldest - self._lessor.ttl_s))
        return Stats(len(self._jobs.live), members, waiting, age)

    def last_event(self, job_id: str) -> JobEvent | None:
        """The job's latest event (None: none, or an unknown job)."""
        job = self._jobs.live.get(job_id)
        kept = self._history.kept(job_id) if job is None else None
        history = job.events if job is not None else kept.events if kept is not None else ()
        last = history[-1] if history else None
        refused = job.refused.events[-1] if job is not None and job.refused.events else None
        return refused if refused is not None and (last is None or refused.seq > last.seq) else last

    def events(self, job_id: str, after: int = 0, limit: int | None = None, secret: str | None = None,
               caller: Caller = SERVER, run: int = 0) -> list[JobEvent]:
        """The job's kept events of seq above `after` (at most `limit`), of its
        live run or a kept one (`run`: 0 the live one, else the latest kept);
        for a sealed job, given its secret (None: not checked).

        Raises:
            NotFound: an unknown job or run.
            Sealed: the job is sealed and `secret` does not open it.
        """
        job, kept = self._history.run_of(job_id, run)
        seal, history = (job.seal, job.events) if job is not None else (kept.view.seal, kept.events)
        self._guesses.unseal(job_id, seal, secret, caller, "give its job_secret to read its events")
        if job is not None and job.refused.events:  # the two budgets, in one order
            history = sorted((*history, *job.refused.events))
        out = []
        for event in reversed(history):  # the newest first: a follower asks for a few after its cursor
            if event.seq <= after:
                break
            out.append(event)
        out.reverse()
        return out if limit is None else out[:limit]
