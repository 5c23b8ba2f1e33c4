"""Every use of torch.distributed internals, in one place, feature-detected.

commctx relies on three things torch does not promise:

  * `distributed_c10d._new_process_group_helper` (with `_get_default_group`,
    `_world.pg_map` and `_world.pg_group_ranks`), to create a group among its
    members only, under a name every member agrees on (process_groups.py
    says why torch's public member-only `new_group` cannot do this);
  * `distributed_c10d._abort_process_group`, to tear NCCL down without
    waiting on dead peers;
  * `TCPStore(..., master_listen_fd=...)`, a public constructor argument of
    recent releases, to serve the store on a socket rank 0 already holds.

When the installed torch lacks one, the call raises UsageError naming
the torch version and what is missing, instead of an AttributeError deep in a
join. Checked with torch 2.13.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import socket
from typing import Any

try:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
except ModuleNotFoundError as _exc:
    from . import worker_dependency_missing

    raise worker_dependency_missing(_exc, "commctx's workers (CommContext, commctx.elastic, torchrun's backend)") from None

from .errors import UsageError

TESTED_WITH = "2.13"


def _missing(what: str, purpose: str) -> UsageError:
    return UsageError(
        f"torch {torch.__version__} lacks {what}, which commctx uses to {purpose} (tested with torch {TESTED_WITH})"
    )


def _internal(obj: Any, name: str, where: str, purpose: str) -> Any:
    value = getattr(obj, name, None)
    if value is None:
        raise _missing(f"{where}.{name}", purpose)
    return value


@functools.cache
def _helper_keywords() -> frozenset[str]:
    helper = _internal(c10d, "_new_process_group_helper", "torch.distributed.distributed_c10d", "create member-only groups")
    return frozenset(inspect.signature(helper).parameters)


def new_member_group(ranks: list[int], backend: str, name: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """Creates a group of `ranks` (which include this rank) among its members only, named `name`.

    Raises:
        UsageError: this torch lacks the internals it needs.
    """
    purpose = "create member-only groups"
    where = "torch.distributed.distributed_c10d"
    accepted = _helper_keywords()  # first: a missing helper is named before anything is called
    default_pg = _internal(c10d, "_get_default_group", where, purpose)()
    world = _internal(c10d, "_world", where, purpose)
    pg_map = _internal(world, "pg_map", f"{where}._world", purpose)
    group_ranks = _internal(world, "pg_group_ranks", f"{where}._world", purpose)
    _, default_store = pg_map[default_pg]
    optional = {"timeout": timeout, "device_id": getattr(default_pg, "bound_device_id", None), "group_desc": name}
    pg, _ = c10d._new_process_group_helper(
        len(ranks), ranks.index(dist.get_rank()), ranks, backend, default_store, name,
        **{k: v for k, v in optional.items() if k in accepted},
    )
    group_ranks[pg] = {rank: i for i, rank in enumerate(ranks)}
    return pg


def abort_process_groups() -> None:
    """Aborts every process group (NCCL: without waiting on peers).

    Raises:
        UsageError: this torch cannot abort process groups.
    """
    _internal(c10d, "_abort_process_group", "torch.distributed.distributed_c10d", "tear NCCL down with dead peers")()


def can_abort() -> bool:
    return getattr(c10d, "_abort_process_group", None) is not None


def store_on_socket(host: str, port: int, world_size: int, timeout: datetime.timedelta, sock: socket.socket) -> dist.TCPStore:
    """Serves the job's TCPStore on `sock`, a socket this process holds in LISTEN.

    init_process_group('tcp://host:port') then finds this server through
    multi_tenant instead of binding a new one. The socket is handed over
    (detached) only once the store takes it.

    Raises:
        UsageError: this torch's TCPStore cannot take a listening socket.
    """
    try:
        store = dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                              multi_tenant=True, master_listen_fd=sock.fileno())
    except TypeError as exc:
        raise _missing("TCPStore(master_listen_fd=...)", "serve the store on the port rank 0 offered") from exc
    sock.detach()  # the store owns the descriptor now
    return store
