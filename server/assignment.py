"""Rank and group assignment: a pure function of the joined members.

No I/O, no clock, no grpc. Given the members of a job (in join order) and its
world size, `plan_world` decides node ranks, local ranks, global ranks, the
master endpoint and the membership of every communication group. The same
input always gives the same output.

Rules:
  * Nodes are the distinct node keys. A node whose workers gave an explicit
    node rank takes it; the other nodes fill the free node ranks in ascending
    numeric-aware order of their keys ("node7" before "node66").
  * Within a node, explicit local ranks are kept; the other workers fill the
    free local ranks in join order. Local ranks end up 0..size-1.
  * Global rank = sizes of all lower-ranked nodes + local rank.
  * Groups: GLOBAL (everyone), INTRA_NODE (one per node), INTER_NODE (one per
    local rank i, holding local rank i of every node that has one).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

GLOBAL = "GLOBAL"
INTRA_NODE = "INTRA_NODE"
INTER_NODE = "INTER_NODE"


class PlanError(ValueError):
    """The members cannot form a valid world; the message says why."""


class MemberSpec(NamedTuple):
    """What the assignment needs to know about one joined worker."""

    member_id: str
    node_key: str
    address: str
    master_port: int
    local_rank: int | None = None
    node_rank: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RankRun:
    """The ranks start, start + stride, ..., count of them."""

    start: int
    count: int
    stride: int = 1

    def ranks(self) -> range:
        return range(self.start, self.start + self.count * self.stride, self.stride)


RankSet = tuple[RankRun, ...]


def compress(ranks: Sequence[int]) -> RankSet:
    """Encodes an ascending rank list as arithmetic runs (greedy, deterministic)."""
    runs: list[RankRun] = []
    i, n = 0, len(ranks)
    while i < n:
        if i + 1 == n:
            runs.append(RankRun(ranks[i], 1, 1))
            break
        stride = ranks[i + 1] - ranks[i]
        j = i + 1
        while j + 1 < n and ranks[j + 1] - ranks[j] == stride:
            j += 1
        runs.append(RankRun(ranks[i], j - i + 1, stride))
        i = j + 1
    return tuple(runs)


def expand(runs: RankSet) -> list[int]:
    """The inverse of `compress`."""
    return [r for run in runs for r in run.ranks()]


@dataclasses.dataclass(frozen=True, slots=True)
class GroupSpec:
    """One communication group: its mode, which one of that mode, its members."""

    mode: str
    index: int
    ranks: RankSet
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class NodePlacement:
    node_key: str
    node_rank: int
    first_rank: int
    size: int
    address: str


class Placement(NamedTuple):
    """Where one worker sits in the world."""

    member_id: str
    rank: int
    node_rank: int
    local_rank: int


@dataclasses.dataclass(frozen=True)
class WorldPlan:
    """The complete world of one generation."""

    world_size: int
    nodes: tuple[NodePlacement, ...]
    ranks: Mapping[str, int]  # member id -> global rank
    master_addr: str
    master_port: int
    global_group: GroupSpec
    intra_groups: tuple[GroupSpec, ...]  # by node rank
    inter_groups: tuple[GroupSpec, ...]  # by local rank

    num_nodes: int
    dist_url: str  # tcp://master_addr:master_port (IPv6 in brackets)

    _first_ranks: tuple[int, ...]  # by node rank

    def placement(self, member_id: str) -> Placement | None:
        """Where `member_id` sits, or None if it is not part of this world."""
        rank = self.ranks.get(member_id)
        if rank is None:
            return None
        node_rank = bisect.bisect_right(self._first_ranks, rank) - 1
        return Placement(member_id, rank, node_rank, rank - self._first_ranks[node_rank])

    def placements(self) -> list[Placement]:
        return [self.placement(m) for m in self.ranks]

    def groups_of(self, p: Placement) -> tuple[GroupSpec, ...]:
        """The groups of the worker at `p`, in canonical creation order."""
        return self.global_group, self.intra_groups[p.node_rank], self.inter_groups[p.local_rank]

    def all_groups(self) -> dict[str, tuple[GroupSpec, ...]]:
        """Every group of the world, by mode."""
        return {GLOBAL: (self.global_group,), INTRA_NODE: self.intra_groups, INTER_NODE: self.inter_groups}


_DIGITS = re.compile(r"(\d+)")


def node_sort_key(node_key: str) -> tuple:
    """Numeric-aware key: 'node7' < 'node66'; ties broken by the raw string."""
    parts = _DIGITS.split(node_key)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), node_key


def plan_world(members: Sequence[MemberSpec], world_size: int) -> WorldPlan:
    """Assigns every member its ranks and builds the group plan.

    Args:
        members: The joined workers in join order; exactly `world_size` of them.
        world_size: The job's world size.

    Returns:
        The world plan.

    Raises:
        PlanError: explicit node or local ranks cannot all be honoured, or the
            member count is not the world size.
    """
    if len(members) != world_size:
        raise PlanError(f"{len(members)} workers joined but world_size is {world_size}")

    by_node: dict[str, list[MemberSpec]] = {}
    for m in members:
        by_node.setdefault(m.node_key, []).append(m)
    num_nodes = len(by_node)

    explicit: dict[int, str] = {}
    implicit: list[str] = []
    for key, node_members in by_node.items():
        wanted = {m.node_rank for m in node_members if m.node_rank is not None}
        if len(wanted) > 1:
            raise PlanError(f"node {key!r} was given node ranks {sorted(wanted)}; a node has one")
        if not wanted:
            implicit.append(key)
            continue
        (nr,) = wanted
        if nr >= num_nodes:
            raise PlanError(f"node {key!r} asked for node_rank {nr} but the job has {num_nodes} nodes")
        if nr in explicit:
            raise PlanError(f"nodes {explicit[nr]!r} and {key!r} both asked for node_rank {nr}")
        explicit[nr] = key
    implicit.sort(key=node_sort_key)
    free = iter(r for r in range(num_nodes) if r not in explicit)
    order = dict(explicit)
    for key in implicit:
        order[next(free)] = key

    nodes: list[NodePlacement] = []
    rank_of: dict[str, int] = {}
    first_rank = 0
    for node_rank in range(num_nodes):
        key = order[node_rank]
        node_members = by_node[key]
        size = len(node_members)
        seats: list[MemberSpec | None] = [None] * size
        for m in node_members:
            if m.local_rank is None:
                continue
            if m.local_rank >= size:
                raise PlanError(
                    f"node {key!r} has {size} workers but one asked for local_rank {m.local_rank}"
                )
            if seats[m.local_rank] is not None:
                raise PlanError(f"two workers on node {key!r} asked for local_rank {m.local_rank}")
            seats[m.local_rank] = m
        gaps = iter(i for i, s in enumerate(seats) if s is None)
        for m in node_members:
            if m.local_rank is None:
                seats[next(gaps)] = m
        for local_rank, m in enumerate(seats):
            assert m is not None  # every seat is filled: len(seats) == len(node_members)
            rank_of[m.member_id] = first_rank + local_rank
        nodes.append(NodePlacement(key, node_rank, first_rank, size, seats[0].address))
        first_rank += size

    inter = []
    for i in range(max(n.size for n in nodes)):
        ranks = [n.first_rank + i for n in nodes if n.size > i]
        inter.append(GroupSpec(INTER_NODE, i, compress(ranks), len(ranks)))

    rank0 = next(m for m in members if rank_of[m.member_id] == 0)
    host = f"[{rank0.address}]" if ":" in rank0.address else rank0.address
    return WorldPlan(
        world_size=world_size,
        nodes=tuple(nodes),
        ranks=MappingProxyType(rank_of),
        master_addr=rank0.address,
        master_port=rank0.master_port,
        global_group=GroupSpec(GLOBAL, 0, (RankRun(0, world_size, 1),), world_size),
        intra_groups=tuple(GroupSpec(INTRA_NODE, n.node_rank, (RankRun(n.first_rank, n.size, 1),), n.size) for n in nodes),
        inter_groups=tuple(inter),
        num_nodes=num_nodes,
        dist_url=f"tcp://{host}:{rank0.master_port}",
        _first_ranks=tuple(n.first_rank for n in nodes),
    )
