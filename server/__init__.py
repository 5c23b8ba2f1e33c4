"""The commctx rendezvous server (grpc.aio). Never imports torch.

Layers, each importing only those before it:

    commctx.common  the shared base (common/): modes, addresses, the job spec
                    and the world planner (pure Python), the refusals they raise
    rendezvous/     the domain: the state machine, its store, the executor of
                    its actions, the Join that waits, the watches of histories
    rpc/            the wire codec, the gRPC servicer and the server's wiring
    web/            the HTTP edge: dashboard, JSON API, metrics

`start_server` and `RendezvousServer` load the gRPC layer on first use, so
importing this package loads no gRPC until they are asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["RendezvousServer", "start_server"]

if TYPE_CHECKING:
    from .rpc.app import RendezvousServer
    from .startup import start_server

_HOMES = {"RendezvousServer": ".rpc.app", "start_server": ".startup"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'commctx.server' has no attribute {name!r}")
