"""Applies the server's group plan to torch.distributed.

Every worker creates only the groups it belongs to, in the plan's canonical
order: only members take part in creating a group (as with torch's
use_local_synchronization), and because all members of two overlapping groups
create them in the same relative order, creation cannot deadlock. A group
holding the whole world is the default group itself. A group marked cpu_twin
is followed by its gloo twin (the same group when the backend is gloo
already), registered as MODE_CPU.

Each group is named "commctx/<job>/<generation>/<mode>/<index>/<backend>" and
its store keys live under that name. torch's own member-only new_group names a
group by a hash of its ranks and of how many groups the caller created before,
which differs between members whenever one of them holds a group of an earlier
mode that another lacks (a trainer's TRAIN_DATA_PARALLEL before the
WEIGHT_TRANSFER group it shares with rollout workers): the members then wait
under different names forever. Naming groups after the plan avoids that and
keeps a stale process of an older generation out of a newer world's groups.
The torch internals this needs are in _torch.py.

Members-only creation is faster than every rank creating every group and than
new_subgroups_by_enumeration (benchmarks/group_build.py; the numbers are in
docs/benchmarks.md). split_group, which would use ncclCommSplit, needs a
default group bound to an accelerator and has no gloo form.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterable

import torch
import torch.distributed as dist

from commctx.common.modes import GLOBAL, cpu_twin

from . import _torch
from .assignment import GroupInfo
from .errors import UsageError
from .registry import GroupRecord


def init_world(world_size: int | None, rank: int | None, backend: str, dist_url: str, timeout: datetime.timedelta,
               local_rank: int | None = None) -> GroupRecord:
    """Initialises the default process group; returns its GLOBAL record.

    With NCCL the CUDA device is set from `local_rank` first; CUDA is never
    touched otherwise.

    Raises:
        UsageError: NCCL, but this local rank has no GPU of its own.
    """
    if backend == "nccl":
        if local_rank is None:
            raise UsageError("local rank unknown: join a rendezvous or set LOCAL_RANK")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise UsageError(f"local rank {local_rank} has no GPU of its own: this node has {count}")
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend=backend, init_method=dist_url, timeout=timeout,
        world_size=-1 if world_size is None else world_size, rank=-1 if rank is None else rank,
    )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return GroupRecord(GLOBAL, dist.group.WORLD, tuple(range(world_size)), rank)


def build_groups(
    groups: Iterable[GroupInfo], *, job_id: str, generation: int, world_size: int, backend: str, timeout: datetime.timedelta
) -> list[GroupRecord]:
    """Creates the process groups of `groups` (all of which contain this rank)."""

    def create(g: GroupInfo, group_backend: str) -> dist.ProcessGroup:
        if (g.mode == GLOBAL or len(g.ranks) == world_size) and group_backend == backend:
            return dist.group.WORLD
        name = f"commctx/{job_id}/{generation}/{g.mode}/{g.index}/{group_backend}"
        return _torch.new_member_group(list(g.ranks), group_backend, name, timeout)

    built = []
    for g in groups:
        pg = create(g, backend)
        built.append(GroupRecord(g.mode, pg, g.ranks, g.group_rank))
        if g.cpu_twin:
            twin = pg if backend == "gloo" else create(g, "gloo")
            built.append(GroupRecord(cpu_twin(g.mode), twin, g.ranks, g.group_rank))
    return built


def destroy_all(timeout_s: float) -> bool:
    """Destroys every process group; gives up waiting after `timeout_s`.

    NCCL can block in destroy while a peer is dead, so it is aborted instead.

    Returns:
        Whether the teardown finished in time.
    """
    if dist.get_backend() == "nccl" and _torch.can_abort():
        target = _torch.abort_process_groups
    else:
        target = dist.destroy_process_group
    worker = threading.Thread(target=target, name="commctx-destroy", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return not worker.is_alive()
