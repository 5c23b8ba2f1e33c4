"""Deadlines, and heaps of them as etcd's lessor keeps leases: the reaper pops
what is due and never scans every member.

Entries are lazy: renewing a lease does not touch the heap. When an entry
comes due, its owner checks the current deadline and pushes a new entry if it
moved, so each lease costs about one pop per TTL however often it is renewed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import TypeAlias

Deadline: TypeAlias = float
"""A time on the clock its owner measures on (the machine's injected clock, or
the event loop's). Where there may be none it is `Deadline | None`, and None
means never: a member bound to its Join call, an empty heap, no timer armed."""


class Deadlines:
    """A min-heap of (deadline, key); equal deadlines pop in push order."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        # (deadline, sequence, key): the sequence breaks ties, so keys are never compared
        self._heap: list[tuple[Deadline, int, Hashable]] = []
        self._seq = itertools.count()

    def push(self, deadline: Deadline, key: Hashable) -> None:
        heapq.heappush(self._heap, (deadline, next(self._seq), key))

    def next(self) -> Deadline | None:
        """The earliest deadline held (None when empty); it may be stale."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> tuple[Deadline, Hashable] | None:
        """The earliest (deadline, key) if it is due (deadline <= now), removed; else None."""
        if self._heap and self._heap[0][0] <= now:
            deadline, _, key = heapq.heappop(self._heap)
            return deadline, key
        return None

    def __len__(self) -> int:
        return len(self._heap)

    def keep(self, live) -> None:
        """Drops every entry whose key `live(key)` rejects (an O(n) rebuild, for owners whose stale entries pile up)."""
        self._heap = [entry for entry in self._heap if live(entry[2])]
        heapq.heapify(self._heap)


def earliest(*deadlines: Deadline | None) -> Deadline | None:
    """The earliest of the deadlines given (None: none of them is set)."""
    return min((d for d in deadlines if d is not None), default=None)
