"""Planning: the job spec model and the world planner. Pure Python: no
protobuf, no grpc, no asyncio, no clock. The server's state machine, the wire
codec and `commctx plan` all plan through this package."""

from .groups import Family, PlanError, PlannedGroup, layout_groups
from .layout import DIMS, Layout
from .names import NODE_KEY, check_mode, check_name, check_role, elide
from .ranks import RankRun, RankSet, compress, expand
from .spec import JobSpec, NamedGroups, RoleGroup, Rule, WeightTransfer
from .world import (
    Candidate,
    PlannedNode,
    Seat,
    SeatedNode,
    Seats,
    WorldPlan,
    build_plan,
    node_sort_key,
    plan_world,
    seat,
)

__all__ = [
    "DIMS",
    "NODE_KEY",
    "Candidate",
    "Family",
    "JobSpec",
    "Layout",
    "NamedGroups",
    "PlannedNode",
    "PlanError",
    "Seat",
    "PlannedGroup",
    "RankRun",
    "RankSet",
    "RoleGroup",
    "Rule",
    "SeatedNode",
    "Seats",
    "WeightTransfer",
    "WorldPlan",
    "build_plan",
    "check_mode",
    "check_name",
    "check_role",
    "compress",
    "elide",
    "expand",
    "layout_groups",
    "node_sort_key",
    "plan_world",
    "seat",
]
