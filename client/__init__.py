"""commctx: CommContext for PyTorch distributed jobs, on a gRPC rendezvous server.

    from commctx import CommContext, CommMode
    ctx = CommContext.join("rendezvous-host:50051", job_id="ppo-7", world_size=8)

Names that need torch load on first use, so `import commctx.server` (which
shares this package) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from commctx.common.modes import CommMode, ParallelMode

from .errors import (
    CommContextError,
    CommCtxError,
    GroupNotFound,
    InvalidArgument,
    InvalidRequest,
    JobClosed,
    JobConflict,
    JobFull,
    MemberNotFound,
    PermissionDenied,
    RankTaken,
    RendezvousError,
    RendezvousTimeout,
    ServerFull,
    ServerUnavailable,
    StaleGeneration,
    Unauthenticated,
    UsageError,
    WorldChanged,
)

_LAZY = {"CommContext": "commctx.context", "LauncherEnv": "commctx.context", "Assignment": "commctx.assignment"}

__all__ = [
    "Assignment",
    "CommContext",
    "CommContextError",
    "CommCtxError",
    "CommMode",
    "GroupNotFound",
    "InvalidArgument",
    "InvalidRequest",
    "JobClosed",
    "JobConflict",
    "JobFull",
    "LauncherEnv",
    "MemberNotFound",
    "ParallelMode",
    "RankTaken",
    "RendezvousError",
    "RendezvousTimeout",
    "ServerUnavailable",
    "PermissionDenied",
    "ServerFull",
    "StaleGeneration",
    "Unauthenticated",
    "UsageError",
    "WorldChanged",
]

if TYPE_CHECKING:
    from .assignment import Assignment
    from .context import CommContext, LauncherEnv


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'commctx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
