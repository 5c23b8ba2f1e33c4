"""The commctx rendezvous server (grpc.aio). Never imports torch."""

from .app import RendezvousServer, start_server
from .assignment import WorldPlan, plan_world
from .state import Rendezvous

__all__ = ["Rendezvous", "RendezvousServer", "WorldPlan", "plan_world", "start_server"]
