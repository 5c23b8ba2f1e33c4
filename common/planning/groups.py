"""Planned groups: the group families beyond GLOBAL/INTRA_NODE/INTER_NODE (the
parallel layout, role groups, weight transfer, named groups). Pure functions of
the spec and the seated world; PlanError says why a world cannot satisfy a spec.

Layout groups follow Megatron's enumeration (generate_masked_orthogonal_rank_groups):
with sizes s_0..s_k-1 in `order` (the first varies fastest) and strides
st_i = s_0*...*s_i-1, the group of dimension d through a rank holds the ranks
that differ from it only in coordinate d, and groups are numbered by the other
coordinates in order, fastest first.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from array import array
from collections.abc import Sequence

from commctx.common.modes import LAYOUT_MODES

from .ranks import RankRun, RankSet, compress
from .spec import JobSpec, Layout, NamedGroups, RoleGroup


class PlanError(ValueError):
    """The members cannot form a valid world; the message says why."""


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedGroup:
    """One communication group of a planned world: its mode, which one of that mode, its members."""

    mode: str
    index: int
    ranks: RankSet
    size: int
    cpu_twin: bool = False  # also build a gloo twin of this group
    root: int | None = None  # the sender of a weight-transfer group


class Family:
    """All groups of one mode, and which of them holds a given rank."""

    __slots__ = ("mode", "groups", "_index_of")

    def __init__(self, mode: str, groups: Sequence[PlannedGroup], index_of: Sequence[int]) -> None:
        """`index_of[rank]` is the rank's group index in `groups`, or -1."""
        self.mode = mode
        self.groups = groups if isinstance(groups, LayoutGroups) else tuple(groups)
        self._index_of = index_of

    @classmethod
    def of(cls, mode: str, groups: Sequence[PlannedGroup], world_size: int) -> Family:
        index_of = array("i", [-1]) * world_size
        for i, g in enumerate(groups):
            for run in g.ranks:
                index_of[run.start : run.last + 1 : run.stride] = array("i", [i]) * run.count
        return cls(mode, groups, index_of)

    def group_of(self, rank: int) -> PlannedGroup | None:
        i = self._index_of[rank]
        return self.groups[i] if i >= 0 else None

    def with_cpu_twins(self) -> Family:
        return Family(self.mode, [dataclasses.replace(g, cpu_twin=True) for g in self.groups], self._index_of)


class LayoutGroups(Sequence[PlannedGroup]):
    """The groups of one layout dimension, each made when first asked for and
    then kept (a world's assignments and their encodings hold them by identity):
    a 100,000-rank world asks for a few of its 100,000 groups when a worker's
    assignment is built, and holds what it made, not every group up front."""

    __slots__ = ("_mode", "_size", "_stride", "_bases", "_made")

    def __init__(self, mode: str, size: int, stride: int, bases: Sequence[int]) -> None:
        self._mode, self._size, self._stride, self._bases = mode, size, stride, bases
        self._made: list[PlannedGroup | None] = [None] * len(bases)

    def __len__(self) -> int:
        return len(self._bases)

    def __getitem__(self, i):  # noqa: ANN001 (an index or a slice, as a tuple's)
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        if i < 0:
            i += len(self)
        g = self._made[i]
        if g is None:
            g = self._made[i] = PlannedGroup(self._mode, i, (RankRun(self._bases[i], self._size, self._stride),), self._size)
        return g

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  (as a list's: compared by value)


def layout_groups(layout: Layout, dim: str) -> Sequence[PlannedGroup]:
    """Every group of dimension `dim`, in Megatron's order."""
    dims = [d for d, _ in layout.sizes]
    sizes = [s for _, s in layout.sizes]
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    k = dims.index(dim)
    bases = [0]  # each group's first rank, groups numbered by the other coordinates, the fastest first
    for i in range(len(dims)):
        if i != k and sizes[i] > 1:
            bases = [b + c * strides[i] for c in range(sizes[i]) for b in bases]
    return LayoutGroups(LAYOUT_MODES[dim], sizes[k], strides[k], array("q", bases))


def layout_families(layout: Layout, world_size: int) -> list[Family]:
    """One family per dimension, in canonical mode order (tp, cp, ep, dp, pp).

    A rank's group in dimension d (size s_d, stride st_d) is numbered by its
    other coordinates: (rank mod st_d) + (rank div (st_d * s_d)) * st_d."""
    families = []
    sizes = dict(layout.sizes)
    strides = {d: math.prod(s for _, s in layout.sizes[:i]) for i, (d, _) in enumerate(layout.sizes)}
    for d in LAYOUT_MODES:
        st, span = strides[d], strides[d] * sizes[d]
        index_of = array("i", [r % st + (r // span) * st for r in range(world_size)])
        families.append(Family(LAYOUT_MODES[d], layout_groups(layout, d), index_of))
    return families


def check_within_node(layout: Layout, families: Sequence[Family], first_ranks: Sequence[int],
                      node_keys: Sequence[str], sizes: Sequence[int]) -> None:
    """Raises PlanError when a group of a within-node dimension spans nodes."""

    def node_of(rank: int) -> int:
        return bisect.bisect_right(first_ranks, rank) - 1

    by_mode = {f.mode: f.groups for f in families}
    for dim in layout.within_node:
        for g in by_mode[LAYOUT_MODES[dim]]:
            run = g.ranks[0]
            lo, hi = node_of(run.start), node_of(run.last)
            if lo != hi:
                shown = sizes if len(sizes) <= 16 else [*sizes[:16], "..."]
                raise PlanError(
                    f"{g.mode} group {list(run.ranks())} spans nodes {node_keys[lo]!r} and {node_keys[hi]!r}: "
                    f"{dim}={layout.size(dim)} must stay within a node, but the nodes have "
                    f"{', '.join(str(s) for s in shown)} workers"
                )


def rule_families(spec: JobSpec, node_keys: Sequence[str], first_ranks: Sequence[int], sizes: Sequence[int],
                  role_of: Sequence[str]) -> list[Family]:
    """The groups of every rule, in spec order."""
    world_size = spec.world_size
    scopes_all = [range(world_size)]
    scopes_node = [range(f, f + s) for f, s in zip(first_ranks, sizes)]
    families = []
    for rule in spec.rules:
        groups: list[list[int]] = []
        roots: list[int | None] = []
        if isinstance(rule, NamedGroups):
            groups = [list(g) for g in rule.groups]
        else:
            for n, scope in enumerate(scopes_node if rule.per_node else scopes_all):
                where = f"node {node_keys[n]!r}" if rule.per_node else "the job"
                if isinstance(rule, RoleGroup):
                    wanted = set(rule.roles)
                    members = [r for r in scope if role_of[r] in wanted]
                else:
                    wanted = set(rule.receivers)
                    receivers = [r for r in scope if role_of[r] in wanted]
                    if not receivers:
                        continue
                    sender = next((r for r in scope if role_of[r] == rule.sender), None)
                    if sender is None:
                        raise PlanError(
                            f"{where} has {len(receivers)} {'/'.join(rule.receivers)} workers but no "
                            f"{rule.sender} to send weights to them ({rule.mode})"
                        )
                    members = sorted([sender, *receivers])
                    roots.append(sender)
                if members:
                    groups.append(members)
        roots += [None] * (len(groups) - len(roots))
        planned = [PlannedGroup(rule.mode, i, compress(g), len(g), root=root) for i, (g, root) in enumerate(zip(groups, roots))]
        families.append(Family.of(rule.mode, planned, world_size))
    return families
