"""Views: what the machine answers about its jobs (DescribeJob, ListJobs, the
dashboard, metrics), built from its state without changing it.

A mixin of `Rendezvous` (machine.py): one concern of the state machine per
file; the state is the machine's."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
from collections.abc import Iterable

from commctx.common.planning import WorldPlan, elide

from ..errors import NotFound, Sealed
from .model import Job, JobState, Lease, NewWorld, worker_id
from .params import job_secret_matches
from .reports import JobView, NodeView, Stats, WorkerView
from .shares import SERVER, Caller

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
    """Describing jobs, their nodes and workers, and the server's counts."""

    def live(self, job_id: str) -> bool:
        """Whether a run of the id is under way (not only kept after it ended)."""
        return job_id in self._jobs

    def world_of(self, job_id: str) -> NewWorld | None:
        """The job's current world, if it has formed."""
        job = self._jobs.get(job_id)
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
        job, kept = self._run_of(job_id, run)
        view = self._view(job, first_node, max_nodes) if job is not None else kept.view
        self._unseal(job_id, view.seal, secret, caller, "give its job_secret to describe it")
        if job is None and (first_node or max_nodes is not None):
            view = dataclasses.replace(view, nodes=view.nodes[first_node:None if max_nodes is None else first_node + max_nodes])
        return dataclasses.replace(view, other_runs=self.other_runs(job_id, view.run))

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
            run=job.run,
            started_at=job.started,
        )

    def workers(self, job_id: str, node_keys: Iterable[str]) -> dict[str, list[WorkerView]]:
        """The workers on the given nodes of a held job (a failed one kept has
        none), by local rank: linear in the job's members.

        Raises:
            NotFound: an unknown job.
        """
        job = self._jobs.get(job_id)
        if job is None:
            if job_id in self._runs:
                return {k: [] for k in node_keys}
            raise NotFound(f"no job {elide(job_id)} on this server")
        out: dict[str, list[WorkerView]] = {k: [] for k in node_keys}
        now, plan = self._clock(), job.plan
        for mid, m in job.members.items():
            seats = out.get(m.node_key)
            if seats is None:
                continue
            age = now - (m.lease_deadline - self.lease_ttl_s) if m.lease is Lease.RENEWING else None
            if m.slots:  # a host membership: each worker its own role, and local rank if its launcher fixed one
                held = [(worker_id(mid, s.index), s.role, s.local_rank) for s in m.slots]
            else:
                held = [(worker_id(mid, i), m.role, i if m.workers > 1 else m.local_rank) for i in range(m.workers)]
            for wid, role, fixed in held:
                p = plan.placement(wid) if plan is not None else None
                local = p.local_rank if p is not None else fixed
                seats.append(WorkerView(wid, local, p.rank if p is not None else None, role, m.lease.value, age))
        for seats in out.values():
            seats.sort(key=lambda w: (w.local_rank is None, w.local_rank or 0))
        return out

    def plan_of(self, job_id: str) -> WorldPlan | None:
        """The job's current world (while re-forming: the one being replaced), if any."""
        job = self._jobs.get(job_id)
        return job.plan if job is not None else None

    def job_ids(self, ended: bool = False) -> list[str]:
        """Jobs with a run under way (`ended`: or a kept run that ended), sorted."""
        return sorted({*self._jobs, *self._runs}) if ended else sorted(self._jobs)

    def job_page(self, after: str, size: int, ended: bool = False) -> tuple[list[JobView], bool]:
        """Up to `size` jobs (their views without nodes) after `after` ("": from
        the first), and whether more follow: each id's live run;
        with `ended`, every kept run that ended too, after the live one, newest
        first (`after`: the last entry's page_key)."""
        if not ended:
            ids = self.job_ids()
            start = bisect.bisect_right(ids, after) if after else 0
            return [self.describe(j, max_nodes=0) for j in ids[start:start + size]], start + size < len(ids)
        entries = sorted([*((j, -job.run) for j, job in self._jobs.items()), *((j, -r) for j, r in self._ended)])
        start = bisect.bisect_right(entries, page_entry(after)) if after else 0
        return [self.describe(j, max_nodes=0, run=-r) for j, r in entries[start:start + size]], start + size < len(entries)

    def stats(self) -> Stats:
        """Counts for metrics (linear in the number of jobs, not members)."""
        members = waiting = 0
        for job in self._jobs.values():
            members += job.workers  # workers, as `waiting`: a node membership counts its workers
            waiting += job.workers - job.placed
        oldest = self._oldest_lease()
        age = 0.0 if oldest is None else max(0.0, self._clock() - (oldest - self.lease_ttl_s))
        return Stats(len(self._jobs), members, waiting, age)

    def _unseal(self, job_id: str, seal: str, secret: str | None, caller: Caller, what: str) -> None:
        """Whether `secret` opens the job (None: not asked, for operators and the
        server); wrong secrets are counted by caller and job (shares.Guesses).

        Raises:
            LimitExceeded: a wrong secret, from a caller that gave too many
                wrong ones for this job lately (a right one always passes).
            Sealed: the job is sealed and `secret` does not open it.
        """
        if secret is None or job_secret_matches(seal, secret):
            return
        self.guesses.check(caller, job_id)  # only guessers are slowed: the team that holds the secret never is
        self.guesses.failed(caller, job_id)
        raise Sealed(f"job {job_id!r} is sealed: {what}")
