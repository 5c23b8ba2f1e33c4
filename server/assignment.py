"""Rank and group assignment: a pure function of the joined members.

No I/O, no clock, no grpc. Given the members of a job (in join order) and its
spec, `plan_world` decides node ranks, local ranks, global ranks, the master
endpoint and the membership of every communication group. The same input
always gives the same output.

Rules:
  * Nodes are the distinct node keys. A node whose workers gave an explicit
    node rank takes it; the other nodes fill the free node ranks in ascending
    numeric-aware order of their keys ("node7" before "node66").
  * Within a node, explicit local ranks are kept; the other workers fill the
    free local ranks in join order. Local ranks end up 0..size-1.
  * Re-forming after a change, survivors carry their previous node rank and
    local rank as hints: each is kept when it is still in range and free
    (after explicit ranks); survivors that cannot keep theirs fill the free
    ranks first, in their previous order, then newcomers as above. So ranks
    stay put wherever the world's shape allows, and are compacted otherwise.
  * Global rank = sizes of all lower-ranked nodes + local rank.
  * Groups: GLOBAL (everyone), INTRA_NODE (one per node), INTER_NODE (one per
    local rank i, holding local rank i of every node that has one), then the
    spec's layout and rule families (see topology).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from .groups import Family, GroupSpec, PlanError, RankRun, compress, expand  # noqa: F401 (re-exported)
from .spec import JobSpec
from .topology import check_within_node, layout_families, rule_families

GLOBAL = "GLOBAL"
INTRA_NODE = "INTRA_NODE"
INTER_NODE = "INTER_NODE"


class MemberSpec(NamedTuple):
    """What the assignment needs to know about one joined worker."""

    member_id: str
    node_key: str
    address: str
    master_port: int
    local_rank: int | None = None
    node_rank: int | None = None
    role: str = ""
    prev_node_rank: int | None = None  # survivors of a previous generation: hints, not demands
    prev_local_rank: int | None = None


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

    spec: JobSpec
    nodes: tuple[NodePlacement, ...]
    ranks: Mapping[str, int]  # member id -> global rank
    roles: tuple[str, ...]  # by rank
    master_addr: str
    master_port: int
    global_group: GroupSpec
    intra_groups: tuple[GroupSpec, ...]  # by node rank
    inter_groups: tuple[GroupSpec, ...]  # by local rank
    families: tuple[Family, ...]  # layout modes, then rule modes; a worker is in at most one group of each
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

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def groups_of(self, p: Placement) -> tuple[GroupSpec, ...]:
        """The groups of the worker at `p`, in canonical creation order."""
        base = (self.global_group, self.intra_groups[p.node_rank], self.inter_groups[p.local_rank])
        if not self.families:
            return base
        return base + tuple(g for f in self.families if (g := f.group_of(p.rank)) is not None)

    def all_groups(self) -> dict[str, tuple[GroupSpec, ...]]:
        """Every group of the world, by mode, in canonical order."""
        groups = {GLOBAL: (self.global_group,), INTRA_NODE: self.intra_groups, INTER_NODE: self.inter_groups}
        groups.update((f.mode, f.groups) for f in self.families)
        return groups


_DIGITS = re.compile(r"(\d+)")


def node_sort_key(node_key: str) -> tuple:
    """Numeric-aware key: 'node7' < 'node66'; ties broken by the raw string."""
    parts = _DIGITS.split(node_key)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), node_key


def plan_world(members: Sequence[MemberSpec], spec: JobSpec) -> WorldPlan:
    """Assigns every member its ranks and builds the group plan.

    Args:
        members: The joined workers in join order; exactly `spec.world_size` of them.
        spec: The job's spec.

    Returns:
        The world plan.

    Raises:
        PlanError: explicit node or local ranks cannot all be honoured, a
            within-node dimension would span nodes, a weight-transfer scope has
            no sender, or the member count is not the world size.
    """
    world_size = spec.world_size
    if len(members) != world_size:
        raise PlanError(f"{len(members)} workers joined but world_size is {world_size}")

    by_node: dict[str, list[MemberSpec]] = {}
    for m in members:
        by_node.setdefault(m.node_key, []).append(m)
    num_nodes = len(by_node)

    explicit: dict[int, str] = {}
    hinted: list[tuple[int, str]] = []
    implicit: list[str] = []
    for key, node_members in by_node.items():
        wanted = {m.node_rank for m in node_members if m.node_rank is not None}
        if len(wanted) > 1:
            raise PlanError(f"node {key!r} was given node ranks {sorted(wanted)}; a node has one")
        if not wanted:
            hints = [m.prev_node_rank for m in node_members if m.prev_node_rank is not None]
            if hints:
                hinted.append((min(hints), key))
            else:
                implicit.append(key)
            continue
        (nr,) = wanted
        if nr >= num_nodes:
            raise PlanError(f"node {key!r} asked for node_rank {nr} but the job has {num_nodes} nodes")
        if nr in explicit:
            raise PlanError(f"nodes {explicit[nr]!r} and {key!r} both asked for node_rank {nr}")
        explicit[nr] = key
    order = dict(explicit)
    displaced = []
    for hint, key in sorted(hinted):
        if hint < num_nodes and hint not in order:
            order[hint] = key
        else:
            displaced.append(key)
    implicit.sort(key=node_sort_key)
    free = iter(r for r in range(num_nodes) if r not in order)
    for key in displaced + implicit:
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
        moved = []
        for m in sorted((m for m in node_members if m.local_rank is None and m.prev_local_rank is not None), key=lambda m: m.prev_local_rank):
            if m.prev_local_rank < size and seats[m.prev_local_rank] is None:
                seats[m.prev_local_rank] = m
            else:
                moved.append(m)
        newcomers = [m for m in node_members if m.local_rank is None and m.prev_local_rank is None]
        gaps = iter(i for i, s in enumerate(seats) if s is None)
        for m in moved + newcomers:
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
    first_ranks = tuple(n.first_rank for n in nodes)
    families: list[Family] = []
    roles: tuple[str, ...] = ()
    if spec.layout is not None or spec.rules or any(m.role for m in members):
        role_by_rank = [""] * world_size
        for m in members:
            role_by_rank[rank_of[m.member_id]] = m.role
        roles = tuple(role_by_rank)
        keys, sizes = [n.node_key for n in nodes], [n.size for n in nodes]
        if spec.layout is not None:
            families += layout_families(spec.layout, world_size)
            check_within_node(spec.layout, families, first_ranks, keys, sizes)
        families += rule_families(spec, keys, first_ranks, sizes, roles)
    global_group = GroupSpec(GLOBAL, 0, (RankRun(0, world_size, 1),), world_size)
    intra = tuple(GroupSpec(INTRA_NODE, n.node_rank, (RankRun(n.first_rank, n.size, 1),), n.size) for n in nodes)
    inter_groups = tuple(inter)
    if spec.cpu_twins:
        twins = set(spec.cpu_twins)

        def twin(groups):
            return tuple(dataclasses.replace(g, cpu_twin=True) if g.mode in twins else g for g in groups)

        (global_group,), intra, inter_groups = twin((global_group,)), twin(intra), twin(inter_groups)
        families = [Family(f.mode, twin(f.groups), f._index_of) if f.mode in twins else f for f in families]
    return WorldPlan(
        spec=spec,
        nodes=tuple(nodes),
        ranks=MappingProxyType(rank_of),
        roles=roles,
        master_addr=rank0.address,
        master_port=rank0.master_port,
        global_group=global_group,
        intra_groups=intra,
        inter_groups=inter_groups,
        families=tuple(families),
        num_nodes=num_nodes,
        dist_url=f"tcp://{host}:{rank0.master_port}",
        _first_ranks=first_ranks,
    )
