"""What a CommContext join asks the server for: the caller's arguments,
completed from COMMCTX_* and, in an srun step, from Slurm, checked, as one
JoinRequest and the connection it goes over."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from commctx.v1 import rendezvous_pb2 as pb

from .addresses import server_addresses
from .arguments import check_count, check_job_secret, job_spec_of
from .credentials import Tls, check_token, tls_of
from .errors import InvalidArgument, UsageError
from .launcher import LauncherEnv
from .machine import default_node_key, host_id
from .slurm import SlurmStep


@dataclasses.dataclass(frozen=True)
class JoinArguments:
    """A join's request and where it goes; `from_slurm` names the values Slurm
    gave, which `slurm.check` holds against the server's assignment."""

    server_addr: str
    request: pb.JoinRequest
    tls: Tls | None
    token: str | None
    slurm: SlurmStep | None
    from_slurm: frozenset[str]


def join_arguments(launcher: LauncherEnv, *, server_addr: str | None, job_id: str | None, world_size: int | None,
                   node_key: str | None, local_rank: int | None, node_rank: int | None, role: str | None,
                   spec: Mapping[str, Any] | pb.JobSpec | None, tls_ca: str | None, tls_cert: str | None,
                   tls_key: str | None, token: str | None, job_secret: str | None) -> JoinArguments:
    """The join CommContext.join's arguments ask for (see its docstring), with
    what they leave open taken from `launcher`.

    Raises:
        UsageError: no server or no job is given, or a TLS certificate without its key.
        InvalidArgument: job_id is not a string, world_size not a positive
            integer, a server address not host:port, a malformed token or job secret.
        InvalidRequest: a `spec` dict that is not a JobSpec.
    """
    addr_source = "server_addr" if server_addr else "COMMCTX_SERVER"
    server_addr = server_addr or launcher.server
    slurm = launcher.slurm  # a task of an srun step: Slurm gives what neither the caller nor COMMCTX_* did
    job_id = job_id or launcher.job_id or (slurm.job if slurm is not None else None)
    if not server_addr:
        raise UsageError("no rendezvous server: pass server_addr or set COMMCTX_SERVER=host:port")
    if not job_id:
        raise UsageError("no job: pass job_id or set COMMCTX_JOB_ID")
    if not isinstance(job_id, str):
        raise InvalidArgument(f"job_id must be a string, not {type(job_id).__name__}")
    from_slurm: set[str] = set()  # the values Slurm gave: checked against the server's after the join
    if slurm is not None and world_size is None and slurm.ntasks is not None:
        world_size = slurm.ntasks
        from_slurm.add("world_size")
    # Slurm's node and local ranks are this world's only when the world is the whole step
    # (another world_size splits it) and forms at once (an elastic spec's may form smaller).
    elastic = spec.HasField("elastic") if isinstance(spec, pb.JobSpec) else isinstance(spec, Mapping) and "elastic" in spec
    if slurm is not None and world_size == slurm.ntasks and not elastic:
        if node_rank is None and slurm.nodeid is not None:
            node_rank = slurm.nodeid
            from_slurm.add("node_rank")
        if local_rank is None and slurm.localid is not None:
            local_rank = slurm.localid
            from_slurm.add("local_rank")
    else:
        from_slurm.clear()
    check_count("world_size", world_size, "the number of workers in the job")
    try:
        server_addresses(server_addr)
    except InvalidArgument as exc:
        if addr_source == "server_addr":
            raise
        raise InvalidArgument(f"COMMCTX_SERVER: {exc}") from None
    if token is not None:
        check_token(token, "token=")
    elif launcher.token is not None:
        token = check_token(launcher.token, "COMMCTX_TOKEN")
    if job_secret is not None:
        check_job_secret(job_secret, "job_secret=")
    elif launcher.job_secret is not None:
        job_secret = check_job_secret(launcher.job_secret, "COMMCTX_JOB_SECRET")
    request = pb.JoinRequest(
        job_id=job_id, spec=job_spec_of(spec, world_size), role=role or "",
        job_secret=job_secret or "",
        node_key=node_key or (slurm and slurm.node_name) or default_node_key(), local_rank=local_rank, node_rank=node_rank,
        host_id="" if node_key else host_id(),  # a key pinned on purpose is not checked against the machine
    )
    tls = tls_of(tls_ca, tls_cert, tls_key, launcher.tls_ca, launcher.tls_cert, launcher.tls_key)
    return JoinArguments(server_addr, request, tls, token, slurm, frozenset(from_slurm))
