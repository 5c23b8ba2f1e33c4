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
    ConnectionMismatch,
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
    "ConnectionMismatch",
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
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        raise worker_dependency_missing(exc, f"commctx.{name}") from None
    globals()[name] = value
    return value


# What the `worker` extra installs (pyproject.toml), which the server's install lacks.
WORKER_EXTRA = ("torch", "numpy", "psutil")


def worker_dependency_missing(exc: ModuleNotFoundError, what: str) -> ModuleNotFoundError:
    """`exc` itself, or, when the module it misses is one the `worker` extra
    installs, the same error saying so and what to install."""
    missing = (exc.name or "").partition(".")[0]
    if missing not in WORKER_EXTRA:
        return exc
    return ModuleNotFoundError(
        f"{what} needs {missing}, which is not installed: install the worker extra, pip install 'commctx[worker]' "
        f"(it keeps a torch already installed; for a CPU-only one, install torch from PyTorch's CPU index first)",
        name=exc.name)
