"""A worker that torchrun started with --rdzv-backend=commctx (see torchrun.py):
its agent holds the membership, so the worker only reads its assignment from
the agent's file, checks it against torchrun's variables, and builds its world."""

from __future__ import annotations

import datetime

from google.protobuf.message import DecodeError

from commctx.v1 import rendezvous_pb2 as pb

from .assignment import Assignment
from .errors import UsageError
from .launcher import LauncherEnv
from .registry import GroupRegistry
from .world import enter_world, leave_world

WORLD_ENV = "COMMCTX_TORCHRUN_WORLD"  # the file of this generation's assignments, written by the agent's handler


class LaunchedWorker:
    """A worker of a torchrun job on commctx: its assignment comes from the
    agent's handler (COMMCTX_TORCHRUN_WORLD), its lease is the agent's, and the
    agent restarts it when the world changes."""

    session = None

    def __init__(self, assignment: Assignment, backend: str, collective_timeout_s: int) -> None:
        self.assignment = assignment
        self.backend = backend
        self._timeout = datetime.timedelta(seconds=collective_timeout_s)

    @classmethod
    def from_launcher(cls, launcher: LauncherEnv, *, job_id: str | None, world_size: int | None, backend: str,
                      collective_timeout_s: int) -> LaunchedWorker:
        """This worker's assignment, from the agent's file (launcher.torchrun_world),
        checked against torchrun's variables.

        Raises:
            UsageError: the file is missing, or it disagrees with torchrun or the arguments.
        """
        path = launcher.torchrun_world
        try:
            with open(path, "rb") as f:
                world = pb.JoinResponse.FromString(f.read())
            if launcher.local_rank is None:
                raise ValueError("torchrun did not set LOCAL_RANK")
            a = Assignment.from_proto(world.worker_assignments[launcher.local_rank], "")
        except (OSError, ValueError, IndexError, DecodeError) as exc:
            raise UsageError(f"cannot read this worker's assignment from {WORLD_ENV}={path}: {exc}") from None
        expected = {"RANK": (launcher.rank, a.rank), "GROUP_RANK": (launcher.group_rank, a.node_rank),
                    "WORLD_SIZE": (launcher.world_size, a.world_size), "LOCAL_WORLD_SIZE": (launcher.local_world_size, a.local_world_size)}
        for name, (given, assigned) in expected.items():
            if given != assigned:
                said = f"torchrun set {name}={given}" if given is not None else f"torchrun did not set {name}"
                raise UsageError(f"{said} but the rendezvous server assigned {assigned} "
                                       f"(generation {a.generation} of job {a.job_id!r})")
        if job_id is not None and job_id != a.job_id:
            raise UsageError(f"job_id {job_id!r} disagrees with torchrun's --rdzv-id {a.job_id!r}")
        if world_size is not None and world_size != a.world_size:
            raise UsageError(f"world_size {world_size} disagrees with torchrun's world of {a.world_size}")
        return cls(a, backend, collective_timeout_s)

    def enter(self, registry: GroupRegistry) -> None:
        """torch.distributed through torchrun's env:// (the agent's store), then every group."""
        enter_world(registry, self.assignment, self.backend, "env://", self._timeout)

    def close(self, registry: GroupRegistry) -> None:
        leave_world(registry)

