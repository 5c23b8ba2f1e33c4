"""The commctx rendezvous server (grpc.aio). Never imports torch.

Layers, bottom up. A module imports from its own layer and those below, never
from above, and no import loop joins the server's modules (tests/test_layers.py
holds both):

    base        commctx.common (modes, addresses, the job spec and the world
                planner, the refusals they raise), commctx.v1 (the protocol),
                errors.py (the domain's refusals), tokens.py (who may call)
    stores      rendezvous/store.py, sqlite.py, etcd.py: records, fencing,
                schema; of the rendezvous above them only model.py, whose
                events their records hold
    rendezvous  rendezvous/: the domain: the state machine, the executor of
                its actions, the Join that waits, the watches of histories
    telemetry   telemetry.py: logs, and metrics of the domain's stats
    edges       rpc/ (gRPC: the codec, the servicer, the server and its
                terms) and web/ (HTTP: dashboard, JSON API, metrics); neither
                imports the other
    process     startup.py (start_server: the edges around the rendezvous),
                main.py, config.py, ha.py, gc_pacer.py: they wire the rest

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
