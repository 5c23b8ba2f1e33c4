"""What the machine reports about its jobs (DescribeJob, ListJobs, the
dashboard, metrics): frozen snapshots, built by views.py and history.py."""

from __future__ import annotations

import dataclasses

from commctx.common.planning import JobSpec

from .model import JobState


@dataclasses.dataclass(frozen=True, slots=True)
class NodeView:
    node_key: str
    address: str
    workers: int
    node_rank: int | None
    roles: tuple[tuple[str, int], ...] = ()  # workers per role, by role name
    addresses: tuple[str, ...] = ()  # every address its workers gave (`address` is the first)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker of a node, as the dashboard shows it."""

    worker_id: str  # its member id (a node membership's further workers: "<member id>/<local rank>")
    local_rank: int | None  # None: not seated and not chosen by its launcher
    rank: int | None  # its global rank in the current world (while re-forming: the one being replaced), if seated
    role: str
    lease: str  # a Lease value
    renewed_s_ago: float | None  # since its lease was last renewed (RENEWING only)


@dataclasses.dataclass(frozen=True, slots=True)
class JobView:
    """What DescribeJob reports."""

    job_id: str
    state: JobState
    generation: int
    spec: JobSpec
    joined: int
    missing: int
    nodes: tuple[NodeView, ...]  # a page of them (DescribeJob), in node-rank order once formed, else by key
    reason: str
    forming_for_s: float
    num_nodes: int = 0  # nodes present; `nodes` may hold a page of them
    missing_nodes: tuple[str, ...] = ()  # expected node keys not present
    waiting: int = 0  # joined a formed world, wait for the next generation
    not_ready: int = 0  # re-forming: survivors awaited before the next world can form
    seal: str = ""  # digest of the job secret ("": an open job); never sent
    refused: int = 0  # joins refused since the job began (its history holds the reasons)
    last_refused: str = ""  # the last refusal's reason
    run: int = 1  # which run of its job id
    started_at: float = 0.0  # wall-clock times it began (first Join) and ended (last member gone; 0: not yet)
    ended_at: float = 0.0
    other_runs: tuple[int, ...] = ()  # the other runs of its id that are kept, newest first


@dataclasses.dataclass(frozen=True, slots=True)
class Stats:
    """Counts for metrics, read as one consistent snapshot."""

    jobs: int
    members: int
    waiting: int
    oldest_keepalive_s: float
    sessions: int = 0  # Session streams open and named (a host membership's workers share one); the RPC layer's count
