"""The commctx rendezvous server (grpc.aio). Never imports torch.

Layers, each importing only those before it:

    planning/     the job spec and the world planner: pure Python
    rendezvous/   the state machine, its store and the executor of its actions
    rpc/          the wire codec, the gRPC servicer and the server's wiring

`start_server` and `RendezvousServer` load the gRPC layer on first use, so
importing the planner (as `commctx plan` does) loads no gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["RendezvousServer", "start_server"]

if TYPE_CHECKING:
    from .rpc.app import RendezvousServer, start_server


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module(".rpc.app", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'commctx.server' has no attribute {name!r}")
