"""The gRPC adapter: validate the request, call the domain, map errors.

No business logic lives here. Every domain error maps to a status code through
`STATUS_OF`; anything else becomes INTERNAL (never UNKNOWN) and is logged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import socket
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .assignment import GroupSpec
from .errors import (
    AlreadyExists,
    Conflict,
    InvalidArgument,
    JobFull,
    NotFound,
    RendezvousError,
    StaleGeneration,
    Unavailable,
    WaitTimeout,
)
from .spec import NODE_KEY, JobSpec, role_of, spec_from_proto, spec_to_proto
from .state import Assignment, Gone, JobState, JobView, JoinParams, Rendezvous, SessionEvent, WorldChange
from .telemetry import Events

log = logging.getLogger("commctx.server")

STATUS_OF: dict[type[RendezvousError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    Conflict: grpc.StatusCode.FAILED_PRECONDITION,
    StaleGeneration: grpc.StatusCode.FAILED_PRECONDITION,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    JobFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    WaitTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MEMBER_ID = re.compile(r"[0-9a-f]{1,64}")
_CLIENT_MEMBER_ID = re.compile(r"[0-9a-f]{16,64}")
_STATE = {
    JobState.FORMING: pb.JobDescription.FORMING,
    JobState.FORMED: pb.JobDescription.FORMED,
    JobState.FAILED: pb.JobDescription.FAILED,
    JobState.ENDED: pb.JobDescription.ENDED,
}

T = TypeVar("T")


def _name(kind: str, value: str, pattern: re.Pattern[str], max_len: int, rule: str) -> str:
    if not value:
        raise InvalidArgument(f"{kind} is empty")
    if len(value) > max_len:
        raise InvalidArgument(f"{kind} {value[:32]!r}... is {len(value)} characters; at most {max_len} allowed")
    if not pattern.fullmatch(value):
        raise InvalidArgument(f"{kind} {value!r} is malformed: {rule}")
    return value


def job_id_of(value: str) -> str:
    return _name("job_id", value, _JOB_ID, 128, "use letters, digits, '.', '_' and '-', starting with a letter or digit")


def member_id_of(value: str) -> str:
    return _name("member_id", value, _MEMBER_ID, 64, "a member id is the hex string Join returned")


def join_params(r: pb.JoinRequest) -> JoinParams:
    """Validates a JoinRequest.

    Raises:
        InvalidArgument: naming the first bad field and its value.
    """
    job_id = job_id_of(r.job_id)
    node_key = _name(
        "node_key", r.node_key, NODE_KEY, 253,
        "use letters, digits, '.', '_', ':' and '-', starting with a letter or digit",
    )
    spec = _spec(r.spec.SerializeToString(deterministic=True))
    world_size = spec.world_size
    if r.role:
        role_of(r.role)
    address, loopback = _address(r.address)
    if not 1 <= r.master_port <= 65535:
        raise InvalidArgument(f"master_port {r.master_port} is out of range 1..65535")
    local_rank = r.local_rank if r.HasField("local_rank") else None
    if local_rank is not None and local_rank >= world_size:
        raise InvalidArgument(f"local_rank {local_rank} is not below world_size {world_size}")
    node_rank = r.node_rank if r.HasField("node_rank") else None
    if node_rank is not None and node_rank >= world_size:
        raise InvalidArgument(f"node_rank {node_rank} is not below world_size {world_size}")
    if r.member_id and not _CLIENT_MEMBER_ID.fullmatch(r.member_id):
        raise InvalidArgument(f"member_id {r.member_id[:70]!r} is malformed: give 16-64 lowercase hex digits, or none")
    return JoinParams(job_id, spec, node_key, address, r.master_port, local_rank, node_rank, loopback, r.role, r.member_id)


@functools.lru_cache(maxsize=256)  # every worker of a job sends the same spec
def _spec(wire: bytes) -> JobSpec:
    return spec_from_proto(pb.JobSpec.FromString(wire))


def _address(value: str) -> tuple[str, bool]:
    """Canonical form of an IP literal, and whether it is a loopback address."""
    family = socket.AF_INET6 if ":" in value else socket.AF_INET
    try:
        packed = socket.inet_pton(family, value)
    except (OSError, ValueError):
        raise InvalidArgument(
            f"address {value[:64]!r} is not an IP address; advertise an address peers can reach"
        ) from None
    if packed == bytes(len(packed)):
        raise InvalidArgument(f"address {value} is unspecified; advertise an address peers can reach")
    if family == socket.AF_INET:
        return socket.inet_ntop(family, packed), packed[0] == 127
    if packed[:12] == bytes(10) + b"\xff\xff":  # IPv4-mapped
        return socket.inet_ntop(family, packed), packed[12] == 127
    return socket.inet_ntop(family, packed), packed == bytes(15) + b"\x01"


@functools.lru_cache(maxsize=4096)  # every member of a group shares the same message
def _group_proto(group: GroupSpec) -> pb.Group:
    runs = [pb.RankRun(start=r.start, count=r.count, stride=r.stride) for r in group.ranks]
    return pb.Group(mode=group.mode, index=group.index, ranks=pb.RankSet(runs=runs), cpu_twin=group.cpu_twin, root=group.root)


def join_response(member_id: str, lease_ttl_s: float, a: Assignment) -> pb.JoinResponse:
    """The Join answer for one member (built in place: this runs once per worker)."""
    plan, p = a.plan, a.placement
    response = pb.JoinResponse(member_id=member_id, lease_ttl_ms=round(lease_ttl_s * 1000))
    m = response.assignment
    m.job_id = a.job_id
    m.generation = a.generation
    m.rank = p.rank
    m.world_size = plan.world_size
    m.node_rank = p.node_rank
    m.num_nodes = plan.num_nodes
    m.local_rank = p.local_rank
    m.local_world_size = plan.nodes[p.node_rank].size
    m.master_addr = plan.master_addr
    m.master_port = plan.master_port
    m.dist_url = plan.dist_url
    if plan.roles:
        m.role = plan.roles[p.rank]
    m.groups.extend([_group_proto(g) for g in plan.groups_of(p)])
    m.changed_groups.extend(a.changed_groups)
    if a.previous_rank is not None:
        m.previous_rank = a.previous_rank
    return response


def session_event(event: SessionEvent, member_id: str, lease_ttl_s: float) -> pb.SessionEvent:
    if isinstance(event, WorldChange):
        return pb.SessionEvent(world_changed=pb.WorldChange(generation=event.generation, reason=event.reason))
    if isinstance(event, Gone):
        return pb.SessionEvent(gone=event.reason)
    return pb.SessionEvent(assignment=join_response(member_id, lease_ttl_s, event).assignment)


def description_proto(v: JobView) -> pb.JobDescription:
    return pb.JobDescription(
        job_id=v.job_id,
        state=_STATE[v.state],
        generation=v.generation,
        spec=spec_to_proto(v.spec),
        joined=v.joined,
        missing=v.missing,
        nodes=[
            pb.NodeDescription(
                node_key=n.node_key, address=n.address, workers=n.workers,
                node_rank=n.node_rank if n.node_rank is not None else 0,
                roles=[pb.RoleCount(role=r, count=c) for r, c in n.roles],
            )
            for n in v.nodes
        ],
        reason=v.reason,
        forming_for_s=v.forming_for_s,
        missing_nodes=v.missing_nodes,
        waiting=v.waiting,
        not_ready=v.not_ready,
    )


ERROR_KEY = "commctx-error"  # trailing metadata naming the domain error class


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    if isinstance(exc, RendezvousError):
        return STATUS_OF[type(exc)], str(exc), ((ERROR_KEY, type(exc).__name__),)
    log.error("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", ()


class RendezvousServicer(pb_grpc.RendezvousServicer):
    """Serves commctx.v1.Rendezvous over a `Rendezvous` domain object."""

    def __init__(self, rendezvous: Rendezvous, events: Events | None = None) -> None:
        self._rdzv = rendezvous
        self._events = events or Events()
        self.draining = False

    async def _abort(self, context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
        code, details, metadata = _status_of(exc)
        self._events.rpc_error(method, code.name)
        await context.abort(code, details, metadata)

    async def _call(self, context: grpc.aio.ServicerContext, method: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:  # every failure leaves through the status table
            error = exc
        await self._abort(context, method, error)
        raise AssertionError("unreachable: abort raises")

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinResponse:
        # Inlined rather than going through _call: this runs once per worker of every job.
        try:
            if self.draining:
                raise Unavailable("the server is shutting down; join another rendezvous server or retry")
            params = join_params(request)
            joined = self._rdzv.join(params)
        except Exception as exc:
            error: Exception | None = exc
        else:
            error = None
        if error is not None:
            await self._abort(context, "Join", error)
        timeout = request.wait_timeout_ms / 1000 if request.wait_timeout_ms else None
        remaining = context.time_remaining()
        if remaining is not None:
            # Answer with who is missing before the caller's own deadline cuts the call.
            cap = remaining - min(1.0, remaining * 0.1)
            timeout = cap if timeout is None else min(timeout, cap)
        try:
            assignment = await self._rdzv.wait_assignment(params.job_id, joined.member_id, timeout)
            return join_response(joined.member_id, joined.lease_ttl_s, assignment)
        except Exception as exc:
            error = exc
        finally:  # a no-op once assigned; before that, a caller that went away is withdrawn
            self._rdzv.withdraw(params.job_id, joined.member_id)
        await self._abort(context, "Join", error)

    async def Session(self, requests: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext) -> None:
        # The first message names the member; every message renews its lease.
        # Events the state queues for the member are written as they come
        # (through context.read/write, so `requests` is not iterated).
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        try:
            job_id, member_id = job_id_of(first.job_id), member_id_of(first.member_id)
            outbox, ttl = self._rdzv.open_session(job_id, member_id, first.generation)
            self._rdzv.renew(job_id, member_id, first.generation, first.ready_port)
        except NotFound as exc:  # a renewal for an unknown member: "gone, re-join", not an error
            await context.write(pb.SessionEvent(gone=str(exc)))
            return
        except Exception as exc:
            await self._abort(context, "Session", exc)
            return
        await context.write(pb.SessionEvent(lease_ttl_ms=round(ttl * 1000)))
        reader = asyncio.ensure_future(self._renewals(context, job_id, member_id, outbox))
        try:
            while True:
                event = await outbox.get()
                if event is None:  # the reader saw the client finish
                    return
                await context.write(session_event(event, member_id, ttl))
                if isinstance(event, Gone):
                    return
        finally:
            reader.cancel()
            self._rdzv.close_session(job_id, member_id, outbox)

    async def _renewals(self, context: grpc.aio.ServicerContext, job_id: str, member_id: str, outbox: asyncio.Queue) -> None:
        while True:
            request = await context.read()
            if request is grpc.aio.EOF:
                outbox.put_nowait(None)
                return
            try:
                self._rdzv.renew(job_id, member_id, request.generation, request.ready_port)
            except NotFound as exc:
                outbox.put_nowait(Gone(str(exc)))
                return

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.aio.ServicerContext) -> pb.KeepAliveResponse:
        def renew():
            ttl, generation = self._rdzv.keep_alive(
                job_id_of(request.job_id), member_id_of(request.member_id), request.generation
            )
            return pb.KeepAliveResponse(lease_ttl_ms=round(ttl * 1000), generation=generation)

        return await self._call(context, "KeepAlive", renew)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        def leave():
            self._rdzv.leave(job_id_of(request.job_id), member_id_of(request.member_id))
            return pb.LeaveResponse()

        return await self._call(context, "Leave", leave)

    async def DescribeJob(self, request: pb.DescribeJobRequest, context: grpc.aio.ServicerContext) -> pb.JobDescription:
        return await self._call(context, "DescribeJob", lambda: description_proto(self._rdzv.describe(job_id_of(request.job_id))))

    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        def jobs():
            return pb.ListJobsResponse(jobs=[description_proto(self._rdzv.describe(j)) for j in self._rdzv.job_ids()])

        return await self._call(context, "ListJobs", jobs)
