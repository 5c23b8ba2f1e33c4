"""The wire codec, at the RPC edge: protocol messages to and from the domain's
values (spec <-> JobSpec, join request -> JoinParams, assignment -> message,
views -> descriptions), and domain errors -> gRPC status with a standard
google.rpc.ErrorInfo in its details. Nothing else in the server touches
protobuf but its helpers here: wire.py (bytes by hand) and undecodable.py."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator

import grpc
from google.protobuf import any_pb2, json_format
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from commctx.common.planning import JobSpec, Placement, PlannedGroup, WorldPlan, elide
from commctx.v1 import rendezvous_pb2 as pb

from ..errors import (
    AlreadyExists,
    BadRequest,
    Closed,
    Conflict,
    Full,
    LimitExceeded,
    NotFound,
    NotLeader,
    Refusal,
    Sealed,
    SessionReplaced,
    Stale,
    Unavailable,
    UnknownToken,
    WaitTimeout,
)
from ..rendezvous.model import Gone, JobEvent, JobState, NewWorld, Reforming, Seat, SessionEvent, worker_id
from ..rendezvous.params import JoinParams, Slot
from ..rendezvous.reports import JobView
from ..rendezvous.views import MAX_PAGE_SIZE, PAGE_SIZE, page_key
from ..rendezvous.waiting import Placed
from . import wire
from .undecodable import LimitedLog, Undecodable, tolerant  # noqa: F401 - codec's names, as app.py and the servicer use them

log = logging.getLogger("commctx.server")

DOMAIN = "commctx"
MAX_DETAILS = 1024  # error texts stay far below gRPC's metadata limit

# The one table from domain errors to status codes and ErrorInfo reasons.
STATUS_OF: dict[type[Refusal], tuple[grpc.StatusCode, int]] = {
    BadRequest: (grpc.StatusCode.INVALID_ARGUMENT, pb.INVALID_REQUEST),
    Conflict: (grpc.StatusCode.FAILED_PRECONDITION, pb.JOB_CONFLICT),
    Stale: (grpc.StatusCode.FAILED_PRECONDITION, pb.STALE_GENERATION),
    Closed: (grpc.StatusCode.FAILED_PRECONDITION, pb.JOB_CLOSED),
    AlreadyExists: (grpc.StatusCode.ALREADY_EXISTS, pb.RANK_TAKEN),
    Full: (grpc.StatusCode.RESOURCE_EXHAUSTED, pb.JOB_FULL),
    NotFound: (grpc.StatusCode.NOT_FOUND, pb.MEMBER_NOT_FOUND),
    WaitTimeout: (grpc.StatusCode.DEADLINE_EXCEEDED, pb.RENDEZVOUS_TIMEOUT),
    Unavailable: (grpc.StatusCode.UNAVAILABLE, pb.SERVER_UNAVAILABLE),
    NotLeader: (grpc.StatusCode.UNAVAILABLE, pb.NOT_LEADER),
    UnknownToken: (grpc.StatusCode.UNAUTHENTICATED, pb.UNAUTHENTICATED_CALLER),
    Sealed: (grpc.StatusCode.PERMISSION_DENIED, pb.JOB_SEALED),
    LimitExceeded: (grpc.StatusCode.RESOURCE_EXHAUSTED, pb.SERVER_FULL),
    SessionReplaced: (grpc.StatusCode.ABORTED, pb.SESSION_REPLACED),
}

_STATE = {
    JobState.FORMING: pb.JobDescription.FORMING,
    JobState.FORMED: pb.JobDescription.FORMED,
    JobState.FAILED: pb.JobDescription.FAILED,
    JobState.ENDED: pb.JobDescription.ENDED,
    JobState.CLOSED: pb.JobDescription.CLOSED,
}


# -- errors ----------------------------------------------------------------------------


def error_status(exc: BaseException) -> grpc.Status:
    """The status a failed call answers with: code, bounded message, ErrorInfo details."""
    if isinstance(exc, Refusal):
        code, reason = STATUS_OF[type(exc)]
        message = str(exc)
    else:
        log.error("internal error", exc_info=exc)
        code, reason, message = grpc.StatusCode.INTERNAL, pb.ERROR_REASON_UNSPECIFIED, f"internal error: {type(exc).__name__}"
    if len(message) > MAX_DETAILS:
        message = message[: MAX_DETAILS - 3] + "..."
    detail = any_pb2.Any()
    metadata = {"leader": exc.leader} if isinstance(exc, NotLeader) and exc.leader else {}
    detail.Pack(error_details_pb2.ErrorInfo(reason=pb.ErrorReason.Name(reason), domain=DOMAIN, metadata=metadata))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


def answer_error(context: grpc.aio.ServicerContext, status: grpc.Status) -> None:
    """Makes `status` the call's answer; the handler then returns (None).

    Not `context.abort`: grpc.aio keeps the AbortError it raises on the call's
    state, and its traceback holds the handler frames, which hold the context,
    so every aborted call is a reference cycle. GcPacer's middle passes move the
    cycles of calls in flight into the oldest generation, which it collects every
    5 minutes at most (hourly under steady load): a refusal retried in a loop grew
    the server by 60-85 bytes per answer. Set this way, a failed call is freed on return."""
    context.set_code(status.code)
    context.set_details(status.details)
    context.set_trailing_metadata(status.trailing_metadata)


# -- specs -----------------------------------------------------------------------------


def spec_from_message(m: pb.JobSpec) -> JobSpec:
    """Validates a wire JobSpec, through its JSON form (see JobSpec.build for what is checked).

    Raises:
        BadRequest: a malformed field, named.
        Conflict: sizes or counts no world of this size can satisfy.
    """
    return JobSpec.from_json(json_format.MessageToDict(m, preserving_proto_field_name=True))


def spec_to_message(spec: JobSpec) -> pb.JobSpec:
    """The wire form of a spec (for describing jobs)."""
    return json_format.ParseDict(spec.to_json(), pb.JobSpec())


# -- requests --------------------------------------------------------------------------


def join_params(r: pb.JoinRequest, spec: JobSpec) -> JoinParams:
    """Validates a JoinRequest whose spec is `spec` (SpecCache.spec_of). Its
    member secret is the domain's to check and keep (waiting.Joining.join).

    Raises:
        BadRequest: naming the first bad field and its value.
    """
    return JoinParams.build(
        job_id=r.job_id, spec=spec, node_key=r.node_key, address=r.address, port=r.master_port,
        local_rank=r.local_rank if r.HasField("local_rank") else None,
        node_rank=r.node_rank if r.HasField("node_rank") else None,
        role=r.role, member_id=r.member_id, job_secret=r.job_secret, workers=r.workers or 1,
        slots=tuple(Slot(w.index, w.role, w.local_rank if w.HasField("local_rank") else None) for w in r.host_workers),
        host_id=r.host_id,
    )


# -- answers ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)  # every member of a group shares the same message
def _group_message(group: PlannedGroup) -> pb.Group:
    runs = [pb.RankRun(start=r.start, count=r.count, stride=r.stride) for r in group.ranks]
    return pb.Group(mode=group.mode, index=group.index, ranks=pb.RankSet(runs=runs), cpu_twin=group.cpu_twin, root=group.root)


def _shared_fields(job_id: str, generation: int, plan: WorldPlan, reason: str, previous_lost: bool) -> pb.Assignment:
    """The fields of an assignment every worker of the world has alike."""
    return pb.Assignment(job_id=job_id, generation=generation, world_size=plan.world_size, num_nodes=plan.num_nodes,
                         master_addr=plan.master_addr, master_port=plan.master_port, dist_url=plan.dist_url, reason=reason,
                         previous_lost=previous_lost)


def _node_fields(plan: WorldPlan, node_rank: int) -> pb.Assignment:
    """The fields of an assignment every worker of one node has alike."""
    return pb.Assignment(node_rank=node_rank, local_world_size=plan.nodes[node_rank].size)


def _own_fields(plan: WorldPlan, p: Placement, previous_rank: int | None, worker: int = 0) -> pb.Assignment:
    """The fields of an assignment that are this worker's alone (its node's, changed groups and groups aside)."""
    return pb.Assignment(rank=p.rank, local_rank=p.local_rank, previous_rank=previous_rank,
                         role=plan.roles[p.rank] if plan.roles else "", worker=worker)


def fill_assignment(m: pb.Assignment, a: Seat) -> None:
    """Writes `a` into `m` (in place: this runs once per worker of every world)."""
    m.MergeFrom(_shared_fields(a.job_id, a.generation, a.plan, a.reason, a.previous_lost))
    m.MergeFrom(_node_fields(a.plan, a.placement.node_rank))
    m.MergeFrom(_own_fields(a.plan, a.placement, a.previous_rank, a.worker))
    m.changed_groups.extend(a.changed_groups)
    m.groups.extend([_group_message(g) for g in a.groups or a.plan.groups_of(a.placement)])


def join_response(placed: Placed, workers: int = 0) -> pb.JoinResponse:
    """The answer to a Join seated in its world; a node membership (`workers` given, the
    request's JoinRequest.workers) gets each of its workers' assignments."""
    member_id, world = placed.joined.member_id, placed.world
    response = pb.JoinResponse(member_id=member_id, member_secret=placed.member_secret,
                               lease_ttl_ms=round(placed.joined.lease_ttl_s * 1000))
    if world.hosts is not None and member_id in world.hosts:  # a host membership: each of its workers'
        _fill_host(response, world, member_id)
        return response
    fill_assignment(response.assignment, world.assignment_for(member_id))
    if workers:
        response.worker_assignments.append(response.assignment)
        for i in range(1, workers):
            fill_assignment(response.worker_assignments.add(), world.assignment_for(worker_id(member_id, i)))
    return response


# Workers' assignments encoded between two yields of the event loop when a
# Join of a node or host membership is answered (join_slices), or a host
# membership's session told of its new world (session_slices): a 1,024-worker
# node's answer, encoded whole, was 15-25 ms of the loop, and a world of 98 such
# nodes woken at once held it for 1.2 s (benchmarks/bounds.py).
ANSWER_SLICE = 64


def join_answer(placed: Placed, workers: int = 0) -> pb.JoinResponse | bytes:
    """What the servicer answers a Join with: join_response, but a node or host
    membership's workers' assignments as bytes joined from the world's shared
    parts (as a session's are): join_slices, joined."""
    return b"".join(join_slices(placed, workers)) if sliced(placed, workers) else join_response(placed)


def sliced(placed: Placed, workers: int) -> bool:
    """Whether a Join's answer holds its workers' assignments (a node or host membership's): join_slices."""
    return bool(workers) or (placed.world.hosts is not None and placed.joined.member_id in placed.world.hosts)


def join_slices(placed: Placed, workers: int) -> Iterator[bytes]:
    """A node or host membership's JoinResponse (`workers`: the request's
    JoinRequest.workers), as bytes, ANSWER_SLICE workers' assignments at a
    time: the servicer yields the event loop between two slices."""
    member_id, world = placed.joined.member_id, placed.world
    head = pb.JoinResponse(member_id=member_id, member_secret=placed.member_secret,
                           lease_ttl_ms=round(placed.joined.lease_ttl_s * 1000)).SerializeToString()
    if world.hosts is not None and member_id in world.hosts:
        seats = (world.assignment_for(worker_id(member_id, i), i) for i in world.hosts[member_id])
    else:
        seats = (world.assignment_for(worker_id(member_id, i)) for i in range(max(workers, 1)))
    return _slices(_world_parts(world), seats, _JOIN_ASSIGNMENT, _JOIN_WORKERS, head)


def _slices(parts: _WorldParts, seats: Iterator[Seat], first: int, each: int, head: bytes = b"") -> Iterator[bytes]:
    """`head`, then the seats' assignments: the first's as field `first` and every one's as
    field `each` (tags), ANSWER_SLICE at a time: a message's bytes, to be joined."""
    out = [head]
    for i, seat in enumerate(seats):
        assignment = parts.assignment(seat)
        if i == 0:
            out.append(wire.field(first, assignment))
        out.append(wire.field(each, assignment))
        if len(out) >= ANSWER_SLICE:
            yield b"".join(out)
            out = []
    if out:
        yield b"".join(out)


def _fill_host(m: pb.JoinResponse | pb.SessionEvent, world: NewWorld, member_id: str):
    """Writes a host membership's workers' assignments into `m` (`assignment`: the first's)."""
    for seat in world.host_seats(member_id):
        fill_assignment(m.worker_assignments.add(), seat)
    m.assignment.CopyFrom(m.worker_assignments[0])
    return m


class _WorldParts:
    """What the assignments of one world's members share, serialized once: the
    fields common to all, each node's, each set of changed groups, and each
    group (members of a node, say, share one)."""

    __slots__ = ("world", "common", "groups", "nodes", "changes")

    def __init__(self, world: NewWorld) -> None:
        self.world = world  # held, so that the ids keying the caches are not reused meanwhile
        self.common = _shared_fields(world.job_id, world.generation, world.plan, world.reason, world.lost).SerializeToString()
        self.groups: dict[int, bytes] = {}  # by id(PlannedGroup): the plans hold their groups
        self.nodes: dict[int, bytes] = {}  # by node rank: node_rank, local_world_size
        self.changes: dict[tuple[str, ...], bytes] = {}  # changed_groups

    def group(self, group: PlannedGroup) -> bytes:
        b = self.groups.get(id(group))
        if b is None:
            b = self.groups[id(group)] = pb.Assignment(groups=[_group_message(group)]).SerializeToString()
        return b

    def node(self, node_rank: int) -> bytes:
        b = self.nodes.get(node_rank)
        if b is None:
            b = self.nodes[node_rank] = _node_fields(self.world.plan, node_rank).SerializeToString()
        return b

    def changed(self, modes: tuple[str, ...]) -> bytes:
        b = self.changes.get(modes)
        if b is None:
            b = self.changes[modes] = pb.Assignment(changed_groups=modes).SerializeToString()
        return b

    def assignment(self, seat: Seat) -> bytes:
        """A worker's Assignment, serialized: the parts it shares and its own fields."""
        p = seat.placement
        plan = self.world.plan
        return b"".join([self.common, self.node(p.node_rank), self.changed(seat.changed_groups),
                         wire.own_bytes(p.rank, p.local_rank, seat.previous_rank, plan.roles[p.rank] if plan.roles else "",
                                    seat.worker),
                         *[self.group(g) for g in seat.groups or plan.groups_of(p)]])




_ASSIGNMENT = pb.SessionEvent.DESCRIPTOR.fields_by_name["assignment"].number << 3 | 2
_WORKER_ASSIGNMENTS = pb.SessionEvent.DESCRIPTOR.fields_by_name["worker_assignments"].number << 3 | 2
_JOIN_ASSIGNMENT = pb.JoinResponse.DESCRIPTOR.fields_by_name["assignment"].number << 3 | 2
_JOIN_WORKERS = pb.JoinResponse.DESCRIPTOR.fields_by_name["worker_assignments"].number << 3 | 2


# By id(NewWorld): the few worlds being delivered now. Each entry holds its world's
# plan (most are jobs' current plans anyway); a world pushed out is only encoded anew.
_worlds: dict[int, _WorldParts] = {}
_WORLDS_KEPT = 8


def _world_parts(world: NewWorld) -> _WorldParts:
    parts = _worlds.get(id(world))
    if parts is None or parts.world is not world:
        if len(_worlds) >= _WORLDS_KEPT:
            del _worlds[next(iter(_worlds))]  # the oldest: its delivery is over
        parts = _worlds[id(world)] = _WorldParts(world)
    return parts


def _assignment_bytes(world: NewWorld, member_id: str) -> bytes | None:
    """The SessionEvent carrying `member_id`'s assignment in `world`, as bytes.
    A whole world's survivors get theirs at once (10,000 at a re-form), so what
    they share is serialized once and joined to each member's own fields: a
    message field that occurs more than once on the wire is merged, and
    repeated fields keep their order, so the bytes parse to exactly the
    message fill_assignment builds (a test holds them equal)."""
    if world.hosts is not None and member_id in world.hosts:  # a host membership: each of its workers', in its order
        return b"".join(session_slices(world, member_id))
    seat = world.assignment_for(member_id)
    return None if seat is None else wire.field(_ASSIGNMENT, _world_parts(world).assignment(seat))


def session_sliced(event: SessionEvent, member_id: str) -> bool:
    """Whether a session event carries many workers' assignments (a host membership's new world): session_slices."""
    return isinstance(event, NewWorld) and event.hosts is not None and member_id in event.hosts


def session_slices(world: NewWorld, member_id: str) -> Iterator[bytes]:
    """A host membership's SessionEvent in `world`, as bytes, ANSWER_SLICE workers'
    assignments at a time (the servicer yields the event loop between two slices)."""
    seats = (world.assignment_for(worker_id(member_id, i), i) for i in world.hosts[member_id])
    return _slices(_world_parts(world), seats, _ASSIGNMENT, _WORKER_ASSIGNMENTS)


def pass_bytes(serialize: Callable[[object], bytes]) -> Callable[[object], bytes]:
    """A response serializer that sends bytes as they are (messages encoded
    ahead, as session_event does) and serializes anything else."""
    return lambda message: message if type(message) is bytes else serialize(message)


def session_event(event: SessionEvent, member_id: str) -> pb.SessionEvent | bytes | None:
    """The message for a session event (a new world's assignment as its
    encoded bytes); None when the event holds nothing for this member."""
    if isinstance(event, NewWorld):
        return _assignment_bytes(event, member_id)
    if isinstance(event, Reforming):
        return pb.SessionEvent(world_changed=pb.WorldChange(generation=event.generation, reason=event.reason, lost=event.lost))
    if isinstance(event, Gone):
        return pb.SessionEvent(gone=event.reason, job_ended=event.ended, job_closed=event.closed)
    raise TypeError(f"not a session event: {elide(event)}")


def event_message(e: JobEvent) -> pb.JobEvent:
    message = pb.JobEvent(seq=e.seq, time=e.time, kind=e.kind, generation=e.generation, message=e.message)
    message.fields.update(e.fields)
    return message


def summary_message(v: JobView) -> pb.JobDescription:
    """A sealed job as ListJobs shows it to those without its secret: id, run and state."""
    return pb.JobDescription(job_id=v.job_id, state=_STATE[v.state], run=v.run)


def description_message(v: JobView) -> pb.JobDescription:
    return pb.JobDescription(
        job_id=v.job_id,
        state=_STATE[v.state],
        generation=v.generation,
        spec=spec_to_message(v.spec),
        joined=v.joined,
        missing=v.missing,
        nodes=[
            pb.NodeDescription(
                node_key=n.node_key, address=n.address, workers=n.workers,
                node_rank=n.node_rank if n.node_rank is not None else 0,
                roles=[pb.RoleCount(role=r, count=c) for r, c in n.roles], addresses=n.addresses,
            )
            for n in v.nodes
        ],
        reason=v.reason,
        forming_for_s=v.forming_for_s,
        missing_nodes=v.missing_nodes,
        waiting=v.waiting,
        not_ready=v.not_ready,
        num_nodes=v.num_nodes,
        refused=v.refused,
        last_refused=v.last_refused,
        run=v.run,
        started_at=v.started_at,
        ended_at=v.ended_at,
        other_runs=v.other_runs,
    )


# -- pages ------------------------------------------------------------------------------

MAX_REPLY_BYTES = 1 << 20  # DescribeJob's reply: fewer nodes than asked if theirs are long (keys, many roles)


def page_size(size: int, field: str = "page_size", default: int = PAGE_SIZE, most: int = MAX_PAGE_SIZE) -> int:
    """A request's page size (0: the default).

    Raises:
        BadRequest: above `most`, naming `field`.
    """
    size = size or default
    if size > most:
        raise BadRequest(f"{field} {size} is above the most a {'reply' if field.startswith('node') else 'page'} holds, {most}")
    return size


def position(token: str, field: str, method: str, digits: int) -> int:
    """Where a numeric page token (as DescribeJob and ListEvents give them) starts; "" is 0.

    Raises:
        BadRequest: not such a token, naming `field` and `method`.
    """
    if token and not (token.isdigit() and token.isascii() and len(token) <= digits):
        raise BadRequest(f"{field} {elide(token)} is not a token {method} gave")
    return int(token or 0)


def description_page(v: JobView, first: int, max_bytes: int = MAX_REPLY_BYTES) -> pb.JobDescription:
    """A job's description holding its nodes from `first` on, as many as fit
    in `max_bytes` (at least one), with the token of the next page."""
    message = description_message(v)
    if message.ByteSize() > max_bytes:
        nodes = list(message.nodes)
        del message.nodes[:]
        budget, keep = max_bytes - message.ByteSize(), 0
        for node in nodes:
            budget -= node.ByteSize() + 5  # + its tag and length, at most
            if budget < 0:
                break
            keep += 1
        message.nodes.extend(nodes[:max(keep, 1)])
    shown = first + len(message.nodes)
    message.next_node_page_token = str(shown) if shown < v.num_nodes else ""
    return message


def jobs_page(views: list[JobView], more: bool, admin: bool, runs: bool = False) -> pb.ListJobsResponse:
    """A page of ListJobs: sealed jobs as summaries unless an admin asks; `runs`:
    a page of runs (include_ended), whose token names the last one's run."""
    return pb.ListJobsResponse(
        jobs=[summary_message(v) if v.seal and not admin else description_message(v) for v in views],
        next_page_token=(page_key(views[-1]) if runs else views[-1].job_id) if more else "")


def events_page(events: list[JobEvent], size: int) -> pb.ListEventsResponse:
    """A page of ListEvents from up to `size` + 1 events (one more: there is a next page)."""
    shown = events[:size]
    return pb.ListEventsResponse(events=[event_message(e) for e in shown],
                                 next_page_token=str(shown[-1].seq) if len(events) > size else "")
