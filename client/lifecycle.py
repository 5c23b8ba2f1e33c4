"""A worker's life in a job: join, enter each world, rejoin, leave.

`Membership` owns what that life holds: the session with the server, the
spare listening socket (a port the server may hand to this worker when it
becomes rank 0 of a world: no "bind port 0, close, hope" race), the TCPStore
this process serves while it is rank 0, and the launcher variables it
exported. The groups it builds go into the caller's GroupRegistry.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import ipaddress
import logging
import math
import os
import socket
import time
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
from google.protobuf import json_format

from commctx.v1 import rendezvous_pb2 as pb

from . import _torch
from .assignment import Assignment
from .errors import InvalidArgument, InvalidRequest, ServerUnavailable, UsageError
from .host import HostJob, LocalSession, host_worker, link_paths
from .netif import interface_of, listen_socket, route_source_address
from .progress import DEFAULT_EVERY_S
from .registry import GroupRegistry
from .session import Session
from .slurm import SlurmStep
from .transport import Tls, server_addresses
from .world import Peer, World, enter_world, kept_peers, leave_world

log = logging.getLogger("commctx")

# Variables renamed: the old name is still read, with a warning, when the new one is not set.
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
    job_id: str | None = None  # COMMCTX_JOB_ID (formerly COMMCTX_JOB, still read): the job to join
    torchrun_world: str | None = None  # COMMCTX_TORCHRUN_WORLD under torchrun: the agent's file of assignments
    progress_s: str | None = None  # COMMCTX_PROGRESS_S: seconds between "waiting for ..." lines (0: none)
    share_host: str | None = None  # COMMCTX_SHARE_HOST: "0" gives every worker a membership of its own
    slurm: SlurmStep | None = None  # SLURM_*: this task's place in its srun step (not under torchrun)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LauncherEnv:
        """Reads the launcher variables. An empty variable counts as unset.

        COMMCTX_JOB, the job's variable in commctx's own example and compose
        file before it was named COMMCTX_JOB_ID, is still read when
        COMMCTX_JOB_ID is not set: with a DeprecationWarning and (once per
        process) a warning on the `commctx` logger naming the new variable.

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


def job_spec_of(spec: Mapping[str, Any] | pb.JobSpec | None, world_size: int) -> pb.JobSpec:
    """The wire JobSpec for `spec` (a message, its JSON form as a dict, or None).

    Raises:
        InvalidRequest (a ValueError): the dict is not a JobSpec (the message
            names an unknown key and where it is), or its world_size disagrees.
    """
    if spec is None:
        out = pb.JobSpec()
    elif isinstance(spec, pb.JobSpec):
        out = pb.JobSpec()
        out.CopyFrom(spec)
    else:
        if not isinstance(spec, Mapping):
            raise InvalidRequest("INVALID_ARGUMENT", f"spec is not a JobSpec: expected a dict or a JobSpec, got {type(spec).__name__}")
        problem = _spec_problem(spec, pb.JobSpec.DESCRIPTOR, "spec")
        if problem:
            raise InvalidRequest("INVALID_ARGUMENT", f"spec is not a JobSpec: {problem}")
        try:
            out = json_format.ParseDict(dict(spec), pb.JobSpec())
        except json_format.ParseError as exc:
            why = str(exc).splitlines()[0].rstrip(".")[:300]
            raise InvalidRequest("INVALID_ARGUMENT", f"spec is not a JobSpec: {why}") from None
    if out.world_size and out.world_size != world_size:
        raise InvalidRequest("INVALID_ARGUMENT", f"spec.world_size {out.world_size} disagrees with world_size {world_size}")
    out.world_size = world_size
    return out


def _spec_problem(value: Mapping[str, Any], descriptor: Any, path: str) -> str:
    """What is wrong with the shape of `value` as a `descriptor` message:
    the first key (here or in the messages nested in it) that names no field,
    or a message field that is not a dict (a repeated one not a list); ""
    when nothing is. Values themselves are left to json_format."""
    for key, item in value.items():
        field = None
        if isinstance(key, str):  # the proto name or its JSON (camelCase) name
            field = descriptor.fields_by_name.get(key) or descriptor.fields_by_camelcase_name.get(key)
        if field is None:
            known = ", ".join(f.name for f in descriptor.fields)
            return f"unknown key {key!r} in {path} (known keys: {known})"
        if item is None or field.message_type is None or field.message_type.full_name.startswith("google.protobuf."):
            continue  # None: JSON null, the field left out
        if field.is_repeated and not isinstance(item, list):
            return f"{path}.{key} must be a list, not {type(item).__name__}"
        for i, sub in enumerate(item) if field.is_repeated else [(None, item)]:
            where = f"{path}.{key}" + (f"[{i}]" if i is not None else "")
            if not isinstance(sub, Mapping):
                return f"{where} must be an object (a dict), not {type(sub).__name__}"
            found = _spec_problem(sub, field.message_type, where)
            if found:
                return found
    return ""


def torch_backends() -> tuple[list[str], list[str]]:
    """The backends this torch knows (torch.distributed.Backend's list, with
    third-party ones registered; not 'undefined'), and those of them built
    into it, as far as torch can tell."""
    known = [b for b in dist.Backend.backend_list if b != dist.Backend.UNDEFINED]
    built = []
    for b in known:
        try:
            if hasattr(dist, "is_backend_available"):  # torch >= 2.3: plugins too
                ok = dist.is_backend_available(b)
            else:
                check = getattr(dist, f"is_{b}_available", None)
                ok = check() if check is not None else True
        except Exception:  # noqa: BLE001 - a plugin's own check failing: not available
            ok = False
        if ok:
            built.append(b)
    return known, built


_TEST_BACKENDS = ("fake",)  # torch's backend for tests: accepted, never suggested


def check_backend(backend: str | None) -> str:
    """The lower-cased name of `backend` ('auto' for None), when torch knows it.

    Accepts 'auto', a backend of torch.distributed.Backend (gloo, nccl, ucc,
    mpi, xccl and registered third-party ones), or torch's per-device form
    'cpu:gloo,cuda:nccl' of those.

    Raises:
        InvalidArgument: torch knows no such backend (the message lists those
            it has and suggests the closest name), or this torch was built
            without it.
    """
    if backend is None:
        return "auto"
    if not isinstance(backend, str):
        raise InvalidArgument(f"backend must be a string such as 'auto', 'gloo' or 'nccl', not {type(backend).__name__}")
    name = backend.strip().lower()
    if name == "auto":
        return name
    known, built = torch_backends()
    shown = [b for b in known if b not in _TEST_BACKENDS]
    parts = [p.partition(":")[2] if ":" in p else p for p in name.split(",")] if ":" in name else [name]
    for part in parts:
        if part not in known:
            close = difflib.get_close_matches(part, [*shown, "auto"], n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidArgument(
                f"backend {backend[:64]!r} is not a torch.distributed backend{hint}: give 'auto' or one of "
                f"{', '.join(shown)} (built into this torch {torch.__version__}: "
                f"{', '.join(b for b in built if b not in _TEST_BACKENDS) or 'none'})")
        if part not in built and part != "nccl":  # nccl without CUDA: resolve_backend says why
            raise InvalidArgument(
                f"backend {part!r} is not built into this torch ({torch.__version__}): give 'auto' or one of "
                f"{', '.join(b for b in built if b not in _TEST_BACKENDS) or 'none'}")
    return name


def resolve_backend(backend: str | None) -> str:
    """'auto' (or None) -> 'nccl' when CUDA is available, else 'gloo'; any
    other name as check_backend accepts it.

    Raises:
        InvalidArgument: torch has no such backend (see check_backend).
        UsageError: 'nccl' was asked for but no CUDA device is visible.
    """
    name = check_backend(backend)
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise UsageError("backend 'nccl' needs a CUDA device and none is visible; use 'gloo' or 'auto'")
    return name


def check_seconds(name: str, value: float, what: str) -> float:
    """Returns `value` if it is a positive, finite number of seconds.

    Raises:
        InvalidArgument: it is not (the message names `name` and says `what` it is).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive number of seconds ({what}), not {_shown(value)}")
    return value


def progress_seconds(value: float | None, launcher: LauncherEnv) -> float:
    """How often a waiting join says who it waits for: `value`, else
    COMMCTX_PROGRESS_S, else every 10 s; 0 silences it.

    Raises:
        InvalidArgument: not a number of seconds of at least 0.
    """
    name = "progress_interval"
    if value is None and launcher.progress_s is not None:
        name, value = "COMMCTX_PROGRESS_S", launcher.progress_s
        try:
            value = float(value)
        except ValueError:
            raise InvalidArgument(f"COMMCTX_PROGRESS_S must be a number of seconds (0: no progress lines), "
                                  f"not {_shown(launcher.progress_s)}") from None
    if value is None:
        return DEFAULT_EVERY_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{name} must be a number of seconds (0: no progress lines), not {_shown(value)}")
    return float(value)


def share_host_of(value: bool | None, launcher: LauncherEnv) -> bool:
    """Whether workers of one host share a membership: `value`, else
    COMMCTX_SHARE_HOST ("0", "false", "no", "off": no), else yes.

    Raises:
        InvalidArgument: not True, False or None; a variable that is not a yes or no.
    """
    if value is not None:
        if not isinstance(value, bool):
            raise InvalidArgument(f"share_host must be True or False, not {_shown(value)}")
        return value
    raw = (launcher.share_host or "1").strip().lower()
    if raw not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise InvalidArgument(f"COMMCTX_SHARE_HOST must be 1 or 0 (true/false, yes/no, on/off), not {_shown(launcher.share_host)}")
    return raw in ("1", "true", "yes", "on")


def check_count(name: str, value: int | None, what: str, *, minimum: int = 1, optional: bool = False) -> int | None:
    """Returns `value` if it is an integer >= `minimum` (None too when `optional`).

    Raises:
        InvalidArgument: it is not (a bool, a string, a float or too small).
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        given = "not given" if value is None else f"not {_shown(value)}"
        raise InvalidArgument(f"{name} must be {kind} ({what}), {given}")
    return value


JOB_SECRET_MIN, JOB_SECRET_MAX = 16, 256


def check_job_secret(secret: str, source: str) -> str:
    """Returns `secret` if it can seal a job: 16-256 printable ASCII characters
    without spaces. `source` names where it came from ("job_secret=",
    "COMMCTX_JOB_SECRET").

    Raises:
        InvalidArgument: one line naming `source` and what is wrong, with the
            secret's length but never the secret itself.
    """
    if not isinstance(secret, str):
        raise InvalidArgument(f"{source}: a job secret is a string, not {type(secret).__name__}")
    rule = f"a job secret is {JOB_SECRET_MIN}-{JOB_SECRET_MAX} printable ASCII characters without spaces"
    if not secret:
        raise InvalidArgument(f"{source} is empty: {rule}, or leave it out for an open job")
    problem = ("has a space" if any(c.isspace() for c in secret) else
               "has a non-ASCII character" if not secret.isascii() else
               "has a control character" if not secret.isprintable() else
               "is too short" if len(secret) < JOB_SECRET_MIN else
               "is too long" if len(secret) > JOB_SECRET_MAX else "")
    if problem:
        length = f"{len(secret)} character{'s' * (len(secret) != 1)}"
        raise InvalidArgument(f"{source} is not a usable job secret ({length}; it {problem}): {rule}")
    return secret


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def advertised_address(server_addr: str, advertise_addr: str | None, timeout_s: float = 0.0) -> str:
    """The IP this worker (or agent) gives peers: `advertise_addr`, else the
    local address of its route to the (first) server. A server's name that
    does not resolve yet (or a host without a route yet) is waited for up to
    `timeout_s` (session.route_source: with the join's warnings).

    Raises:
        InvalidRequest: `advertise_addr` is not an IP address.
        InvalidArgument: `server_addr` is not host:port (transport.server_addresses).
        ServerUnavailable: the server's host does not resolve or has no route (within `timeout_s`).
    """
    if advertise_addr:
        try:
            return str(ipaddress.ip_address(advertise_addr))
        except ValueError:
            raise InvalidRequest("INVALID_ARGUMENT", f"advertise address {advertise_addr!r} is not an IP address") from None
    host, port = server_addresses(server_addr)[0]  # of several replicas, the route to the first
    try:
        return str(ipaddress.ip_address(route_source_address(host, port)))
    except OSError as exc:  # e.g. a host name that does not resolve (yet)
        if timeout_s > 0:
            from .session import route_source

            return str(ipaddress.ip_address(route_source(server_addr, host, port, timeout_s)))
        raise ServerUnavailable("UNAVAILABLE", f"cannot reach rendezvous server {server_addr}: host {host!r}: "
                                f"{exc.strerror or exc}") from None


def listen_on(address: str) -> socket.socket:
    try:
        return listen_socket(address)
    except OSError:  # an address that is not on a local interface (NAT): listen everywhere
        return listen_socket("::" if ":" in address else "0.0.0.0")


class Membership:
    """One worker's membership in one job. Create with `Membership.join`.

    With `abort_on_change`, the session thread aborts the current world's
    process groups as soon as the server says members of it went without a
    Leave (a lease expired, a session closed), or this membership ended for
    another reason than its job finishing: a collective blocked on a dead or
    hung peer raises then instead of at torch's timeout (world.py says how)."""

    def __init__(self, session: Session | LocalSession, address: str, backend: str, collective_timeout_s: int,
                 spare: socket.socket | None, env: MutableMapping[str, str], *, abort_on_change: bool = True,
                 keep: Peer = lambda peer: False) -> None:
        self.session = session
        self.address = address
        self.backend = backend
        self._timeout = datetime.timedelta(seconds=collective_timeout_s)
        self._spare: socket.socket | None = spare
        self._store: dist.TCPStore | None = None
        self._env = env
        self._env_saved: dict[str, str | None] = {}
        self._world: World | None = None
        self._keep = keep
        if abort_on_change:
            session.on_world_ended(self._world_ended)

    @classmethod
    def join(cls, server_addr: str, request: pb.JoinRequest, *, advertise_addr: str | None, backend: str,
             timeout_s: float, collective_timeout_s: int, env: MutableMapping[str, str] | None = None,
             progress_s: float = DEFAULT_EVERY_S, abort_on_change: bool = True, share_host: bool = False,
             tls: Tls | None = None, token: str | None = None) -> Membership:
        """Joins with `request` (job, spec, node and rank fields) and blocks until
        placed in a world. The address and spare port are filled in here. With
        `share_host`, the workers of this job and node key on this machine share
        one membership (host.py): this worker joins it through its host's hub.

        Raises:
            InvalidArgument: `server_addr` is not host:port, or the token is malformed.
            RendezvousError: the server refused the join or the world did not form in time.
        """
        started = time.monotonic()
        address = advertised_address(server_addr, advertise_addr, timeout_s)  # waits for a name that resolves late
        waited = time.monotonic() - started
        if waited > 0.1:  # the name came late: the join has what is left of its timeout
            timeout_s = max(0.1, round(timeout_s - waited, 1))
        env = os.environ if env is None else env
        keep = kept_peers(server_addresses(server_addr))
        if share_host:
            if tls is not None:
                tls.credentials()  # a TLS file that cannot be read fails here, in the worker that names it
            request.address = address
            worker = host_worker(request.role, request.local_rank if request.HasField("local_rank") else None, timeout_s)
            request.ClearField("role")
            request.ClearField("local_rank")
            local = LocalSession(server_addr, HostJob(server_addr, request, tls, token),
                                 link_paths(server_addr, request.job_id, request.node_key), worker)
            try:
                local.join(timeout_s, progress_s)
            except BaseException:
                local.close(leave=False)
                raise
            return cls(local, address, backend, collective_timeout_s, None, env, abort_on_change=abort_on_change, keep=keep)
        session = Session(server_addr, tls, token)  # first: a TLS file that cannot be read fails before any socket is held
        try:
            spare = listen_on(address)
        except BaseException:
            session.close(leave=False)
            raise
        request.address = address
        request.master_port = spare.getsockname()[1]
        try:
            session.join(request, timeout_s, progress_s)
        except BaseException:
            spare.close()
            session.close(leave=False)
            raise
        return cls(session, address, backend, collective_timeout_s, spare, env, abort_on_change=abort_on_change, keep=keep)

    @property
    def assignment(self) -> Assignment:
        return self.session.assignment

    def _world_ended(self, before: float, reason: str) -> None:
        """The session's news: worlds older than generation `before` are over."""
        world = self._world
        if world is not None and world.generation < before:
            world.abort(reason)

    def enter(self, registry: GroupRegistry, timeout_s: float) -> None:
        """Initialises torch.distributed for the current assignment and registers its groups.

        A world that is aborted while it is being built (a peer went, or the
        next world formed meanwhile) is left for the next one, until
        `timeout_s` has passed.

        Raises:
            MemberNotFound: the member is gone or the job cannot continue.
            RendezvousTimeout: no world entered within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._enter(registry)
                return
            except Exception as exc:
                world = self._world
                if world is None or not world.aborted or time.monotonic() >= deadline:
                    raise
                log.warning("generation %d ended while its world was being built (%s: %s); taking the next",
                            world.generation, world.aborted, str(exc).splitlines()[0][:200])
            self.leave_world(registry)
            self.session.next_assignment(max(0.0, deadline - time.monotonic()))

    def _enter(self, registry: GroupRegistry) -> None:
        """Rank 0 serves the TCPStore on its spare socket, whose port the server
        gave out as the master port, then offers a new spare for later worlds."""
        a = self.session.assignment
        self._export_env(a)
        if a.rank == 0:
            hosted = isinstance(self.session, LocalSession)  # the host's hub holds the spare and passed it on
            if hosted:
                spare = self.session.take_spare(a.generation, a.master_port)
            else:
                spare, self._spare = self._spare, None
            if spare is None or spare.getsockname()[1] != a.master_port:
                raise UsageError(f"the server made this worker rank 0 on port {a.master_port}, which it does not hold")
            self._store = _torch.store_on_socket(a.master_addr, a.master_port, a.world_size, self._timeout, spare)
            if not hosted:
                self._spare = listen_on(self.address)
                self.session.offer_spare(self._spare.getsockname()[1])
        self._world = World(a.generation, self._keep)  # before anything connects: an abort finds it
        enter_world(registry, a, self.backend, a.dist_url, self._timeout, world=self._world)
        log.info(
            "joined job=%s generation=%d rank=%d/%d node_rank=%d local_rank=%d master=%s",
            a.job_id, a.generation, a.rank, a.world_size, a.node_rank, a.local_rank, a.dist_url,
        )

    def rejoin(self, registry: GroupRegistry, timeout_s: float) -> None:
        """Leaves the current world and enters the next one the server assigns.

        Raises:
            MemberNotFound: the member is gone or the job cannot continue.
            RendezvousTimeout: no new world within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        self.leave_world(registry)
        self.session.next_assignment(timeout_s)
        self.enter(registry, max(0.0, deadline - time.monotonic()))

    def leave_world(self, registry: GroupRegistry) -> None:
        """Destroys the process groups (no barrier, bounded time) and forgets them."""
        world, self._world = self._world, None
        if world is not None:
            world.leave(registry)
        else:
            leave_world(registry)
        self._store = None

    def close(self, registry: GroupRegistry) -> None:
        """Leaves the job (best effort), the world, and restores the environment. Idempotent."""
        self.session.close()
        self.leave_world(registry)
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        for key, value in self._env_saved.items():
            if value is None:
                self._env.pop(key, None)
            else:
                self._env[key] = value
        self._env_saved.clear()

    def _export_env(self, a: Assignment) -> None:
        """Sets the variables torchrun would, and the interface gloo/NCCL should use."""
        values = a.torch_env()
        ifname = interface_of(self.address)
        launcher = LauncherEnv.from_env(self._env)
        ours = self._env_saved  # variables this membership set (and may set again)
        # gloo and NCCL pick the interface that carries our advertised address,
        # unless the user chose one. Without this, gloo resolves the hostname,
        # which in containers and namespaces often means 127.0.0.1.
        if ifname is not None:
            if launcher.gloo_socket_ifname is None or "GLOO_SOCKET_IFNAME" in ours:
                values["GLOO_SOCKET_IFNAME"] = ifname
            if self.backend == "nccl" and (launcher.nccl_socket_ifname is None or "NCCL_SOCKET_IFNAME" in ours):
                values["NCCL_SOCKET_IFNAME"] = ifname
        for key, value in values.items():
            self._env_saved.setdefault(key, self._env.get(key))
            self._env[key] = value
