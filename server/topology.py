"""Group families beyond GLOBAL/INTRA_NODE/INTER_NODE: the parallel layout,
role groups, weight transfer and named groups. Pure functions of the spec and
the placed world; PlanError says why a world cannot satisfy a spec.

Layout groups follow Megatron's enumeration (generate_masked_orthogonal_rank_groups):
with sizes s_0..s_k-1 in `order` (the first varies fastest) and strides
st_i = s_0*...*s_i-1, the group of dimension d through a rank holds the ranks
that differ from it only in coordinate d, and groups are numbered by the other
coordinates in order, fastest first.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Sequence

from .groups import Family, GroupSpec, PlanError, RankRun, compress
from .spec import DIM_MODES, JobSpec, Layout, NamedGroups, RoleGroup


def layout_groups(layout: Layout, dim: str) -> list[GroupSpec]:
    """Every group of dimension `dim`, in Megatron's order."""
    dims = [d for d, _ in layout.sizes]
    sizes = [s for _, s in layout.sizes]
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    k = dims.index(dim)
    others = [i for i in range(len(dims)) if i != k]
    mode = DIM_MODES[dim]
    groups = []
    for g in range(math.prod(sizes) // sizes[k]):
        base, rest = 0, g
        for i in others:
            base += (rest % sizes[i]) * strides[i]
            rest //= sizes[i]
        groups.append(GroupSpec(mode, g, (RankRun(base, sizes[k], strides[k]),), sizes[k]))
    return groups


def _family(mode: str, groups: list[GroupSpec], world_size: int) -> Family:
    index_of = array("i", [-1]) * world_size
    for i, g in enumerate(groups):
        for run in g.ranks:
            for r in run.ranks():
                index_of[r] = i
    return Family(mode, groups, index_of)


def layout_families(layout: Layout, world_size: int) -> list[Family]:
    return [_family(DIM_MODES[d], layout_groups(layout, d), world_size) for d, _ in sorted(layout.sizes, key=lambda ds: list(DIM_MODES).index(ds[0]))]


def check_within_node(layout: Layout, families: Sequence[Family], first_ranks: Sequence[int],
                      node_keys: Sequence[str], sizes: Sequence[int]) -> None:
    """Raises PlanError when a group of a within-node dimension spans nodes."""

    def node_of(rank: int) -> int:
        return bisect.bisect_right(first_ranks, rank) - 1

    by_mode = {f.mode: f.groups for f in families}
    for dim in layout.within_node:
        for g in by_mode[DIM_MODES[dim]]:
            run = g.ranks[0]
            lo, hi = node_of(run.start), node_of(run.start + (run.count - 1) * run.stride)
            if lo != hi:
                members = list(run.ranks())
                raise PlanError(
                    f"{g.mode} group {members} spans nodes {node_keys[lo]!r} and {node_keys[hi]!r}: "
                    f"{dim}={layout.size(dim)} must stay within a node, but the nodes have "
                    f"{', '.join(str(s) for s in sizes)} workers"
                )


def rule_families(spec: JobSpec, node_keys: Sequence[str], first_ranks: Sequence[int], sizes: Sequence[int],
                  role_of: Sequence[str]) -> list[Family]:
    """The groups of every GroupRule, in spec order."""
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
                    members = [r for r in scope if role_of[r] in rule.roles]
                else:
                    receivers = [r for r in scope if role_of[r] in rule.receivers]
                    if not receivers:
                        continue
                    senders = [r for r in scope if role_of[r] == rule.sender]
                    if not senders:
                        raise PlanError(
                            f"{where} has {len(receivers)} {'/'.join(rule.receivers)} workers but no "
                            f"{rule.sender} to send weights to them ({rule.mode})"
                        )
                    members = sorted([senders[0], *receivers])
                    roots.append(senders[0])
                if members:
                    groups.append(members)
        roots += [None] * (len(groups) - len(roots))
        specs = [GroupSpec(rule.mode, i, compress(g), len(g), root=root) for i, (g, root) in enumerate(zip(groups, roots))]
        families.append(_family(rule.mode, specs, world_size))
    return families
