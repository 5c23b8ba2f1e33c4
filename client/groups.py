"""Applies the server's group plan to torch.distributed.

Every worker creates the groups it belongs to, in the plan's canonical order,
with `use_local_synchronization=True`: only members take part in creating a
group, and because all members of two overlapping groups create them in the
same relative order, creation cannot deadlock. A group holding the whole world
is the default group itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch.distributed as dist

from .assignment import GroupInfo
from .modes import CommMode


@dataclasses.dataclass(frozen=True)
class BuiltGroup:
    mode: str
    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    group_rank: int


def build_groups(groups: Iterable[GroupInfo], world_size: int, backend: str) -> list[BuiltGroup]:
    """Creates the process groups of `groups` (all of which contain this rank)."""
    built = []
    for g in groups:
        if g.mode == CommMode.GLOBAL or len(g.ranks) == world_size:
            pg = dist.group.WORLD
        else:
            pg = dist.new_group(
                list(g.ranks),
                backend=backend,
                use_local_synchronization=True,
                group_desc=f"{g.mode}:{g.index}",
            )
        built.append(BuiltGroup(g.mode, pg, g.ranks, g.group_rank))
    return built
