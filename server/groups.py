"""Rank sets and group specs: the values group plans are made of."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


class PlanError(ValueError):
    """The members cannot form a valid world; the message says why."""


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
    cpu_twin: bool = False  # also build a gloo twin of this group
    root: int | None = None  # the sender of a weight-transfer group


class Family:
    """All groups of one mode, and which of them holds a given rank."""

    def __init__(self, mode: str, groups: Sequence[GroupSpec], index_of: Sequence[int]) -> None:
        """`index_of[rank]` is the rank's group index in `groups`, or -1."""
        self.mode = mode
        self.groups = tuple(groups)
        self._index_of = index_of

    def group_of(self, rank: int) -> GroupSpec | None:
        i = self._index_of[rank]
        return self.groups[i] if i >= 0 else None
