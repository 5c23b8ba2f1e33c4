"""The worker's view of its assignment: an immutable value built from the wire."""

from __future__ import annotations

import bisect
import dataclasses

from commctx.v1 import rendezvous_pb2 as pb


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """One group this worker belongs to."""

    mode: str
    index: int
    ranks: tuple[int, ...]
    group_rank: int
    cpu_twin: bool = False  # also build a gloo twin, registered as mode + "_CPU"
    root: int | None = None  # weight-transfer groups: the sender's global rank


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Everything the server decided for this worker, for one generation."""

    job_id: str
    member_id: str
    generation: int
    rank: int
    world_size: int
    node_rank: int
    num_nodes: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    dist_url: str
    groups: tuple[GroupInfo, ...]  # canonical creation order
    role: str = ""
    changed_groups: tuple[str, ...] = ()  # modes whose group differs from the previous generation's
    previous_rank: int | None = None  # this worker's rank in the previous generation
    reason: str = ""  # why this generation formed ("" for a job's first world)

    @classmethod
    def from_proto(cls, a: pb.Assignment, member_id: str) -> Assignment:
        groups = []
        for g in a.groups:
            ranks = tuple(
                r for run in g.ranks.runs
                for r in range(run.start, run.start + run.count * (run.stride or 1), run.stride or 1)
            )
            root = g.root if g.HasField("root") else None
            groups.append(GroupInfo(g.mode, g.index, ranks, bisect.bisect_left(ranks, a.rank), g.cpu_twin, root))
        return cls(
            job_id=a.job_id,
            member_id=member_id,
            generation=a.generation,
            rank=a.rank,
            world_size=a.world_size,
            node_rank=a.node_rank,
            num_nodes=a.num_nodes,
            local_rank=a.local_rank,
            local_world_size=a.local_world_size,
            master_addr=a.master_addr,
            master_port=a.master_port,
            dist_url=a.dist_url,
            groups=tuple(groups),
            role=a.role,
            changed_groups=tuple(a.changed_groups),
            previous_rank=a.previous_rank if a.HasField("previous_rank") else None,
            reason=a.reason,
        )

    def group(self, mode: str) -> GroupInfo | None:
        """This worker's group of `mode` (e.g. to find a weight-transfer group's root)."""
        return next((g for g in self.groups if g.mode == mode), None)

    def torch_env(self) -> dict[str, str]:
        """The variables torchrun would set for this worker."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
