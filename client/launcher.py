"""What a launcher (torchrun, Slurm, the user) put in the environment: the one
place CommContext and the torchrun handler read its variables."""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Mapping

from .errors import UsageError
from .slurm import SlurmStep

log = logging.getLogger("commctx")

# Variables renamed: the old name is read, with a warning, when the new one is not set.
RENAMED_VARIABLES = {"COMMCTX_JOB_ID": "COMMCTX_JOB"}
_warned_renamed: set[str] = set()  # old names warned about in this process (once each)


@dataclasses.dataclass(frozen=True)
class LauncherEnv:
    """What a launcher (torchrun, Slurm scripts, the user) put in the environment.

    The only place CommContext and the torchrun handler read environment
    variables (the `commctx` console tool reads its own).
    """

    local_rank: int | None = None
    local_world_size: int | None = None
    rank: int | None = None  # RANK, GROUP_RANK, WORLD_SIZE: read under torchrun on commctx only, to check the assignment
    group_rank: int | None = None
    world_size: int | None = None
    gloo_socket_ifname: str | None = None
    nccl_socket_ifname: str | None = None
    tls_ca: str | None = None  # COMMCTX_TLS_*: TLS to the rendezvous server
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None  # COMMCTX_TOKEN: the bearer token the server requires
    job_secret: str | None = None  # COMMCTX_JOB_SECRET: seals the job (the first join) or opens it
    server: str | None = None  # COMMCTX_SERVER: the rendezvous server's host:port (or replica list)
    job_id: str | None = None  # COMMCTX_JOB_ID (or its deprecated name COMMCTX_JOB): the job to join
    torchrun_world: str | None = None  # COMMCTX_TORCHRUN_WORLD under torchrun: the agent's file of assignments
    progress_s: str | None = None  # COMMCTX_PROGRESS_S: seconds between "waiting for ..." lines (0: none)
    share_host: str | None = None  # COMMCTX_SHARE_HOST: "0" gives every worker a membership of its own
    slurm: SlurmStep | None = None  # SLURM_*: this task's place in its srun step (not under torchrun)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LauncherEnv:
        """Reads the launcher variables. An empty variable counts as unset.

        COMMCTX_JOB, the deprecated name of COMMCTX_JOB_ID, is read when
        COMMCTX_JOB_ID is not set (so that scripts that set it keep working):
        with a DeprecationWarning and (once per process) a warning on the
        `commctx` logger naming the new variable.

        Slurm's variables are read in a task of an srun step (SLURM_STEP_ID
        and SLURM_PROCID set) that torchrun did not start (TORCHELASTIC_RUN_ID
        unset): see commctx.slurm.SlurmStep.from_env.

        Raises:
            UsageError: LOCAL_RANK or LOCAL_WORLD_SIZE (under torchrun
                on commctx also RANK, GROUP_RANK or WORLD_SIZE) is set but not
                a non-negative integer; in an srun step, a Slurm variable is
                malformed (the message names it).
        """
        env = os.environ if env is None else env

        def number(name: str) -> int | None:
            raw = env.get(name)
            if raw is None or raw == "":
                return None
            try:
                value = int(raw)
            except ValueError:
                value = -1
            if value < 0:
                raise UsageError(f"{name}={raw!r} is not a non-negative integer")
            return value

        torchrun_world = (env.get("COMMCTX_TORCHRUN_WORLD") or None) if env.get("TORCHELASTIC_RUN_ID") else None
        return cls(
            local_rank=number("LOCAL_RANK"),
            local_world_size=number("LOCAL_WORLD_SIZE"),
            rank=number("RANK") if torchrun_world else None,
            group_rank=number("GROUP_RANK") if torchrun_world else None,
            world_size=number("WORLD_SIZE") if torchrun_world else None,
            gloo_socket_ifname=env.get("GLOO_SOCKET_IFNAME") or None,
            nccl_socket_ifname=env.get("NCCL_SOCKET_IFNAME") or None,
            tls_ca=env.get("COMMCTX_TLS_CA") or None,
            tls_cert=env.get("COMMCTX_TLS_CERT") or None,
            tls_key=env.get("COMMCTX_TLS_KEY") or None,
            token=env.get("COMMCTX_TOKEN") or None,
            job_secret=env.get("COMMCTX_JOB_SECRET") or None,
            server=env.get("COMMCTX_SERVER") or None,
            job_id=_renamed(env, "COMMCTX_JOB_ID"),
            torchrun_world=torchrun_world,
            progress_s=env.get("COMMCTX_PROGRESS_S") or None,
            share_host=env.get("COMMCTX_SHARE_HOST") or None,
            slurm=SlurmStep.from_env(env),
        )


def _renamed(env: Mapping[str, str], name: str) -> str | None:
    """The value of variable `name`, else of its old name (RENAMED_VARIABLES), with a warning."""
    value = env.get(name) or None
    old = RENAMED_VARIABLES[name]
    if value is None and env.get(old):
        message = f"{old} is deprecated: set {name} instead ({old} is read only while {name} is unset)"
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        if old not in _warned_renamed:
            _warned_renamed.add(old)
            log.warning("%s", message)
        value = env[old]
    return value
