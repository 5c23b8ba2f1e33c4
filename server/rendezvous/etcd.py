"""The etcd v3 store: the same records and fencing contract as SQLite, kept
under a key prefix of an existing etcd cluster, so that several replicas can
share them (server/ha.py elects the one that writes).

Keys under the prefix (default `/commctx`):

    {prefix}/leader                       the writer: its address, on its election lease (HA)
    {prefix}/jobs/{job_id}                a JobRecord, JSON with named fields
    {prefix}/worlds/{job_id}/{digest}/{i} a world too big for one request, in parts (WORLD_PART_BYTES)
    {prefix}/members/{job_id}/{member_id} a MemberRecord, JSON with named fields
    {prefix}/events/{job_id}/{seq:020}    a JobEvent of the job's history, JSON with named fields

Fencing: the epoch is the leader key's `mod_revision` as its writer wrote it.
Every commit is a transaction comparing it, so a writer whose key expired or
was replaced writes nothing. A batch bigger than one transaction may hold
(`max_txn_ops`, etcd's `--max-txn-ops`, 128 by default; about 1 MiB) goes as
several, each fenced, in order: a writer fenced half-way leaves the first part
written, which is the state the transitions had reached before it (the writes
are in transition order, and nothing of the batch was announced).

Client: etcd's own v3 gRPC API through the stubs the `aetcd` package
generates from etcd's protos (aetcd.rpc): the one maintained asyncio client
that imports under protobuf 7 and grpcio 1.8x. Its Client class has neither
TLS nor several endpoints, so the channels are made here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
from aetcd import rpc

from commctx.common.planning import JobSpec

from .model import JobEvent
from .store import (
    DeleteJob,
    DeleteMember,
    Fenced,
    JobRecord,
    MemberRecord,
    PutEvent,
    PutJob,
    PutMember,
    Store,
    StoreError,
    TrimEvents,
    Write,
    seats_from_record,
    seats_record,
)

MAX_TXN_BYTES = 1 << 20  # etcd refuses requests over --max-request-bytes (1.5 MiB by default)
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 1 << 30),  # a full load of a big server's state
    ("grpc.max_send_message_length", 2 << 20),
    # A dead connection to a member (partitioned away, frozen) is left within
    # 13 s for the next member (etcd refuses pings more often than every 5 s).
    # gRPC core closes on ping_timeout (default: a minute), not on the
    # keepalive timeout, so both are set.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 3_000),
    ("grpc.http2.ping_timeout_ms", 3_000),
    # A member back is dialled again within 2 s (gRPC's default backoff grows
    # to two minutes): the lease keeper's channel must not still be waiting
    # out its backoff after a partition heals while the election's channel has
    # already won, or the new leader loses its lease within E. (The "min" is
    # the time a connection attempt is given.)
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 2_000),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


@dataclasses.dataclass(frozen=True)
class EtcdConfig:
    """How to reach etcd: `host:port` endpoints, the key prefix, TLS (PEM bytes)
    and a user, all optional but the endpoints."""

    endpoints: tuple[str, ...]
    prefix: str = "/commctx"
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    user: str = ""
    password: str = ""
    timeout_s: float = 5.0
    max_txn_ops: int = 128

    def key_of(self, *parts: str) -> bytes:
        return "/".join((self.prefix.rstrip("/"), *parts)).encode()

    @property
    def leader_key(self) -> bytes:
        return self.key_of("leader")

    def describe(self) -> str:
        return f"etcd {','.join(self.endpoints)}"


def target_and_options(config: EtcdConfig) -> tuple[str, list[tuple[str, Any]]]:
    """One gRPC target over every endpoint (pick_first tries them in order and
    moves on when one fails), and the channel options it needs.

    Raises:
        StoreError: an endpoint that is not host:port or does not resolve.
    """
    addresses, family = [], None
    for endpoint in config.endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise StoreError(f"--etcd-endpoints: {endpoint!r} is not host:port")
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            raise StoreError(f"--etcd-endpoints: cannot resolve {host!r}: {exc}") from None
        for info in infos:
            family = family or info[0]
            if info[0] == family:
                ip = info[4][0]
                addresses.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
                break
    options = list(CHANNEL_OPTIONS)
    if config.ca or config.cert:
        first_host = config.endpoints[0].rpartition(":")[0].strip("[]")
        options.append(("grpc.ssl_target_name_override", first_host))  # certificates name hosts, we dial IPs
    return f"{'ipv6' if family == socket.AF_INET6 else 'ipv4'}:{','.join(addresses)}", options


def credentials(config: EtcdConfig) -> grpc.ChannelCredentials | None:
    if not (config.ca or config.cert):
        return None
    return grpc.ssl_channel_credentials(config.ca, config.key, config.cert)


WORLD_PART_BYTES = 512 * 1024  # a world's JSON above this is kept in parts: a large world's would pass MAX_TXN_BYTES


def job_value(job: JobRecord) -> tuple[bytes, str, list[bytes]]:
    """The job key's value, and a world too big to go in it: its digest and parts
    (the value then names them: "world_parts": [digest, count]); else "" and none."""
    world = json.dumps(seats_record(job.world), separators=(",", ":")).encode() if job.world is not None else b"null"
    digest, parts = "", []
    if len(world) > WORLD_PART_BYTES:
        digest = hashlib.sha256(world).hexdigest()[:32]
        parts = [world[i:i + WORLD_PART_BYTES] for i in range(0, len(world), WORLD_PART_BYTES)]
        world = b"null"
    head = json.dumps({
        "job_id": job.job_id, "spec": job.spec.to_json(), "state": job.state, "generation": job.generation,
        "reason": job.reason, "seal": job.seal, "since": job.since, "retained_until": job.retained_until,
        "run": job.run, "started": job.started, "ended": job.ended,
        **({"world_parts": [digest, len(parts)]} if parts else {}),
    }, separators=(",", ":")).encode()
    return head[:-1] + b',"world":' + world + b"}", digest, parts


def member_value(job_id: str, m: MemberRecord) -> bytes:
    return json.dumps({"job_id": job_id, **m._asdict()}, separators=(",", ":")).encode()


def event_value(job_id: str, e: JobEvent) -> bytes:
    return json.dumps({"job_id": job_id, "seq": e.seq, "time": e.time, "kind": e.kind, "generation": e.generation,
                       "message": e.message, "fields": dict(e.fields)}, separators=(",", ":")).encode()


def event_key(config: EtcdConfig, job_id: str, seq: int) -> bytes:
    return config.key_of("events", job_id, f"{seq:020d}")


def records_of(jobs: Sequence[bytes], members: Sequence[bytes], events: Sequence[bytes] = (),
               worlds: Mapping[bytes, bytes] | None = None, config: EtcdConfig | None = None) -> list[JobRecord]:
    """JobRecords from the values of job, member and event keys (and the parts
    of worlds kept apart, by key), ordered by job id, each job's members in join
    order and events by seq (those without their job are dropped)."""
    by_job: dict[str, list[MemberRecord]] = {}
    for value in members:
        m = json.loads(value)
        job_id = m.pop("job_id")
        m["slots"] = tuple(map(tuple, m.get("slots", ())))
        by_job.setdefault(job_id, []).append(MemberRecord(**m))
    history: dict[str, list[JobEvent]] = {}
    for value in events:
        e = json.loads(value)
        history.setdefault(e.pop("job_id"), []).append(JobEvent(**e))
    out = []
    for value in jobs:
        j = json.loads(value)
        if "world_parts" in j:  # written apart: its parts, in order, under the digest the job names
            digest, count = j["world_parts"]
            j["world"] = json.loads(b"".join((worlds or {})[config.key_of("worlds", j["job_id"], digest, f"{i:06d}")]
                                             for i in range(count)))
        world = seats_from_record(j["world"]) if j["world"] is not None else None
        ms = tuple(sorted(by_job.get(j["job_id"], ()), key=lambda m: m.seq))
        out.append(JobRecord(j["job_id"], JobSpec.from_json(j["spec"]), j["state"], j["generation"], j["reason"],
                             world, ms, j["seal"], j.get("since", 0.0), j.get("retained_until", 0.0),
                             tuple(sorted(history.get(j["job_id"], ()))), j.get("run", 1), j.get("started", 0.0),
                             j.get("ended", 0.0)))
    return sorted(out, key=lambda j: j.job_id)


def prefix_end(key: bytes) -> bytes:
    """The end of the key range of every key that starts with `key`."""
    return key[:-1] + bytes([key[-1] + 1])


class _Txn:
    """The operations of one transaction: at most one per key, no put inside a deleted range."""

    def __init__(self) -> None:
        self.ops: dict[bytes, rpc.RequestOp] = {}
        self.ranges: list[tuple[bytes, bytes]] = []
        self.size = 0

    def clashes(self, key: bytes) -> bool:
        return any(start <= key < end for start, end in self.ranges)


def transactions(config: EtcdConfig, writes: Sequence[Write], parted: set[str] | None = None) -> Iterator[list[rpc.RequestOp]]:
    """The writes as etcd operations, grouped into transactions etcd accepts:
    a later write of a key replaces an earlier one of the same transaction, and
    a put after a range delete that covers it starts the next transaction.
    `parted`: the jobs whose world is kept in parts (updated here); None: any may be."""
    unknown = parted is None
    parted = set() if parted is None else parted
    txn = _Txn()

    def add(key: bytes, op: rpc.RequestOp, size: int) -> Iterator[list[rpc.RequestOp]]:
        nonlocal txn
        if txn.clashes(key) or (key not in txn.ops and (len(txn.ops) + len(txn.ranges) >= config.max_txn_ops
                                                        or txn.size + size > MAX_TXN_BYTES)):
            yield list(txn.ops.values()) + [_delete(s, e) for s, e in txn.ranges]
            txn = _Txn()
        txn.ops[key] = op
        txn.size += size

    def add_range(start: bytes, end: bytes) -> Iterator[list[rpc.RequestOp]]:
        """A range delete: puts of its keys earlier in this transaction are superseded."""
        nonlocal txn
        if len(txn.ops) + len(txn.ranges) >= config.max_txn_ops:
            yield list(txn.ops.values()) + [_delete(s, e) for s, e in txn.ranges]
            txn = _Txn()
        for k in [k for k in txn.ops if start <= k < end]:
            del txn.ops[k]
        txn.ranges.append((start, end))

    for w in writes:
        if isinstance(w, PutMember):
            key, value = config.key_of("members", w.job_id, w.record.member_id), member_value(w.job_id, w.record)
            yield from add(key, rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value)), len(value))
        elif isinstance(w, PutJob):
            # A world in parts: its parts first, then the job naming them, then the parts of other worlds
            # of the job go. A writer fenced between these transactions leaves the job naming parts that exist.
            key, (value, digest, parts) = config.key_of("jobs", w.record.job_id), job_value(w.record)
            for i, part in enumerate(parts):
                part_key = config.key_of("worlds", w.record.job_id, digest, f"{i:06d}")
                yield from add(part_key, rpc.RequestOp(request_put=rpc.PutRequest(key=part_key, value=part)), len(part))
            yield from add(key, rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value)), len(value))
            worlds = config.key_of("worlds", w.record.job_id, "")
            if parts:
                mine = config.key_of("worlds", w.record.job_id, digest, "")
                yield from add_range(worlds, mine)
                yield from add_range(prefix_end(mine), prefix_end(worlds))
                parted.add(w.record.job_id)
            elif unknown or w.record.job_id in parted:
                yield from add_range(worlds, prefix_end(worlds))
                parted.discard(w.record.job_id)
        elif isinstance(w, DeleteMember):
            key = config.key_of("members", w.job_id, w.member_id)
            yield from add(key, rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)), len(key))
        elif isinstance(w, PutEvent):
            key, value = event_key(config, w.job_id, w.event.seq), event_value(w.job_id, w.event)
            yield from add(key, rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value)), len(value))
        elif isinstance(w, TrimEvents):
            yield from add_range(config.key_of("events", w.job_id, ""), event_key(config, w.job_id, w.first_kept))
        elif isinstance(w, DeleteJob):
            key = config.key_of("jobs", w.job_id)
            yield from add(key, rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)), len(key))
            kinds = ("members", "events", "worlds") if unknown or w.job_id in parted else ("members", "events")
            parted.discard(w.job_id)
            for kind in kinds:
                start = config.key_of(kind, w.job_id, "")
                yield from add_range(start, prefix_end(start))
    if txn.ops or txn.ranges:
        yield list(txn.ops.values()) + [_delete(s, e) for s, e in txn.ranges]


def _delete(start: bytes, end: bytes) -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=start, range_end=end))


def fence(config: EtcdConfig, epoch: int) -> rpc.Compare:
    """True while the leader key is as the writer of `epoch` left it."""
    return rpc.Compare(key=config.leader_key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=epoch)


class EtcdStore(Store):
    """The store in etcd, through a blocking channel (commits run in a worker thread)."""

    blocking = True

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        target, options = target_and_options(config)
        creds = credentials(config)
        self.channel = grpc.secure_channel(target, creds, options) if creds else grpc.insecure_channel(target, options)
        self._kv = rpc.KVStub(self.channel)
        self._auth = rpc.AuthStub(self.channel)
        self._token: tuple[tuple[str, str], ...] = ()
        self._lock = threading.Lock()
        self._parted: set[str] | None = None  # jobs whose world is in parts; None until a load says (then: any may be)

    def _call(self, method, request):
        """One KV call with the user's token (fetched, and again once it expires).

        Raises:
            StoreError: etcd cannot be reached or refuses, naming the endpoints.
        """
        for attempt in range(2):
            try:
                if self.config.user and (not self._token or attempt):
                    reply = self._auth.Authenticate(rpc.AuthenticateRequest(name=self.config.user, password=self.config.password),
                                                    timeout=self.config.timeout_s)
                    self._token = (("token", reply.token),)
                return method(request, timeout=self.config.timeout_s, metadata=self._token)
            except grpc.RpcError as exc:
                expired = "auth token" in (exc.details() or "") and self.config.user
                if attempt or not expired:
                    raise StoreError(f"{self.config.describe()}: {exc.code().name}: {exc.details()}") from None
        raise AssertionError("unreachable")

    def take_over(self) -> int:
        reply = self._call(self._kv.Put, rpc.PutRequest(key=self.config.leader_key, value=b"take_over"))
        return reply.header.revision

    def commit(self, writes: Sequence[Write], epoch: int) -> None:
        with self._lock:
            for ops in list(transactions(self.config, writes, self._parted)) or [[]]:  # an empty commit still checks the fence
                reply = self._call(self._kv.Txn, rpc.TxnRequest(
                    compare=[fence(self.config, epoch)], success=ops,
                    failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=self.config.leader_key))]))
                if not reply.succeeded:
                    kvs = reply.responses[0].response_range.kvs
                    raise Fenced(f"epoch {epoch} was fenced by epoch {kvs[0].mod_revision if kvs else 'none (no leader)'}")

    def load(self) -> list[JobRecord]:
        reply = self._call(self._kv.Txn, rpc.TxnRequest(success=[self._range("jobs"), self._range("members"),
                                                                  self._range("events"), self._range("worlds")]))
        jobs, members, events, worlds = (r.response_range.kvs for r in reply.responses)
        records = records_of([kv.value for kv in jobs], [kv.value for kv in members], [kv.value for kv in events],
                             {kv.key: kv.value for kv in worlds}, self.config)
        with self._lock:
            self._parted = {kv.key.decode().split("/")[-3] for kv in worlds}
        return records

    def _range(self, name: str) -> rpc.RequestOp:
        start = self.config.key_of(name, "")
        return rpc.RequestOp(request_range=rpc.RangeRequest(key=start, range_end=prefix_end(start)))

    def close(self) -> None:
        self.channel.close()
