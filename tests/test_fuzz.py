"""Fuzzing the rendezvous server: at least 10,000 generated requests across all
eight RPCs, against one real server, beside a healthy job.

Why: a rendezvous server faces whatever reaches its port: hostile field
values, truncated or mutated messages, bytes that are no message at all. Each
must get a deliberate answer (OK, or a status code the protocol documents for
that RPC, carrying a google.rpc.ErrorInfo and at most 1 KiB of details), never
UNKNOWN or INTERNAL, within the server's own timeouts; the server must stay up,
and a job formed beforehand must stay formed and undisturbed.

What is sent, in batches of concurrent calls:
- structurally valid messages with random and extreme values: job ids (empty,
  too long, unicode, control characters), specs (world sizes 0 to 2**32-1,
  random layouts, role counts, group rules, cpu twins, expected nodes, elastic
  sizes), member ids and secrets, job secrets, generations, ports, pages;
- worlds of up to 8 workers that form from random coherent specs, then calls
  on the members so formed: renewals, sessions, re-joins, leaves;
- calls aimed at the healthy job with wrong member ids, secrets or specs;
- raw bytes: random, crafted (bad UTF-8, overlong lengths and varints, deep
  groups), mutated or merged serializations, messages of another RPC; for
  Session too, as the first or the last message of a stream.

Reproduce: the generator is seeded (COMMCTX_FUZZ_SEED, default SEED below) and
a failure names the seed and shows each failing request (as text, and as hex
for raw bytes). Which members exist at a point depends on timing, so a
failing request is best replayed from what the failure shows.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import random
import string
import time

import grpc
import pytest
from google.protobuf import text_format
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commctx.server import start_server
from commctx.common.planning.spec import MAX_WORLD_SIZE
from commctx.server.rendezvous.model import Limits
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .conftest import join_request

Code = grpc.StatusCode

SEED = int(os.environ.get("COMMCTX_FUZZ_SEED", "20250611"))
CALLS = 10_000  # sent at least (a batch that ends with a forming world holds a few more)
BATCH = 200  # calls in flight together
LEASE_TTL_S = 5.0
MAX_JOIN_WAIT_S = 0.25  # the server's cap on any Join's wait: a fuzzed wait_timeout_ms never holds a batch long
WATCH_S = 0.25  # a watch open this long with nothing sent is cancelled (a job's kept events come at once)
CALL_TIMEOUT_S = 20.0  # a backstop only: every call is answered long before (a client-side deadline is a failure)
FUZZ_TIMEOUT_S = 150.0
MAX_DETAILS_BYTES = 1024
HEALTHY = "healthy-job"
SERVICE = "/commctx.v1.Rendezvous/"
CLIENT_RACE = "Internal error from Core"  # grpc.aio's details for a write the ended call refused
U32, U64 = (1 << 32) - 1, (1 << 64) - 1

REQUEST_TYPES: dict[str, type[Message]] = {
    "Join": pb.JoinRequest, "Session": pb.SessionRequest, "KeepAlive": pb.KeepAliveRequest,
    "Leave": pb.LeaveRequest, "DescribeJob": pb.DescribeJobRequest, "ListJobs": pb.ListJobsRequest,
    "ListEvents": pb.ListEventsRequest, "WatchEvents": pb.WatchEventsRequest,
}
RESPONSE_TYPES: dict[str, type[Message]] = {
    "Join": pb.JoinResponse, "Session": pb.SessionEvent, "KeepAlive": pb.KeepAliveResponse,
    "Leave": pb.LeaveResponse, "DescribeJob": pb.JobDescription, "ListJobs": pb.ListJobsResponse,
    "ListEvents": pb.ListEventsResponse, "WatchEvents": pb.JobEvent,
}
# What each RPC may answer, per the protocol's comments. Everything else is a
# failure: UNKNOWN and INTERNAL above all, UNAVAILABLE (a server down), and a
# DEADLINE_EXCEEDED that is not the server's own Join wait timeout.
EXPECTED: dict[str, frozenset[Code]] = {
    "Join": frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.ALREADY_EXISTS, Code.RESOURCE_EXHAUSTED,
                       Code.PERMISSION_DENIED, Code.NOT_FOUND, Code.DEADLINE_EXCEEDED}),
    # An unknown member is told `gone` on an OK stream; a session naming an older generation than its member's
    # sessions did is FAILED_PRECONDITION; one that a newer session of its member replaced ends ABORTED.
    "Session": frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.ABORTED}),
    "KeepAlive": frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION}),
    # RESOURCE_EXHAUSTED where a job's secret is asked: a caller guessing it is throttled.
    "Leave": frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.PERMISSION_DENIED, Code.RESOURCE_EXHAUSTED}),
    "DescribeJob": frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.PERMISSION_DENIED,
                              Code.RESOURCE_EXHAUSTED}),
    "ListJobs": frozenset({Code.OK, Code.INVALID_ARGUMENT}),
    "ListEvents": frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.PERMISSION_DENIED,
                             Code.RESOURCE_EXHAUSTED}),
    # A watch is read for its first event, then cancelled by the fuzzer (CANCELLED is its own doing).
    "WatchEvents": frozenset({Code.OK, Code.CANCELLED, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.PERMISSION_DENIED,
                              Code.RESOURCE_EXHAUSTED}),
}
REASONS: dict[Code, frozenset[str]] = {  # the ErrorInfo reasons each code comes with
    Code.INVALID_ARGUMENT: frozenset({"INVALID_REQUEST"}),
    Code.FAILED_PRECONDITION: frozenset({"JOB_CONFLICT", "STALE_GENERATION", "JOB_CLOSED"}),
    Code.ABORTED: frozenset({"SESSION_REPLACED"}),
    Code.ALREADY_EXISTS: frozenset({"RANK_TAKEN"}),
    Code.RESOURCE_EXHAUSTED: frozenset({"JOB_FULL", "SERVER_FULL"}),
    Code.NOT_FOUND: frozenset({"MEMBER_NOT_FOUND"}),
    Code.DEADLINE_EXCEEDED: frozenset({"RENDEZVOUS_TIMEOUT"}),
    Code.PERMISSION_DENIED: frozenset({"JOB_SEALED"}),
}
WEIGHTS = {"Join": 24, "Session": 14, "KeepAlive": 16, "Leave": 12, "DescribeJob": 16, "ListJobs": 8, "ListEvents": 8,
           "WatchEvents": 8}
FORMATION_SHARE = 0.06  # of the cases: a world of 1-8 workers joining together
RAW_SHARE = 0.3  # of the calls: bytes rather than a message built field by field

DIMS = ("tp", "cp", "ep", "dp", "pp")
ROLES = ("trainer", "rollout", "ref", "reward")
MODES = ("TRAIN_DATA_PARALLEL", "WEIGHT_SYNC", "ACTORS", "x.y-z_1", "GLOBAL", "TENSOR_PARALLEL")
HOSTILE = (
    "", " ", "a" * 128, "a" * 129, "a" * 253, "a" * 254, "-lead", ".lead", "_lead", "x/y", "x y", "x\x00y", "\x00",
    "line\nbreak", "tab\t", "é" * 40, "ジョブ", "😀" * 8, "\u202egnp.exe", "\ufeffjob", "Ａ", "DROP TABLE jobs;--",
    "../../etc/passwd", "%s%n%x", "{}", "null", "a" * 4096, "0" * 64, "f" * 65, "F" * 32, "GLOBAL", "trainer",
)
ADDRESSES = ("127.0.0.1", "127.0.0.2", "::1", "10.0.0.7", "fe80::1", "::ffff:127.0.0.1", "0.0.0.0", "::", "", "localhost",
             "256.1.1.1", "1.2.3", "127.0.0.1\x00", "fe80::1%eth0", "[::1]", "1::2::3", "::ffff:10.1.2.3")


@dataclasses.dataclass(frozen=True)
class Call:
    """One call: a unary request's bytes, or the messages of a Session stream."""

    rpc: str
    payload: bytes | tuple[bytes, ...]
    raw: bool  # bytes that were not built as a message of this RPC

    def shown(self) -> str:
        """The request in words, for a failure message: as text where it parses, else as hex."""
        parts = self.payload if isinstance(self.payload, tuple) else (self.payload,)
        out = []
        for part in parts:
            try:
                text = "{" + text_format.MessageToString(REQUEST_TYPES[self.rpc].FromString(part), as_one_line=True) + "}"
            except DecodeError:
                text = ""
            if self.raw or not text:  # the exact bytes, unknown fields and all
                text = f"bytes.fromhex({part.hex()!r}) {text}".rstrip()
            out.append(text if len(text) <= 600 else text[:597] + "...")
        return f"{self.rpc}{' raw' if self.raw else ''} " + (" | ".join(out) if isinstance(self.payload, tuple) else out[0])


@dataclasses.dataclass(frozen=True)
class Result:
    """A call's answer: its status, trailers and response bytes (a Session's events)."""

    code: Code
    details: str
    trailing: tuple[tuple[str, str | bytes], ...]
    responses: tuple[bytes, ...]
    write_failed: bool = False  # a write to a Session stream failed: the call had ended

    def client_race(self) -> bool:
        """Whether this is grpc.aio's own INTERNAL for a write that raced the end of a
        stream (grpc/grpc#36066), standing in for the server's unknown answer."""
        return (self.write_failed and self.code is Code.INTERNAL and self.details == CLIENT_RACE
                and not any(key == "grpc-status-details-bin" for key, _ in self.trailing))


@dataclasses.dataclass
class Member:
    """A member a fuzzed Join created, with what it takes to call on it."""

    job_id: str
    member_id: str
    secret: str
    generation: int
    join: bytes  # the JoinRequest that made it, to re-join with


@dataclasses.dataclass
class Tally:
    """What the fuzz sent and what it got back; the failures, each with its request."""

    seed: int
    calls: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    raw: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    codes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    by_rpc: collections.Counter[tuple[str, str]] = dataclasses.field(default_factory=collections.Counter)
    client_races: int = 0  # Session answers grpc.aio replaced (Result.client_race)
    sessions_opened: int = 0  # Session streams the server answered with a lease
    failures: list[str] = dataclasses.field(default_factory=list)

    def record(self, call: Call, result: Result) -> None:
        self.calls[call.rpc] += 1
        self.raw[call.rpc] += call.raw
        self.codes[result.code.name] += 1
        self.by_rpc[call.rpc, result.code.name] += 1
        if call.rpc == "Session" and result.responses and _opens(result.responses[0]):
            self.sessions_opened += 1
        if result.client_race():
            self.client_races += 1
            return
        for problem in problems(call, result):
            self.failures.append(f"{problem}\n      details: {result.details[:300]!r}\n      request: {call.shown()}")

    def summary(self) -> str:
        per_rpc = {rpc: {code: n for (r, code), n in sorted(self.by_rpc.items()) if r == rpc} for rpc in self.calls}
        return (f"seed {self.seed} (COMMCTX_FUZZ_SEED): {sum(self.calls.values())} calls, {sum(self.raw.values())} of them raw "
                f"bytes, {self.sessions_opened} sessions opened; per RPC {dict(self.calls)}; "
                f"codes {dict(self.codes.most_common())}; per RPC and code {per_rpc}"
                + (f"; {self.client_races} Session answers lost to grpc.aio's write race" if self.client_races else ""))

    def report(self) -> str:
        shown = self.failures[:25]
        more = f"\n  ... and {len(self.failures) - len(shown)} more" if len(self.failures) > len(shown) else ""
        return self.summary() + f"\n{len(self.failures)} failures:\n  " + "\n  ".join(shown) + more


def error_info(trailing: tuple[tuple[str, str | bytes], ...]) -> tuple[int, str, str, str] | None:
    """(code, message, reason, domain) of the google.rpc.Status in a call's trailers, if it carries one."""
    for key, value in trailing:
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return status.code, status.message, info.reason, info.domain
            return status.code, status.message, "", ""
    return None


def problems(call: Call, result: Result) -> list[str]:
    """What is wrong with an answer: an unexpected code, an error without its
    ErrorInfo or with details over 1 KiB, a response that does not parse."""
    code = result.code
    if code not in EXPECTED[call.rpc]:
        return [f"{call.rpc} answered {code.name}"]
    out = []
    if code not in (Code.OK, Code.CANCELLED):
        size = len(result.details.encode())
        if size > MAX_DETAILS_BYTES:
            out.append(f"{call.rpc} {code.name}: details are {size} bytes, over {MAX_DETAILS_BYTES}")
        info = error_info(result.trailing)
        if info is None:
            out.append(f"{call.rpc} {code.name} without a google.rpc.Status (a client-side deadline means no answer"
                       f" within {CALL_TIMEOUT_S:g} s)")
        else:
            status_code, message, reason, domain = info
            if status_code != code.value[0] or message != result.details:
                out.append(f"{call.rpc} {code.name}: the rich status says {status_code} {message!r}")
            if domain != "commctx" or reason not in REASONS.get(code, ()):
                out.append(f"{call.rpc} {code.name}: ErrorInfo reason {reason!r} domain {domain!r}")
    response_type = RESPONSE_TYPES[call.rpc]
    for i, data in enumerate(result.responses):
        try:
            response = response_type.FromString(data)
        except DecodeError:
            out.append(f"{call.rpc}: response {i} does not parse as {response_type.__name__}")
            continue
        if call.rpc == "Session" and response.WhichOneof("event") == "gone" and i != len(result.responses) - 1:
            out.append("Session: events after `gone`")
        if call.rpc == "Join":
            a = response.assignment
            asked = pb.JoinRequest.FromString(call.payload).job_id if isinstance(call.payload, bytes) else ""
            if not (a.job_id == asked and 1 <= a.generation and a.rank < a.world_size and response.member_id and response.member_secret):
                out.append(f"Join OK with a malformed assignment {text_format.MessageToString(response, as_one_line=True)[:300]}")
    return out


async def send(channel: grpc.aio.Channel, call: Call) -> Result:
    """Sends one call as bytes (no serializer either way) and collects its answer."""
    path = SERVICE + call.rpc
    if call.rpc == "WatchEvents":  # a stream that lasts the job's life: its first event (or its end), then cancelled
        watch = channel.unary_stream(path)(call.payload, timeout=CALL_TIMEOUT_S)
        try:
            first = await asyncio.wait_for(watch.read(), WATCH_S)
        except asyncio.TimeoutError:  # open, with nothing kept to send yet: cancelled by wait_for
            return Result(Code.CANCELLED, "", (), ())
        except grpc.aio.AioRpcError as err:
            return Result(err.code(), err.details() or "", tuple(err.trailing_metadata() or ()), ())
        if first is grpc.aio.EOF:
            return Result(await watch.code(), "", (), ())
        watch.cancel()
        return Result(Code.CANCELLED, "", (), (first,))
    if isinstance(call.payload, bytes):
        try:
            response = await channel.unary_unary(path)(call.payload, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            return Result(err.code(), err.details() or "", tuple(err.trailing_metadata() or ()), ())
        return Result(Code.OK, "", (), (response,))
    # A Session: the first message, then its answer: the session opens (a lease
    # event) or the server ends the stream. Only an open session gets the rest,
    # so that no write races the end of the call (grpc.aio would then replace
    # the server's status with its own INTERNAL; see CLIENT_RACE).
    stream = channel.stream_stream(path)(timeout=CALL_TIMEOUT_S)
    events: list[bytes] = []
    try:
        if call.payload:
            await stream.write(call.payload[0])
            first = await stream.read()
            if first is grpc.aio.EOF:
                return await _finish(stream, events)
            events.append(first)
            if not _opens(first):
                return await _finish(stream, events)
    except grpc.aio.AioRpcError:
        return await _finish(stream, events)  # the server ended the stream at once; its status says why
    try:
        for message in call.payload[1:]:
            await stream.write(message)
        await stream.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):  # the session ended meanwhile (its member left or expired)
        return await _finish(stream, events, write_failed=True)
    return await _finish(stream, events)


def _opens(event: bytes) -> bool:
    """Whether a Session's first event is the lease: the session is open and reads on."""
    try:
        return pb.SessionEvent.FromString(event).WhichOneof("event") == "lease_ttl_ms"
    except DecodeError:
        return False


async def _finish(stream: grpc.aio.StreamStreamCall, events: list[bytes], write_failed: bool = False) -> Result:
    """A Session's answer: the events left to read, then its status."""
    try:
        while (event := await stream.read()) is not grpc.aio.EOF:
            events.append(event)
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass
    return Result(await stream.code(), await stream.details() or "", tuple(await stream.trailing_metadata() or ()),
                  tuple(events), write_failed)


class Fuzzer:
    """Generates the calls, from one seeded generator and what earlier calls created."""

    def __init__(self, rng: random.Random, healthy: list[pb.JoinResponse], healthy_spec: pb.JobSpec) -> None:
        self.rng = rng
        self.healthy_spec = healthy_spec
        self.healthy_ids = [m.member_id for m in healthy]
        self._healthy_secrets = {m.member_secret for m in healthy}  # never sent: only to check none is guessed
        self.members: collections.deque[Member] = collections.deque(maxlen=400)
        self.jobs: dict[str, tuple[pb.JobSpec, str]] = {}  # recent job ids: their spec and job secret
        self.serial = 0

    # -- values ----------------------------------------------------------------

    def hexs(self, n: int) -> str:
        return f"{self.rng.getrandbits(4 * n):0{n}x}" if n else ""

    def text(self) -> str:
        """A hostile string: a listed one, random printable, random code points, or a near-valid id."""
        r = self.rng
        kind = r.randrange(5)
        if kind == 0:
            return r.choice(HOSTILE)
        if kind == 1:
            return "".join(r.choices(string.printable, k=r.randrange(1, 40)))
        if kind == 2:  # any code point but surrogates (protobuf strings are valid UTF-8; raw bytes carry the rest)
            return "".join(chr(r.choice((r.randrange(0x20), r.randrange(0x20, 0xD800), r.randrange(0xE000, 0x110000))))
                           for _ in range(r.randrange(1, 24)))
        if kind == 3:
            return r.choice(string.ascii_letters) + "".join(r.choices(string.ascii_letters + string.digits + "._-:", k=r.randrange(200)))
        return r.choice(HOSTILE) + self.hexs(r.randrange(1, 8))

    def u32(self) -> int:
        r = self.rng
        return r.choice((0, 1, 2, 3, 4, 7, 8, 255, 65535, 65536, MAX_WORLD_SIZE, MAX_WORLD_SIZE + 1, 1 << 31, U32, r.randrange(U32 + 1)))

    def generation(self) -> int:
        r = self.rng
        return r.choice((0, 0, 1, 1, 2, 3, 1 << 31, 1 << 32, 1 << 63, U64, r.randrange(U64 + 1)))

    def fresh_job(self) -> str:
        self.serial += 1
        return f"fz-{self.serial}"

    def job_id(self) -> str:
        r = self.rng.random()
        if r < 0.35:
            return self.fresh_job()
        if r < 0.6 and self.jobs:
            return self.rng.choice(list(self.jobs))
        if r < 0.67:
            return HEALTHY
        return self.text()

    def member_id(self) -> str:
        r = self.rng
        return r.choice((
            lambda: r.choice(self.members).member_id if self.members else "",
            lambda: r.choice(self.healthy_ids),
            lambda: self.hexs(r.randrange(16, 65)),
            lambda: self.hexs(32),
            lambda: self.hexs(r.choice((1, 15, 65, 200))),
            lambda: self.hexs(32).upper(),
            lambda: "",
            self.text,
        ))()

    def member_secret(self) -> str:
        r = self.rng
        secret = r.choice((
            lambda: self.hexs(r.randrange(32, 129)),
            lambda: self.hexs(32),
            lambda: self.hexs(r.choice((31, 129, 1000))),
            lambda: self.hexs(64).upper(),
            lambda: "",
            self.text,
        ))()
        assert secret not in self._healthy_secrets
        return secret

    def job_secret(self) -> str:
        r = self.rng
        if r.random() < 0.7:
            return ""
        return r.choice((
            lambda: "".join(r.choices(string.ascii_letters + string.digits + string.punctuation, k=r.randrange(8, 257))),
            lambda: "s3cret-" + self.hexs(8),
            lambda: "short",
            lambda: "x" * 257,
            lambda: "with space",
            lambda: "ünïcode-secret",
            lambda: "ctrl\x01chars",
            self.text,
        ))()

    # -- specs -----------------------------------------------------------------

    def spec(self) -> pb.JobSpec:
        """A spec with random, often out-of-range, fields (a third of them coherent)."""
        r = self.rng
        if r.random() < 0.33:
            return self.coherent_spec()[0]
        spec = pb.JobSpec(world_size=r.choice((0, 1, 1, 2, 3, 4, 8, 64, MAX_WORLD_SIZE, MAX_WORLD_SIZE + 1, U32, r.randrange(U32 + 1))))
        if r.random() < 0.3:
            for d in r.sample(DIMS, r.randrange(6)):
                setattr(spec.layout, d, r.choice((0, 1, 2, 3, 4, 8, U32, r.randrange(1 << 16))))
            if r.random() < 0.5:
                spec.layout.order = "-".join(r.sample((*DIMS, "xx", "", "TP"), r.randrange(8))) if r.random() < 0.8 else self.text()
            if r.random() < 0.3:
                spec.layout.within_node.extend(r.sample((*DIMS, "tp", "node", ""), r.randrange(4)))
        if r.random() < 0.25:
            for _ in range(r.choice((1, 2, 3, 9, 40))):
                spec.roles.add(role=r.choice((*ROLES, *ROLES, self.text())), count=r.choice((0, 1, 2, 3, U32, r.randrange(1 << 12))))
        if r.random() < 0.3:
            for _ in range(r.randrange(1, 6)):
                spec.groups.append(self.rule(self.rng.randrange(1, 10), ROLES))
        if r.random() < 0.15:
            spec.cpu_twins.extend(r.choice((*MODES, "INTRA_NODE", "NOPE", "")) for _ in range(r.randrange(1, 4)))
        if r.random() < 0.1:
            n = r.choice((1, 3, 20, 1100))  # 1,100 names are over --max-spec-rules
            spec.expected_nodes.extend(r.choice((f"node{i}", self.text())) for i in range(n))
        if r.random() < 0.005:
            spec.expected_nodes.append("n" + "x" * 70_000)  # over --max-spec-bytes
        if r.random() < 0.15:
            spec.elastic.min_size = r.choice((0, 1, 2, spec.world_size, min(spec.world_size + 1, U32), U32))
            if r.random() < 0.7:
                spec.elastic.last_call_ms = r.choice((0, 1, 20, 3_600_000, 3_600_001, U32))
        return spec

    def rule(self, world_size: int, roles: tuple[str, ...]) -> pb.GroupRule:
        """A group rule: coherent for `world_size` and `roles` as often as not."""
        r = self.rng
        rule = pb.GroupRule(mode=r.choice((*MODES, self.text())) if r.random() < 0.2 else f"R{self.hexs(6)}")
        scope = r.choice((pb.SCOPE_JOB, pb.SCOPE_NODE, pb.SCOPE_NODE, 7, -1))

        def role() -> str:
            return r.choice(roles) if roles and r.random() < 0.9 else self.text()

        kind = r.randrange(4)
        if kind == 0:
            rule.role_group.roles.extend(role() for _ in range(r.randrange(4)))
            rule.role_group.scope = scope
        elif kind == 1:
            rule.weight_transfer.sender_role = role()
            rule.weight_transfer.receiver_roles.extend(role() for _ in range(r.randrange(4)))
            rule.weight_transfer.scope = scope
        elif kind == 2:
            ranks = list(range(world_size))
            r.shuffle(ranks)
            if r.random() < 0.2:
                ranks += [r.randrange(world_size + 3), r.choice((world_size, U32))]  # a rank twice, or out of range
            cut = sorted(r.sample(range(1, len(ranks)), min(len(ranks) - 1, r.randrange(3)))) if len(ranks) > 1 else []
            for lo, hi in zip([0, *cut], [*cut, len(ranks)]):
                rule.named.groups.add(ranks=ranks[lo:hi][: r.randrange(1, hi - lo + 1)])
            if r.random() < 0.1:
                rule.named.groups.add()  # an empty rank list
        return rule  # kind 3: no kind at all

    def coherent_spec(self) -> tuple[pb.JobSpec, list[str]]:
        """A spec a world of its size can usually satisfy, and the role of each of its workers."""
        r = self.rng
        n = r.choice((1, 1, 2, 2, 3, 4, 4, 6, 8))
        spec = pb.JobSpec(world_size=n)
        worker_roles = [""] * n
        if r.random() < 0.4:
            tp = r.choice([d for d in range(1, n + 1) if n % d == 0])
            pp = r.choice([d for d in range(1, n // tp + 1) if (n // tp) % d == 0])
            spec.layout.tp, spec.layout.pp = tp, pp
            if r.random() < 0.3:
                spec.layout.dp = n // (tp * pp)
            if r.random() < 0.5:
                spec.layout.order = "-".join(r.sample(DIMS, 5))
            if r.random() < 0.3:
                spec.layout.within_node.append(r.choice(("tp", "pp", "dp")))
        roles: tuple[str, ...] = ()
        if r.random() < 0.4:
            roles = tuple(r.sample(ROLES, min(n, r.randrange(1, 4))))
            worker_roles = list(roles) + [r.choice(roles) for _ in range(n - len(roles))]
            r.shuffle(worker_roles)
            for role, count in collections.Counter(worker_roles).items():
                spec.roles.add(role=role, count=count)
        elif r.random() < 0.3:  # undeclared roles: any goes
            worker_roles = [r.choice(("", *ROLES)) for _ in range(n)]
        if r.random() < 0.5:
            for _ in range(r.randrange(1, 4)):
                spec.groups.append(self.rule(n, roles or ROLES))
        if r.random() < 0.3:
            defined = ["GLOBAL", "INTRA_NODE", "INTER_NODE", *(g.mode for g in spec.groups)]
            if spec.HasField("layout"):
                defined.append("TENSOR_PARALLEL")
            spec.cpu_twins.extend(r.sample(defined, r.randrange(1, 3)))
        if r.random() < 0.15 and not spec.roles and not spec.layout.dp:
            spec.elastic.min_size = r.randrange(1, n + 1)
            spec.elastic.last_call_ms = r.randrange(0, 30)
        return spec, worker_roles

    # -- requests --------------------------------------------------------------

    def join(self) -> pb.JoinRequest:
        r = self.rng
        job_id = self.job_id()
        known = self.jobs.get(job_id)
        if job_id == HEALTHY and r.random() < 0.6:  # its own spec (the job is full) or a near one
            spec = r.choice((self.healthy_spec, pb.JobSpec(world_size=2)))
        elif known is not None and r.random() < 0.6:
            spec = known[0]
        else:
            spec = self.spec()
        request = pb.JoinRequest(
            job_id=job_id, spec=spec,
            node_key=r.choice((f"node{r.randrange(4)}", f"host-{self.hexs(4)}.example:8", self.text())),
            address=r.choice(ADDRESSES) if r.random() < 0.5 else r.choice(ADDRESSES[:3]),
            master_port=r.choice((r.randrange(1, 65536), self.u32())),
            wait_timeout_ms=r.randrange(1, 51) if r.random() < 0.97 else r.choice((0, self.u32())),  # the server caps 0 and the rest
            role=r.choice(("", *ROLES, self.text())),
            member_id=r.choice(("", self.member_id())),
            member_secret=r.choice(("", self.member_secret())),
            job_secret=known[1] if known is not None and r.random() < 0.5 else self.job_secret(),
        )
        if r.random() < 0.3:
            request.local_rank = self.u32() if r.random() < 0.3 else r.randrange(8)
        if r.random() < 0.3:
            request.node_rank = self.u32() if r.random() < 0.3 else r.randrange(8)
        if job_id.startswith("fz-"):
            self.remember_job(job_id, spec, request.job_secret)
        return request

    def remember_job(self, job_id: str, spec: pb.JobSpec, job_secret: str) -> None:
        self.jobs.setdefault(job_id, (spec, job_secret))
        while len(self.jobs) > 300:
            del self.jobs[next(iter(self.jobs))]

    def formation(self) -> list[Call]:
        """A world of 1-8 workers joining together with a coherent spec (now and then a discordant worker)."""
        r = self.rng
        spec, roles = self.coherent_spec()
        n = spec.world_size
        job_id, job_secret = self.fresh_job(), r.choice(("", "", "", "job-" + self.hexs(12)))
        self.remember_job(job_id, spec, job_secret)
        nodes = [f"node{i}" for i in range(r.randrange(1, n + 1))]
        address = r.choice(("127.0.0.1", "::1", "127.0.0.3"))
        calls = []
        for i in range(n):
            w = pb.JoinRequest(job_id=job_id, spec=spec, node_key=r.choice(nodes), address=address,
                               master_port=20000 + i, wait_timeout_ms=200, role=roles[i],
                               member_id=r.choice(("", self.hexs(32))), member_secret=r.choice(("", self.hexs(64))),
                               job_secret=job_secret)
            if r.random() < 0.15:
                w.local_rank = r.randrange(n)
            if r.random() < 0.1:
                w.node_rank = r.randrange(len(nodes))
            if r.random() < 0.05:  # one discordant worker: another address family, role, spec or secret
                r.choice((lambda: setattr(w, "address", "10.0.0.7"), lambda: setattr(w, "role", "stranger"),
                          lambda: setattr(w.spec, "world_size", n + 1), lambda: setattr(w, "job_secret", "other-secret")))()
            calls.append(Call("Join", w.SerializeToString(), raw=False))
        return calls

    def rejoin(self) -> pb.JoinRequest:
        """A member re-joining: as it joined (re-attach), or with one field changed."""
        request = pb.JoinRequest.FromString(self.rng.choice(self.members).join)
        r = self.rng
        change = r.randrange(6)
        if change == 1:
            request.member_secret = self.hexs(64)
        elif change == 2:
            request.master_port = r.randrange(1, 65536)
        elif change == 3:
            request.node_key = f"node{r.randrange(4)}"
        elif change == 4:
            request.spec.world_size += 1
        return request

    def owned(self) -> Member | None:
        return self.rng.choice(self.members) if self.members and self.rng.random() < 0.45 else None

    def keep_alive(self) -> pb.KeepAliveRequest:
        r, m = self.rng, self.owned()
        if m is not None:
            return pb.KeepAliveRequest(job_id=m.job_id, member_id=m.member_id, member_secret=m.secret if r.random() < 0.8 else self.member_secret(),
                                       generation=r.choice((m.generation, m.generation, 0, m.generation + 1, self.generation())))
        if r.random() < 0.2:
            return pb.KeepAliveRequest(job_id=HEALTHY, member_id=r.choice(self.healthy_ids), member_secret=self.member_secret(),
                                       generation=self.generation())
        return pb.KeepAliveRequest(job_id=self.job_id(), member_id=self.member_id(), member_secret=self.member_secret(),
                                   generation=self.generation())

    def leave(self) -> pb.LeaveRequest:
        r, m = self.rng, self.owned()
        if m is not None:
            known = self.jobs.get(m.job_id)
            return pb.LeaveRequest(job_id=m.job_id, member_id=m.member_id, member_secret=m.secret if r.random() < 0.6 else self.member_secret(),
                                   job_secret=known[1] if known is not None and r.random() < 0.8 else self.job_secret())
        if r.random() < 0.2:
            return pb.LeaveRequest(job_id=HEALTHY, member_id=r.choice(self.healthy_ids), member_secret=self.member_secret())
        return pb.LeaveRequest(job_id=self.job_id(), member_id=self.member_id(), member_secret=self.member_secret())

    def describe(self) -> pb.DescribeJobRequest:
        r = self.rng
        job_id = self.job_id()
        known = self.jobs.get(job_id)
        return pb.DescribeJobRequest(job_id=job_id, job_secret=known[1] if known and r.random() < 0.5 else self.job_secret())

    def list_events(self) -> pb.ListEventsRequest:
        r = self.rng
        job_id = self.job_id()
        known = self.jobs.get(job_id)
        return pb.ListEventsRequest(job_id=job_id, job_secret=known[1] if known and r.random() < 0.5 else self.job_secret(),
                                    page_size=r.choice((0, 1, 2, 100, 1000, 1001, U32)),
                                    page_token=r.choice(("", "", "1", "2", str(U64), "x", self.text())))

    def watch_events(self) -> pb.WatchEventsRequest:
        r = self.rng
        job_id = self.job_id()
        known = self.jobs.get(job_id)
        return pb.WatchEventsRequest(job_id=job_id, job_secret=known[1] if known and r.random() < 0.5 else self.job_secret(),
                                     after_seq=r.choice((0, 0, 1, 3, U64)))

    def list_jobs(self) -> pb.ListJobsRequest:
        r = self.rng
        size = r.choice((0, 0, 1, 2, 10, 100, 1000, 1001, U32)) if r.random() < 0.5 else r.randrange(0, 50)
        token = r.choice(("", "", "fz-", "fz-5", HEALTHY, "zzzz", self.text(), *list(self.jobs)[-3:]))
        return pb.ListJobsRequest(page_size=size, page_token=token)

    def session_request(self) -> pb.SessionRequest:
        r, m = self.rng, self.owned()
        if m is not None:
            return pb.SessionRequest(job_id=m.job_id, member_id=m.member_id, member_secret=m.secret if r.random() < 0.8 else self.member_secret(),
                                     generation=r.choice((m.generation, 0, m.generation + 1, self.generation())),
                                     spare_port=r.choice((0, 0, r.randrange(1, 65536), self.u32())))
        if r.random() < 0.2:
            return pb.SessionRequest(job_id=HEALTHY, member_id=r.choice(self.healthy_ids), member_secret=self.member_secret(),
                                     generation=self.generation(), spare_port=self.u32())
        return pb.SessionRequest(job_id=self.job_id(), member_id=self.member_id(), member_secret=self.member_secret(),
                                 generation=self.generation(), spare_port=self.u32())

    def message(self, rpc: str) -> Message:
        if rpc == "Join":
            return self.rejoin() if self.members and self.rng.random() < 0.1 else self.join()
        return {"Session": self.session_request, "KeepAlive": self.keep_alive, "Leave": self.leave,
                "DescribeJob": self.describe, "ListJobs": self.list_jobs, "ListEvents": self.list_events,
                "WatchEvents": self.watch_events}[rpc]()

    # -- raw bytes ---------------------------------------------------------------

    def raw(self, rpc: str) -> bytes:
        """Bytes for `rpc` that were not built as its message: random, crafted, mutated, merged, or another RPC's."""
        r = self.rng
        kind = r.randrange(10)
        if kind < 3:
            return r.randbytes(r.choice((0, 1, 2, r.randrange(64), r.randrange(2048))))
        if kind < 6:
            return self.mutate(self.message(rpc).SerializeToString())
        if kind == 6:
            return self.message(r.choice(list(REQUEST_TYPES))).SerializeToString()
        if kind == 7:  # two messages merged (a valid message, if both parse), or one and a random tail
            return self.message(rpc).SerializeToString() + r.choice((self.message(rpc).SerializeToString(), r.randbytes(r.randrange(1, 16))))
        depth = r.choice((1, 50, 99, 100, 101, 500))
        return r.choice((
            b"\x0a\x02\xff\xfe",  # field 1, bad UTF-8
            b"\x0a\x80\x80\x80\x80\x10",  # a length past 2**32
            b"\x0a\xff\xff\xff\xff\x07abc",  # a length past the end
            b"\x08\x01",  # field 1 (a string) as a varint
            b"\x12\x05\x08\xff\xff\xff\xff\x0f",  # a nested message over its length
            b"\x40" + b"\xff" * 11,  # an overlong varint
            b"\x7b" * depth + b"\x7c" * depth,  # nested groups in an unknown field
            b"\x7b",  # an unterminated group
            b"\x00",  # field number 0
            b"\xf8\xff\xff\xff\x0f\x01",  # the largest field number
            b"\x0d\x00\x00",  # a truncated fixed32
            b"\x12\x00" * 500,  # field 2 repeated, empty
        ))

    def mutate(self, data: bytes) -> bytes:
        r = self.rng
        buf = bytearray(data)
        for _ in range(r.randrange(1, 5)):
            op = r.randrange(6)
            at = r.randrange(len(buf) + 1)
            if op == 0 and buf:
                i = r.randrange(len(buf))
                buf[i] ^= 1 << r.randrange(8)
            elif op == 1 and buf:
                buf[r.randrange(len(buf))] = r.randrange(256)
            elif op == 2:
                del buf[at:at + r.randrange(1, 9)]
            elif op == 3:
                buf[at:at] = r.randbytes(r.randrange(1, 9))
            elif op == 4:
                del buf[at:]
            else:
                buf[at:at] = buf[at:at + r.randrange(1, 17)]
        return bytes(buf)

    # -- a batch -----------------------------------------------------------------

    def session(self) -> Call:
        """A Session stream: a first message (or none), then up to three renewals, and perhaps raw bytes."""
        r = self.rng
        if r.random() < 0.08:
            return Call("Session", (), raw=False)
        messages = [self.raw("Session") if r.random() < RAW_SHARE else self.session_request().SerializeToString()]
        messages += [self.session_request().SerializeToString() for _ in range(r.choice((0, 0, 1, 2, 3)))]
        if r.random() < 0.3:  # raw bytes last: an undecodable message ends the stream, leaving nothing to write after it
            messages.append(self.raw("Session"))
        return Call("Session", tuple(messages), raw=any(not _parses(pb.SessionRequest, m) for m in messages))

    def batch(self, size: int) -> list[Call]:
        r = self.rng
        rpcs, weights = list(WEIGHTS), list(WEIGHTS.values())
        calls: list[Call] = []
        while len(calls) < size:
            if r.random() < FORMATION_SHARE:
                calls += self.formation()
                continue
            rpc = r.choices(rpcs, weights)[0]
            if rpc == "Session":
                calls.append(self.session())
            elif r.random() < RAW_SHARE:
                calls.append(Call(rpc, self.raw(rpc), raw=True))
            else:
                calls.append(Call(rpc, self.message(rpc).SerializeToString(), raw=False))
        return calls

    def learn(self, call: Call, result: Result) -> None:
        """Keeps the members fuzzed Joins created (and forgets those that left)."""
        if result.code is not Code.OK or not isinstance(call.payload, bytes):
            return
        if call.rpc == "Join":
            request, response = pb.JoinRequest.FromString(call.payload), pb.JoinResponse.FromString(result.responses[0])
            self.members.append(Member(request.job_id, response.member_id, response.member_secret,
                                       response.assignment.generation, call.payload))
        elif call.rpc == "Leave":
            request = pb.LeaveRequest.FromString(call.payload)
            for m in [m for m in self.members if (m.job_id, m.member_id) == (request.job_id, request.member_id)]:
                self.members.remove(m)


def _parses(message_type: type[Message], data: bytes) -> bool:
    try:
        message_type.FromString(data)
    except DecodeError:
        return False
    return True


class HealthyJob:
    """A formed job of two workers kept alive through the fuzz: one by a
    Session stream, one by KeepAlive. Anything it hears or suffers is a problem."""

    def __init__(self, stub: pb_grpc.RendezvousStub, members: list[pb.JoinResponse]) -> None:
        self.stub = stub
        self.by_session, self.by_keepalive = members
        self.problems: list[str] = []
        self.events: list[pb.SessionEvent] = []  # after the session's first
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def renewal(self) -> pb.SessionRequest:
        m = self.by_session
        return pb.SessionRequest(job_id=HEALTHY, member_id=m.member_id, member_secret=m.member_secret, generation=1)

    async def start(self) -> None:
        self.session = self.stub.Session()
        await self.session.write(self.renewal())
        first = await self.session.read()
        assert first.WhichOneof("event") == "lease_ttl_ms", first
        self._tasks = [asyncio.ensure_future(self._listen()), asyncio.ensure_future(self._renew())]

    async def _listen(self) -> None:
        try:
            while (event := await self.session.read()) is not grpc.aio.EOF:
                self.events.append(event)
            self.problems.append("the healthy session ended")
        except grpc.aio.AioRpcError as err:
            if not self._stop.is_set():
                self.problems.append(f"the healthy session failed: {err.code().name} {err.details()}")

    async def _renew(self) -> None:
        m = self.by_keepalive
        while not self._stop.is_set():
            try:
                await self.session.write(self.renewal())
                answer = await self.stub.KeepAlive(
                    pb.KeepAliveRequest(job_id=HEALTHY, member_id=m.member_id, member_secret=m.member_secret, generation=1),
                    timeout=LEASE_TTL_S)
                if answer.generation != 1:
                    self.problems.append(f"the healthy job is at generation {answer.generation}")
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                self.problems.append(f"renewing the healthy job failed: {exc!r}")
            with contextlib.suppress(asyncio.TimeoutError):  # a sleep the stop interrupts
                await asyncio.wait_for(self._stop.wait(), LEASE_TTL_S / 10)

    async def stop(self) -> None:
        """Stops renewing and closes the session (idempotent)."""
        self._stop.set()
        self.session.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def fuzz(channel: grpc.aio.Channel, fuzzer: Fuzzer, tally: Tally, calls: int) -> None:
    """Sends `calls` (or a few more) generated calls, a batch at a time, recording every answer."""
    while sum(tally.calls.values()) < calls:
        batch = fuzzer.batch(min(BATCH, calls - sum(tally.calls.values())))
        results = await asyncio.gather(*(send(channel, call) for call in batch))
        for call, result in zip(batch, results):
            tally.record(call, result)
            fuzzer.learn(call, result)


@pytest.mark.timeout(FUZZ_TIMEOUT_S + 60)
@pytest.mark.slow(40)
async def test_fuzzed_requests_get_deliberate_answers_and_leave_a_healthy_job_undisturbed(caplog):
    server = await start_server("127.0.0.1", 0, lease_ttl_s=LEASE_TTL_S, limits=Limits(max_join_wait_s=MAX_JOIN_WAIT_S))
    healthy: HealthyJob | None = None
    tally = Tally(SEED)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.RendezvousStub(channel)
            sync = pb.WeightTransfer(sender_role="trainer", receiver_roles=["rollout"])
            spec = pb.JobSpec(world_size=2, roles=[pb.RoleCount(role="trainer", count=1), pb.RoleCount(role="rollout", count=1)],
                              groups=[pb.GroupRule(mode="WEIGHT_SYNC", weight_transfer=sync)])
            joins = [join_request(HEALTHY, 2, f"healthy-node{i}", i, role=role, wait_timeout_ms=10_000)
                     for i, role in enumerate(("trainer", "rollout"))]
            for j in joins:
                j.spec.CopyFrom(spec)
            members = list(await asyncio.gather(*(stub.Join(j, timeout=15) for j in joins)))
            assert [m.assignment.generation for m in members] == [1, 1]
            healthy = HealthyJob(stub, members)
            await healthy.start()

            started = time.monotonic()
            try:
                await asyncio.wait_for(fuzz(channel, Fuzzer(random.Random(SEED), members, spec), tally, CALLS), FUZZ_TIMEOUT_S)
            except asyncio.TimeoutError:
                pytest.fail(f"the fuzz did not finish within {FUZZ_TIMEOUT_S:g} s (a hang?)\n{tally.report()}")
            elapsed = time.monotonic() - started
            print(f"\nfuzz: {elapsed:.1f} s; {tally.summary()}")

            # Zero UNKNOWN or INTERNAL (or any other undocumented answer), details at most 1 KiB.
            assert not tally.failures, tally.report()
            total = sum(tally.calls.values())
            assert total >= 10_000, tally.summary()
            # Rare, or the fuzz goes blind. Streams the server ends at once on a bad field (a spare port out of
            # range, an older generation) make the fuzzer's further writes on them race that end: a few percent.
            assert tally.client_races <= tally.calls["Session"] * 0.06, tally.summary()
            for rpc in REQUEST_TYPES:  # every RPC its fair share, raw bytes among them
                assert tally.calls[rpc] >= total * 0.05, f"{rpc}: {tally.summary()}"
                assert tally.raw[rpc] >= tally.calls[rpc] * 0.1, f"{rpc}: {tally.summary()}"
            # Deep enough: worlds formed, and their members were called on.
            assert tally.by_rpc["Join", "OK"] >= 100 and tally.by_rpc["KeepAlive", "OK"] >= 50, tally.summary()
            assert tally.sessions_opened >= 50 and tally.by_rpc["Leave", "OK"] >= 50, tally.summary()

            # The server is up and serving.
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "commctx.v1.Rendezvous"):
                answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, service

            # The healthy job beside the fuzz: undisturbed, still formed at generation 1 with both members.
            await healthy.stop()
            assert not healthy.problems, healthy.problems
            assert healthy.events == [], f"the healthy member heard {healthy.events}"
            job = await stub.DescribeJob(pb.DescribeJobRequest(job_id=HEALTHY), timeout=5)
            assert (job.state, job.generation, job.joined, job.missing) == (pb.JobDescription.FORMED, 1, 2, 0), job
            assert sorted(n.node_key for n in job.nodes) == ["healthy-node0", "healthy-node1"]
            for m in members:
                renewed = await stub.KeepAlive(pb.KeepAliveRequest(job_id=HEALTHY, member_id=m.member_id,
                                                                   member_secret=m.member_secret, generation=1), timeout=5)
                assert renewed.generation == 1

            # And a fresh job still forms.
            fresh = await asyncio.gather(*(stub.Join(join_request("after-the-fuzz", 2, f"node{i}", i, wait_timeout_ms=10_000), timeout=15)
                                           for i in range(2)))
            assert sorted(a.assignment.rank for a in fresh) == [0, 1]
            assert {a.assignment.generation for a in fresh} == {1}
    finally:
        if healthy is not None:
            await healthy.stop()
        await server.stop(0)
    errors = [r.getMessage() for r in caplog.records if r.name.startswith("commctx") and r.levelname in ("ERROR", "CRITICAL")]
    assert errors == []  # e.g. "internal error" (the codec's line for an INTERNAL answer) or "planner_failed"
