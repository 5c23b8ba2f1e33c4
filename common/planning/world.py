"""Planning a world: who sits where (`seat`), then every group (`build_plan`).

Pure: no I/O, no clock. The same input always gives the same output, so a
stored `Seats` rebuilds exactly the plan it came from.

The rank rule (`seat`):
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

Groups (`build_plan`): GLOBAL (everyone), INTRA_NODE (one per node),
INTER_NODE (one per local rank i, holding local rank i of every node that has
one), then the spec's layout and rule families (see groups.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from commctx.common.addresses import host_port
from commctx.common.modes import GLOBAL, INTER_NODE, INTRA_NODE

from .groups import Family, PlanError, PlannedGroup, check_within_node, layout_families, rule_families
from .ranks import RankRun, compress
from .spec import JobSpec


class Candidate(NamedTuple):
    """A worker as the planner sees it. (A NamedTuple: one is built per worker per world.)"""

    member_id: str
    node_key: str
    address: str
    port: int  # a port the worker holds in LISTEN; rank 0 serves the job's TCPStore on it
    local_rank: int | None = None
    node_rank: int | None = None
    role: str = ""
    prev_node_rank: int | None = None  # survivors of a previous generation: hints, not demands
    prev_local_rank: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class SeatedNode:
    node_key: str
    address: str
    members: tuple[str, ...]  # member ids by local rank


@dataclasses.dataclass(frozen=True, slots=True)
class Seats:
    """Who sits where (every node's seated members, the roles, rank 0's
    address): everything a plan is built from besides the spec."""

    nodes: tuple[SeatedNode, ...]  # by node rank
    roles: tuple[str, ...]  # by global rank; empty when no worker has a role
    master_addr: str  # rank 0's address
    master_port: int  # the port rank 0 serves the TCPStore on

    @property
    def world_size(self) -> int:
        return sum(len(n.members) for n in self.nodes)


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedNode:
    """One node of a plan: its node rank, the global rank of its local rank 0, its size and address."""

    node_key: str
    node_rank: int
    first_rank: int
    size: int
    address: str


class Seat(NamedTuple):
    """A seat: where one worker sits in one world (its rank, node rank and local rank)."""

    member_id: str
    rank: int
    node_rank: int
    local_rank: int


@dataclasses.dataclass(frozen=True)
class WorldPlan:
    """The complete world of one generation."""

    spec: JobSpec  # at the world's size
    seats: Seats
    nodes: tuple[PlannedNode, ...]
    ranks: Mapping[str, int]  # member id -> global rank
    global_group: PlannedGroup
    intra_groups: tuple[PlannedGroup, ...]  # by node rank
    inter_groups: tuple[PlannedGroup, ...]  # by local rank
    families: tuple[Family, ...]  # layout modes, then rule modes; a worker is in at most one group of each
    _first_ranks: tuple[int, ...]  # by node rank

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def roles(self) -> tuple[str, ...]:
        return self.seats.roles

    @property
    def master_addr(self) -> str:
        return self.seats.master_addr

    @property
    def master_port(self) -> int:
        return self.seats.master_port

    @property
    def dist_url(self) -> str:
        """tcp://master_addr:master_port (IPv6 in brackets)."""
        return f"tcp://{host_port(self.master_addr, self.master_port)}"

    def seat_of(self, member_id: str) -> Seat | None:
        """Where `member_id` sits, or None if it is not part of this world."""
        rank = self.ranks.get(member_id)
        if rank is None:
            return None
        node_rank = bisect.bisect_right(self._first_ranks, rank) - 1
        return Seat(member_id, rank, node_rank, rank - self._first_ranks[node_rank])

    def all_seats(self) -> list[Seat]:
        return [self.seat_of(m) for m in self.ranks]

    def groups_of(self, p: Seat) -> tuple[PlannedGroup, ...]:
        """The groups of the worker at `p`, in canonical creation order."""
        base = (self.global_group, self.intra_groups[p.node_rank], self.inter_groups[p.local_rank])
        if not self.families:
            return base
        return base + tuple(g for f in self.families if (g := f.group_of(p.rank)) is not None)

    def all_groups(self) -> dict[str, tuple[PlannedGroup, ...]]:
        """Every group of the world, by mode, in canonical order."""
        groups = {GLOBAL: (self.global_group,), INTRA_NODE: self.intra_groups, INTER_NODE: self.inter_groups}
        groups.update((f.mode, f.groups) for f in self.families)
        return groups


_DIGITS = re.compile(r"(\d+)")


def node_sort_key(node_key: str) -> tuple:
    """Numeric-aware key: 'node7' < 'node66'; ties broken by the raw string."""
    parts = _DIGITS.split(node_key)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), node_key


def seat(candidates: Sequence[Candidate], spec: JobSpec) -> Seats:
    """Assigns node ranks and local ranks by the rank rule (module docstring).

    Args:
        candidates: The workers in join order (survivors of a previous world
            first, in their previous rank order); exactly `spec.world_size`.
        spec: The job's spec at this world's size.

    Raises:
        PlanError: explicit node or local ranks cannot all be honoured, or the
            count is not the world size.
    """
    if len(candidates) != spec.world_size:
        raise PlanError(f"{len(candidates)} workers joined but world_size is {spec.world_size}")
    by_node: dict[str, list[Candidate]] = {}
    for c in candidates:
        by_node.setdefault(c.node_key, []).append(c)
    num_nodes = len(by_node)

    explicit: dict[int, str] = {}
    hinted: list[tuple[int, str]] = []
    implicit: list[str] = []
    for key, node_members in by_node.items():
        wanted = {c.node_rank for c in node_members if c.node_rank is not None}
        if len(wanted) > 1:
            raise PlanError(f"node {key!r} was given node ranks {sorted(wanted)}; a node has one")
        if not wanted:
            hints = [c.prev_node_rank for c in node_members if c.prev_node_rank is not None]
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

    nodes: list[SeatedNode] = []
    roles: list[str] = []
    rank0: Candidate | None = None
    for node_rank in range(num_nodes):
        key = order[node_rank]
        node_members = by_node[key]
        size = len(node_members)
        seats: list[Candidate | None] = [None] * size
        for c in node_members:
            if c.local_rank is None:
                continue
            if c.local_rank >= size:
                raise PlanError(f"node {key!r} has {size} workers but one asked for local_rank {c.local_rank}")
            if seats[c.local_rank] is not None:
                raise PlanError(f"two workers on node {key!r} asked for local_rank {c.local_rank}")
            seats[c.local_rank] = c
        moved = []
        hinted_members = [c for c in node_members if c.local_rank is None and c.prev_local_rank is not None]
        for c in sorted(hinted_members, key=lambda c: c.prev_local_rank):
            if c.prev_local_rank < size and seats[c.prev_local_rank] is None:
                seats[c.prev_local_rank] = c
            else:
                moved.append(c)
        newcomers = [c for c in node_members if c.local_rank is None and c.prev_local_rank is None]
        gaps = iter(i for i, s in enumerate(seats) if s is None)
        for c in moved + newcomers:
            seats[next(gaps)] = c
        if rank0 is None:
            rank0 = seats[0]
        roles += [c.role for c in seats]
        nodes.append(SeatedNode(key, seats[0].address, tuple(c.member_id for c in seats)))
    return Seats(tuple(nodes), tuple(roles) if any(roles) else (), rank0.address, rank0.port)


def build_plan(seats: Seats, spec: JobSpec) -> WorldPlan:
    """Builds every group of a seated world.

    Raises:
        PlanError: a within-node dimension would span nodes, or a
            weight-transfer scope has receivers but no sender.
    """
    world_size = spec.world_size
    if seats.world_size != world_size:
        raise PlanError(f"{seats.world_size} workers are seated but world_size is {world_size}")
    nodes: list[PlannedNode] = []
    rank_of: dict[str, int] = {}
    first = 0
    for node_rank, n in enumerate(seats.nodes):
        rank_of.update(zip(n.members, range(first, first + len(n.members))))
        nodes.append(PlannedNode(n.node_key, node_rank, first, len(n.members), n.address))
        first += len(n.members)
    first_ranks = tuple(n.first_rank for n in nodes)
    sizes = [n.size for n in nodes]

    inter = []
    for i in range(max(sizes)):
        ranks = [n.first_rank + i for n in nodes if n.size > i]
        inter.append(PlannedGroup(INTER_NODE, i, compress(ranks), len(ranks)))
    global_group = PlannedGroup(GLOBAL, 0, (RankRun(0, world_size, 1),), world_size)
    intra = tuple(PlannedGroup(INTRA_NODE, n.node_rank, (RankRun(n.first_rank, n.size, 1),), n.size) for n in nodes)
    inter_groups = tuple(inter)

    families: list[Family] = []
    if spec.layout is not None or spec.rules:
        keys = [n.node_key for n in nodes]
        roles = seats.roles or ("",) * world_size
        if spec.layout is not None:
            families += layout_families(spec.layout, world_size)
            check_within_node(spec.layout, families, first_ranks, keys, sizes)
        families += rule_families(spec, keys, first_ranks, sizes, roles)
    if spec.cpu_twins:
        twins = set(spec.cpu_twins)

        def twin(groups: tuple[PlannedGroup, ...]) -> tuple[PlannedGroup, ...]:
            return tuple(dataclasses.replace(g, cpu_twin=True) if g.mode in twins else g for g in groups)

        (global_group,), intra, inter_groups = twin((global_group,)), twin(intra), twin(inter_groups)
        families = [f.with_cpu_twins() if f.mode in twins else f for f in families]
    return WorldPlan(
        spec=spec,
        seats=seats,
        nodes=tuple(nodes),
        ranks=MappingProxyType(rank_of),
        global_group=global_group,
        intra_groups=intra,
        inter_groups=inter_groups,
        families=tuple(families),
        _first_ranks=first_ranks,
    )


def plan_world(candidates: Sequence[Candidate], spec: JobSpec) -> WorldPlan:
    """Seats the candidates and builds every group (`seat`, then `build_plan`).

    Raises:
        PlanError: the world cannot satisfy the spec; the message says why.
    """
    return build_plan(seat(candidates, spec), spec)
