"""Communication modes: the names groups are registered and planned under.

The one definition of mode names for the client and the server's planner.
Both enums are `str` enums whose values are the seed's string constants, so
`CommMode.GLOBAL == ParallelMode.GLOBAL == "GLOBAL"` and any of the three finds
the same group. Any other well-formed string names a user group.
"""

from __future__ import annotations

import enum
import re


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

GLOBAL, INTRA_NODE, INTER_NODE = (m.value for m in CommMode)
BUILTIN_MODES = (GLOBAL, INTRA_NODE, INTER_NODE)
# The parallel layout's dimensions, in canonical order, and the mode of each.
LAYOUT_MODES = {
    "tp": ParallelMode.TENSOR_PARALLEL.value,
    "cp": ParallelMode.SEQUENCE_PARALLEL.value,
    "ep": ParallelMode.EXPERT.value,
    "dp": ParallelMode.DATA_PARALLEL.value,
    "pp": ParallelMode.PIPELINE_PARALLEL.value,
}
# A mode a job may name in its spec: 1-64 characters, starting with a letter.
MODE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
CPU_TWIN_SUFFIX = "_CPU"


def cpu_twin(mode: str) -> str:
    """The name a group's gloo twin is registered under."""
    return mode + CPU_TWIN_SUFFIX


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
