"""Communication modes: the keys under which CommContext holds its groups.

Both enums are `str` enums whose values are the seed's string constants, so
`CommMode.GLOBAL == ParallelMode.GLOBAL == "GLOBAL"` and any of the three finds
the same group. Any other non-empty string names a user group.
"""

from __future__ import annotations

import enum


class CommMode(str, enum.Enum):
    """Groups every joined worker gets."""

    GLOBAL = "GLOBAL"
    INTRA_NODE = "INTRA_NODE"
    INTER_NODE = "INTER_NODE"

    def __str__(self) -> str:
        return self.value


class ParallelMode(str, enum.Enum):
    """The seed's parallel modes (a superset of CommMode's values), plus the
    layout modes the server plans (SEQUENCE_PARALLEL is Megatron's context
    parallelism)."""

    GLOBAL = "GLOBAL"
    INTRA_NODE = "INTRA_NODE"
    INTER_NODE = "INTER_NODE"
    TRAIN_DATA_PARALLEL = "TRAIN_DATA_PARALLEL"
    DATA_PARALLEL = "DATA_PARALLEL"
    TENSOR_PARALLEL = "TENSOR_PARALLEL"
    SEQUENCE_PARALLEL = "SEQUENCE_PARALLEL"
    WEIGHT_TRANSFER = "WEIGHT_TRANSFER"
    PIPELINE_PARALLEL = "PIPELINE_PARALLEL"
    EXPERT = "EXPERT"

    def __str__(self) -> str:
        return self.value


Mode = CommMode | ParallelMode | str


def mode_key(mode: Mode | None) -> str:
    """The string a mode is stored under.

    Raises:
        ValueError: `mode` is None, empty or not a string.
    """
    if isinstance(mode, enum.Enum):
        return mode.value
    if isinstance(mode, str) and mode:
        return mode
    raise ValueError(f"mode must be a CommMode, a ParallelMode or a non-empty string, not {mode!r}")
