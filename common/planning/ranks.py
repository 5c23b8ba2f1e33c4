"""Rank sets as arithmetic runs: the form group memberships are planned, compared
and sent in, so that GLOBAL and other regular groups cost a few values at any
world size."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class RankRun:
    """The ranks start, start + stride, ..., count of them."""

    start: int
    count: int
    stride: int = 1

    def ranks(self) -> range:
        return range(self.start, self.start + self.count * self.stride, self.stride)

    @property
    def last(self) -> int:
        return self.start + (self.count - 1) * self.stride


# An ascending rank set. `compress` is canonical (greedy and deterministic), so
# two RankSets are equal exactly when they hold the same ranks: comparing them
# never needs the expanded lists.
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
