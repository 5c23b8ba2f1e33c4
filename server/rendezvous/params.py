"""What a caller sends, validated: the Join's parameters, the ids of jobs and
members, and the secrets that seal a job or bind a membership (kept only as
SHA-256 digests, compared in constant time). Pure: no asyncio, no grpc."""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import NamedTuple

from commctx.common.addresses import canonical_ip
from commctx.common.planning import NODE_KEY, JobSpec, check_name, check_role, elide

from ..errors import BadRequest, LimitExceeded

JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MEMBER_ID = re.compile(r"[0-9a-f]{1,64}")
CLIENT_MEMBER_ID = re.compile(r"[0-9a-f]{16,64}")
HOST_ID = re.compile(r"[0-9a-f]{8,64}")
MEMBER_SECRET = re.compile(r"[0-9a-f]{32,128}")
# Workers of one node membership (its Join answers with each one's assignment): 1,024, above any launcher's
# processes per node, so that its answer stays a small message (encoded in slices, codec.join_slices); worlds:
# --max-world-size.
MAX_NODE_WORKERS = 1024


def check_job_id(value: str) -> str:
    if not value:
        raise BadRequest("job_id is empty")
    if len(value) > 128:
        raise BadRequest(f"job_id {elide(value, 32)} is {len(value)} characters; at most 128 allowed")
    return check_name("job_id", value, JOB_ID, "use letters, digits, '.', '_' and '-', starting with a letter or digit")


def check_member_id(value: str) -> str:
    if not value:
        raise BadRequest("member_id is empty")
    return check_name("member_id", value, MEMBER_ID, "a member id is the hex string Join returned")


def secret_digest(secret: str) -> str:
    """The SHA-256 digest (hex) under which a member secret is kept.

    Raises:
        BadRequest: the secret is malformed (the message never echoes it).
    """
    if not MEMBER_SECRET.fullmatch(secret):
        raise BadRequest(f"member_secret is malformed ({len(secret)} characters): give 32-128 lowercase hex digits")
    return hashlib.sha256(secret.encode()).hexdigest()


def job_secret_digest(secret: str) -> str:
    """The SHA-256 digest (hex) under which a job secret is kept.

    Raises:
        BadRequest: the secret is malformed (the message never echoes it).
    """
    if not 16 <= len(secret) <= 256 or not secret.isascii() or not secret.isprintable() or " " in secret:
        raise BadRequest(f"job_secret is malformed ({len(secret)} characters): give 16-256 printable ASCII characters, "
                              f"no spaces")
    return hashlib.sha256(b"job:" + secret.encode()).hexdigest()


def job_secret_matches(seal: str, secret: str) -> bool:
    """Whether `secret` opens a job sealed with `seal` ("" : an open job, which any call opens)."""
    if not seal:
        return True
    try:
        return hmac.compare_digest(seal, job_secret_digest(secret))
    except BadRequest:
        return False


def secret_matches(digest: str, secret: str) -> bool:
    """Whether `secret` is the one kept as `digest` ("" keeps none: any matches), in constant time."""
    if not digest:
        return True
    return MEMBER_SECRET.fullmatch(secret) is not None and hmac.compare_digest(digest, secret_digest(secret))


class Slot(NamedTuple):
    """One worker of a host membership (JoinRequest.host_workers)."""

    index: int  # at least 1, never reused within the membership: seated as "<member id>/<index>"
    role: str = ""
    local_rank: int | None = None  # fixed by its launcher, or None: the server's to choose


class JoinParams(NamedTuple):
    """A validated join request. Build with `JoinParams.build`."""

    job_id: str
    spec: JobSpec
    node_key: str
    address: str
    port: int  # a port the worker holds in LISTEN (its spare: rank 0 serves the TCPStore on it)
    local_rank: int | None = None
    node_rank: int | None = None
    loopback: bool = False  # whether `address` is a loopback address
    role: str = ""
    member_id: str = ""  # client-chosen, to re-attach; empty: the server picks
    secret: str = ""  # digest of the member secret ("": none, as for members of schema 2)
    seal: str = ""  # digest of the job secret ("": an open job)
    workers: int = 1  # >1: a node membership (a launcher's agent) holding local ranks 0..workers-1 of its node
    slots: tuple[Slot, ...] = ()  # a host membership's workers (then `workers` counts them; role, local_rank unset)
    host: str = ""  # which machine (a digest of its boot id) sent a default node key; "": a key pinned on purpose

    def roles(self) -> list[tuple[str, int]]:
        """The workers it brings, as (role, how many)."""
        return role_counts(self.role, self.workers, self.slots)

    @classmethod
    def build(cls, *, job_id: str, spec: JobSpec, node_key: str, address: str, port: int, local_rank: int | None = None,
              node_rank: int | None = None, role: str = "", member_id: str = "", member_secret: str = "",
              job_secret: str = "", workers: int = 1, slots: tuple[Slot, ...] = (), host_id: str = "") -> JoinParams:
        """Validates a join request.

        Raises:
            BadRequest: naming the first bad field and its value.
        """
        check_job_id(job_id)
        if not node_key:
            raise BadRequest("node_key is empty")
        if len(node_key) > 253:
            raise BadRequest(f"node_key {elide(node_key, 32)} is {len(node_key)} characters; at most 253 allowed")
        check_name("node_key", node_key, NODE_KEY, "use letters, digits, '.', '_', ':' and '-', starting with a letter or digit")
        if role:
            check_role(role)
        try:
            address, loopback = canonical_ip(address)
        except ValueError as exc:
            raise BadRequest(f"address {exc}; advertise an address peers can reach") from None
        if not 1 <= port <= 65535:
            raise BadRequest(f"master_port {port} is out of range 1..65535")
        if spec.nodes and local_rank is not None:
            raise BadRequest(f"local_rank {local_rank} cannot be given in a job of nodes: each Join is a node, "
                                  f"holding local ranks 0..workers-1")
        if local_rank is not None and local_rank >= spec.world_size:
            raise BadRequest(f"local_rank {local_rank} is not below world_size {spec.world_size}")
        if node_rank is not None and node_rank >= spec.world_size:
            raise BadRequest(f"node_rank {node_rank} is not below {'nodes.max' if spec.nodes else 'world_size'} "
                                  f"{spec.world_size}")
        most = MAX_NODE_WORKERS if spec.nodes else min(spec.world_size, MAX_NODE_WORKERS)
        if not 1 <= workers <= most:
            raise BadRequest(f"workers {workers} is out of range 1..{most} "
                                  f"({'a job of nodes' if spec.nodes else f'world_size {spec.world_size}'}; "
                                  f"a node membership holds at most {MAX_NODE_WORKERS})")
        if workers > 1 and local_rank is not None:
            raise BadRequest(f"local_rank {local_rank} cannot be given with workers {workers}: "
                                  f"a node membership holds local ranks 0..{workers - 1}")
        if member_id and not CLIENT_MEMBER_ID.fullmatch(member_id):
            raise BadRequest(f"member_id {elide(member_id)} is malformed: give 16-64 lowercase hex digits, or none")
        if host_id and not HOST_ID.fullmatch(host_id):
            raise BadRequest(f"host_id {elide(host_id)} is malformed: give 8-64 lowercase hex digits, or none")
        if slots:
            _check_slots(slots, spec, role, local_rank, workers)
            workers = len(slots)
        secret = secret_digest(member_secret) if member_secret else ""
        seal = job_secret_digest(job_secret) if job_secret else ""
        return cls(job_id, spec, node_key, address, port, local_rank, node_rank, loopback, role, member_id, secret, seal, workers,
                   tuple(slots), host_id)


def check_world_size(p: JoinParams, joined: int, most: int) -> None:
    """That a Join keeps its job within `most` workers (--max-world-size):
    `joined`, the job's workers now (0: the Join creates it), and the Join's.

    Raises:
        BadRequest: the spec's smallest world is larger (no Join could form it).
        LimitExceeded: the Join's workers would take the job past it.
    """
    if p.spec.min_world > most:
        unit = "nodes" if p.spec.nodes else "workers"
        raise BadRequest(f"spec's smallest world is {p.spec.min_world:,} {unit}; this server forms worlds of at most "
                         f"{most:,} workers (--max-world-size)")
    if joined + p.workers > most:
        raise LimitExceeded(f"job {p.job_id!r} holds {joined:,} workers; node {p.node_key!r} cannot add {p.workers:,} "
                            f"more: a job holds at most {most:,} workers on this server (--max-world-size)")


def _check_slots(slots: tuple[Slot, ...], spec: JobSpec, role: str, local_rank: int | None, workers: int) -> None:
    """A host membership's workers: the request's own role, local_rank and workers unset; each worker's valid.

    Raises:
        BadRequest: naming the first bad field and its value.
    """
    if spec.nodes:
        raise BadRequest("host_workers cannot be given in a job of nodes: there each Join is a node (workers)")
    for name, value in (("role", role), ("local_rank", local_rank), ("workers", workers if workers != 1 else None)):
        if value:
            raise BadRequest(f"{name} {value!r} cannot be given with host_workers: each host worker has its own")
    most = min(spec.world_size, MAX_NODE_WORKERS)
    if len(slots) > most:
        raise BadRequest(f"host_workers lists {len(slots)} workers; at most {most} "
                         f"(world_size {spec.world_size}; a host membership holds at most {MAX_NODE_WORKERS})")
    indexes: set[int] = set()
    ranks: set[int] = set()
    for s in slots:
        if s.index < 1 or s.index in indexes:
            raise BadRequest(f"host_workers index {s.index} is {'below 1' if s.index < 1 else 'given twice'}: "
                             f"each worker of a host membership has its own, from 1")
        indexes.add(s.index)
        if s.role:
            check_role(s.role)
        if s.local_rank is not None:
            if s.local_rank >= spec.world_size or s.local_rank in ranks:
                raise BadRequest(f"host_workers local_rank {s.local_rank} of worker {s.index} is "
                                 f"{'given twice' if s.local_rank in ranks else f'not below world_size {spec.world_size}'}")
            ranks.add(s.local_rank)


def role_counts(role: str, workers: int, slots: tuple[Slot, ...]) -> list[tuple[str, int]]:
    """A membership's workers as (role, how many): a host membership's by its slots' roles, in their order."""
    if not slots:
        return [(role, workers)]
    counts: dict[str, int] = {}
    for s in slots:
        counts[s.role] = counts.get(s.role, 0) + 1
    return list(counts.items())
