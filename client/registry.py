"""The groups a CommContext holds: one map from mode to group record."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from commctx.common.modes import GLOBAL


@dataclasses.dataclass(frozen=True)
class GroupRecord:
    """This rank's group of one mode."""

    mode: str
    group: Any  # torch.distributed.ProcessGroup
    ranks: tuple[int, ...]  # global ranks, ascending
    group_rank: int  # this rank's position in `ranks`

    @property
    def size(self) -> int:
        return len(self.ranks)


class GroupRegistry:
    """Mode -> GroupRecord. GLOBAL is registered first and marks the context initialised."""

    def __init__(self) -> None:
        self._records: dict[str, GroupRecord] = {}

    def register(self, record: GroupRecord) -> None:
        self._records[record.mode] = record

    def get(self, mode: str) -> GroupRecord | None:
        return self._records.get(mode)

    def clear(self) -> None:
        self._records.clear()

    @property
    def initialized(self) -> bool:
        return GLOBAL in self._records

    def __iter__(self) -> Iterator[GroupRecord]:
        return iter(self._records.values())

    def modes(self) -> list[str]:
        return list(self._records)
