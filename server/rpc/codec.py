"""The wire codec, at the RPC edge: protocol messages to and from the domain's
values: spec <-> JobSpec, a Join's request -> JoinParams, a world's
assignments -> the Join's answer and the session's events, views -> job
descriptions and events; one encoder per message. Its neighbours: status.py
(errors -> status), paging.py (pages of these messages), specs.py (specs
parsed once), wire.py (bytes by hand), undecodable.py (requests that do not
parse)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

from google.protobuf import json_format

from commctx.common.planning import JobSpec, PlannedGroup, elide
from commctx.v1 import rendezvous_pb2 as pb

from ..rendezvous.model import Gone, JobEvent, JobState, NewWorld, Reforming, SeatInWorld, SessionEvent, worker_id
from ..rendezvous.params import JoinParams, Slot
from ..rendezvous.reports import JobView
from ..rendezvous.waiting import JoinAnswer
from . import wire

_STATE = {
    JobState.FORMING: pb.JobDescription.FORMING,
    JobState.FORMED: pb.JobDescription.FORMED,
    JobState.FAILED: pb.JobDescription.FAILED,
    JobState.ENDED: pb.JobDescription.ENDED,
    JobState.CLOSED: pb.JobDescription.CLOSED,
}


# -- specs and requests ------------------------------------------------------------------


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


# -- assignments: a world's, as its Joins and sessions carry them ---------------------------

# Workers' assignments encoded between two yields of the event loop when a
# Join of a node or host membership is answered (join_slices), or a host
# membership's session told of its new world (session_slices): encoded whole,
# a world of many such memberships woken at once would hold the loop.
ANSWER_SLICE = 64

_ASSIGNMENT = pb.SessionEvent.DESCRIPTOR.fields_by_name["assignment"].number << 3 | 2
_WORKER_ASSIGNMENTS = pb.SessionEvent.DESCRIPTOR.fields_by_name["worker_assignments"].number << 3 | 2
_JOIN_ASSIGNMENT = pb.JoinResponse.DESCRIPTOR.fields_by_name["assignment"].number << 3 | 2
_JOIN_WORKERS = pb.JoinResponse.DESCRIPTOR.fields_by_name["worker_assignments"].number << 3 | 2


@functools.lru_cache(maxsize=4096)  # a group the next world keeps is built once
def _group_message(group: PlannedGroup) -> pb.Group:
    runs = [pb.RankRun(start=r.start, count=r.count, stride=r.stride) for r in group.ranks]
    return pb.Group(mode=group.mode, index=group.index, ranks=pb.RankSet(runs=runs), cpu_twin=group.cpu_twin, root=group.root)


class WorldEncoding:
    """The one encoder of commctx.v1.Assignment: a world's members' assignments,
    as bytes. What they share is serialized once: the fields common to all,
    each node's, each set of changed groups and each group (members of a node,
    say, share one); a worker's own fields are written by hand
    (wire.own_bytes). Protobuf merges a message field that occurs more than
    once and keeps repeated fields in order, so the joined bytes parse to the
    message built field by field (tests/test_replies.py holds them to it)."""

    __slots__ = ("world", "_common", "_groups", "_nodes", "_changes")

    def __init__(self, world: NewWorld) -> None:
        self.world = world
        self._common = pb.Assignment(
            job_id=world.job_id, generation=world.generation, world_size=world.plan.world_size,
            num_nodes=world.plan.num_nodes, master_addr=world.plan.master_addr, master_port=world.plan.master_port,
            dist_url=world.plan.dist_url, reason=world.reason, previous_lost=world.lost, run=world.run).SerializeToString()
        # By id(): the world holds its plan, which holds its groups, for as long as
        # this encoding is kept; hashing a group's ranks at every lookup would cost more.
        self._groups: dict[int, bytes] = {}
        self._nodes: dict[int, bytes] = {}  # by node rank: node_rank, local_world_size
        self._changes: dict[tuple[str, ...], bytes] = {}  # changed_groups

    def assignment(self, seat: SeatInWorld) -> bytes:
        """A worker's Assignment, serialized: the parts it shares and its own fields."""
        p, plan = seat.seat, self.world.plan
        own = wire.own_bytes(p.rank, p.local_rank, seat.previous_rank, plan.roles[p.rank] if plan.roles else "", seat.worker)
        return b"".join([self._common, self._node(p.node_rank), self._changed(seat.changed_groups), own,
                         *[self._group(g) for g in seat.groups or plan.groups_of(p)]])

    def _group(self, group: PlannedGroup) -> bytes:
        b = self._groups.get(id(group))
        if b is None:
            b = self._groups[id(group)] = pb.Assignment(groups=[_group_message(group)]).SerializeToString()
        return b

    def _node(self, node_rank: int) -> bytes:
        b = self._nodes.get(node_rank)
        if b is None:
            b = self._nodes[node_rank] = pb.Assignment(
                node_rank=node_rank, local_world_size=self.world.plan.nodes[node_rank].size).SerializeToString()
        return b

    def _changed(self, modes: tuple[str, ...]) -> bytes:
        b = self._changes.get(modes)
        if b is None:
            b = self._changes[modes] = pb.Assignment(changed_groups=modes).SerializeToString()
        return b


class Worlds:
    """The encodings of the few worlds being delivered now, newest last: a
    re-form's survivors' sessions and Joins each ask for theirs, and what they
    share is serialized once for all of them. A world pushed out is only
    encoded anew. Each servicer (one per term) holds its own."""

    KEPT = 8

    def __init__(self) -> None:
        self._kept: list[WorldEncoding] = []

    def encoding(self, world: NewWorld) -> WorldEncoding:
        for kept in reversed(self._kept):
            if kept.world is world:
                return kept
        if len(self._kept) >= self.KEPT:
            del self._kept[0]  # the oldest: its delivery is over
        kept = WorldEncoding(world)
        self._kept.append(kept)
        return kept


def _encoding(world: NewWorld, worlds: Worlds | None) -> WorldEncoding:
    return WorldEncoding(world) if worlds is None else worlds.encoding(world)


def many_workers(answer: JoinAnswer, workers: int) -> bool:
    """Whether a Join's answer holds its workers' assignments (a node or host
    membership's, `workers` being the request's JoinRequest.workers): the
    servicer then takes join_slices a turn of the event loop each."""
    return bool(workers) or (answer.world.hosts is not None and answer.joined.member_id in answer.world.hosts)


def join_slices(answer: JoinAnswer, workers: int, worlds: Worlds | None = None) -> Iterator[bytes]:
    """A Join's answer, the JoinResponse, as bytes in slices of ANSWER_SLICE
    workers' assignments: a single worker's, or a node or host membership's
    (`workers`: the request's JoinRequest.workers) each of its workers' too."""
    member_id, world = answer.joined.member_id, answer.world
    head = pb.JoinResponse(member_id=member_id, member_secret=answer.member_secret,
                           lease_ttl_ms=round(answer.joined.lease_ttl_s * 1000)).SerializeToString()
    encoding = _encoding(world, worlds)
    if world.hosts is not None and member_id in world.hosts:
        seats = (world.seat_of(worker_id(member_id, i), i) for i in world.hosts[member_id])
    elif workers:
        seats = (world.seat_of(worker_id(member_id, i)) for i in range(workers))
    else:
        return iter((head + wire.field(_JOIN_ASSIGNMENT, encoding.assignment(world.seat_of(member_id))),))
    return _slices(encoding, seats, _JOIN_ASSIGNMENT, _JOIN_WORKERS, head)


def session_sliced(event: SessionEvent, member_id: str) -> bool:
    """Whether a session event carries many workers' assignments (a host membership's new world): session_slices."""
    return isinstance(event, NewWorld) and event.hosts is not None and member_id in event.hosts


def session_slices(world: NewWorld, member_id: str, worlds: Worlds | None = None) -> Iterator[bytes]:
    """A host membership's SessionEvent in `world`, as bytes, ANSWER_SLICE workers'
    assignments at a time (the servicer yields the event loop between two slices)."""
    seats = (world.seat_of(worker_id(member_id, i), i) for i in world.hosts[member_id])
    return _slices(_encoding(world, worlds), seats, _ASSIGNMENT, _WORKER_ASSIGNMENTS)


def session_event(event: SessionEvent, member_id: str, worlds: Worlds | None = None) -> pb.SessionEvent | bytes | None:
    """The message for a session event, a new world's assignment as its
    encoded bytes; None when the event holds nothing for this member."""
    if isinstance(event, NewWorld):
        if session_sliced(event, member_id):
            return b"".join(session_slices(event, member_id, worlds))
        seat = event.seat_of(member_id)
        return None if seat is None else wire.field(_ASSIGNMENT, _encoding(event, worlds).assignment(seat))
    if isinstance(event, Reforming):
        return pb.SessionEvent(world_changed=pb.WorldChange(generation=event.generation, reason=event.reason, lost=event.lost))
    if isinstance(event, Gone):
        return pb.SessionEvent(gone=event.reason, job_ended=event.ended, job_closed=event.closed)
    raise TypeError(f"not a session event: {elide(event)}")


def _slices(encoding: WorldEncoding, seats: Iterator[SeatInWorld], first: int, each: int, head: bytes = b"") -> Iterator[bytes]:
    """`head`, then the seats' assignments: the first's as field `first` and every one's as
    field `each` (tags), ANSWER_SLICE at a time: a message's bytes, to be joined."""
    out = [head]
    for i, seat in enumerate(seats):
        assignment = encoding.assignment(seat)
        if i == 0:
            out.append(wire.field(first, assignment))
        out.append(wire.field(each, assignment))
        if len(out) >= ANSWER_SLICE:
            yield b"".join(out)
            out = []
    if out:
        yield b"".join(out)


# -- descriptions and events ------------------------------------------------------------------


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
