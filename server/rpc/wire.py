"""Protobuf's wire format by hand, for what the server encodes once per worker
of a world (a re-form encodes one assignment per worker): a length-delimited
field around bytes encoded ahead, a worker's own assignment fields, and the
response serializer that sends such bytes as they are. The bytes parse to
exactly what the generated classes would make (tests/test_planner.py)."""

from __future__ import annotations

from collections.abc import Callable

from commctx.v1 import rendezvous_pb2 as pb


def varint(n: int) -> bytes:
    """A non-negative integer as a protobuf varint."""
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]


def field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (`tag`: its number << 3 | 2), as protobuf writes it."""
    return _SMALL[tag] + varint(len(payload)) + payload


def own_bytes(rank: int, local_rank: int, previous_rank: int | None, role: str, worker: int) -> bytes:
    """The fields of an Assignment that are one worker's alone, serialized as protobuf would."""
    out = []
    if rank:
        out += (_RANK, varint(rank))
    if local_rank:
        out += (_LOCAL_RANK, varint(local_rank))
    if role:
        data = role.encode()
        out += (_ROLE, varint(len(data)), data)
    if previous_rank is not None:
        out += (_PREVIOUS_RANK, varint(previous_rank))
    if worker:
        out += (_WORKER, varint(worker))
    return b"".join(out)


def pass_bytes(serialize: Callable[[object], bytes]) -> Callable[[object], bytes]:
    """A response serializer that sends bytes as they are (messages encoded
    ahead, as the codec's assignments are) and serializes anything else."""
    return lambda message: message if type(message) is bytes else serialize(message)


def _tag(name: str, wire_type: int) -> bytes:
    return varint(pb.Assignment.DESCRIPTOR.fields_by_name[name].number << 3 | wire_type)


_RANK, _LOCAL_RANK, _PREVIOUS_RANK, _WORKER = (_tag(n, 0) for n in ("rank", "local_rank", "previous_rank", "worker"))
_ROLE = _tag("role", 2)
