"""One client host of the chaos run (benchmarks/chaos.py starts one per host
namespace): its members of the run's jobs, each a Session stream, as the client
library keeps it, plus a unary KeepAlive every lease TTL/2 (answers that carry
the leader's epoch). Every call and every pushed assignment is written to
--out as one JSON line (benchmarks/chaos_history.Op's fields; monotonic
seconds, which every namespace of this machine shares).

A member follows the leader as the client library does: its channel options
(pings find a dead connection), NOT_LEADER hints, else the next replica, with
backoff. A member the server says is gone (its lease ran out during a fault,
or its run stopped), on its session or by a KeepAlive, whichever says it
first, joins again as a new member (a new incarnation, as a restarted worker
does). At --leave-at it answers Leave; at --probe-at
every member id this host ever held is probed with a KeepAlive (the
final-state check) while the members held go on renewing, and a last line
lists the members held at the probe ({"kind": "final", "live": {job:
[member, ...]}}).

    python benchmarks/chaos_fleet.py --plan PLAN.json --host c0 --out OPS.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import sys
import time

import grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.chaos_history import world_digest  # noqa: E402
from commctx.channels import CHANNEL_OPTIONS, FAILOVER_OPTIONS  # noqa: E402
from commctx.transport import leader_hint  # noqa: E402
from commctx.v1 import rendezvous_pb2 as pb  # noqa: E402
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc  # noqa: E402

RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
RUN_ENDED = "RUN_ENDED"  # recorded for a member gone because its job's run ended (FAILED, ENDED, CLOSED), not its own lease


def gone_why(details: str) -> str:
    """NOT_FOUND (the member's own lease ran out, or it left), or RUN_ENDED (the run it was in is over)."""
    return RUN_ENDED if "no run under way" in details or details.startswith("job ") else "NOT_FOUND"


class Fleet:
    """Channels to every replica, the one believed to lead, and the record of every call."""

    def __init__(self, replicas: list[str], host: str, out) -> None:
        self.replicas = replicas
        # As the client library dials replicas: pings find a dead connection, and a replica back is retried soon
        self.channels = {a: grpc.aio.insecure_channel(a, options=[*CHANNEL_OPTIONS, *FAILOVER_OPTIONS]) for a in replicas}
        self.stubs = {a: pb_grpc.RendezvousStub(ch) for a, ch in self.channels.items()}
        self.leader = replicas[0]
        self.host = host
        self.out = out

    def record(self, **op) -> None:
        self.out.write(json.dumps({"host": self.host, **op}) + "\n")

    def follow(self, address: str, err: grpc.aio.AioRpcError | None) -> None:
        """After `address` failed: the hinted leader, else the next replica."""
        if self.leader == address:
            hint = leader_hint(err) if err is not None else ""
            self.leader = hint if hint in self.stubs and hint != address else self.replicas[(self.replicas.index(address) + 1) % len(self.replicas)]

    async def call(self, kind: str, method: str, request, job: str, member: str, until: float, timeout: float = 3.0):
        """The answer of a leader, retrying NOT_LEADER and unreachable replicas until `until`; every try recorded."""
        attempt = 0
        while True:
            address, start = self.leader, time.monotonic()
            call = getattr(self.stubs[address], method)(request, timeout=max(0.1, min(timeout, until - start)))
            try:
                answer = await call
                epoch = dict(await call.trailing_metadata() or ()).get("commctx-epoch")
                return answer, address, start, (int(epoch) if epoch else None)
            except grpc.aio.AioRpcError as err:
                details = err.details() or ""
                code = err.code().name if err.code() is not grpc.StatusCode.NOT_FOUND else gone_why(details)
                if kind in ("keepalive", "probe") and err.code() is grpc.StatusCode.FAILED_PRECONDITION \
                        and details.startswith("job "):
                    code = RUN_ENDED  # told its run stopped (a stale generation is "member ... holds generation")
                self.record(kind=kind, job=job, member=member, replica=address, start=start, end=time.monotonic(),
                            ok=False, error=code, details=details[:300])
                if err.code() not in RETRIED or time.monotonic() >= until:
                    raise
                self.follow(address, err)
            await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0) * random.uniform(0.5, 1))
            attempt = min(attempt + 1, 5)

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()


def world_of(a: pb.Assignment) -> str:
    """What every member of one world must be told alike."""
    return world_digest((), a.world_size, a.num_nodes, a.master_addr, a.master_port)


class Member:
    """One slot of a job on this host: joins, holds a Session (renewing every TTL/3) and a unary
    KeepAlive every TTL/2, joins again as a new member when told it is gone, leaves at `leave_at`."""

    def __init__(self, fleet: Fleet, slot: dict, ttl_s: float, t0: float, probe_at: float) -> None:
        self.fleet, self.slot, self.ttl_s, self.t0, self.probe_at = fleet, slot, ttl_s, t0, probe_at
        self.job = slot["job"]
        self.spec = pb.JobSpec(world_size=slot["world_size"])
        if slot.get("min_size"):
            self.spec.elastic.min_size, self.spec.elastic.last_call_ms = slot["min_size"], 500
        self.ids: list[tuple[str, str]] = []  # every (member id, secret) this slot held
        self.held: str | None = None  # the member id held at the probe
        self.generation = 0
        self.run_ended = False  # the member held was told its run ended

    def until(self) -> float:
        """When this slot's member leaves; one that stays holds its seat through the probes (main ends it)."""
        leave_at = self.slot.get("leave_at")
        return min(self.probe_at, leave_at + self.t0) if leave_at is not None else self.probe_at + 600

    async def run(self) -> None:
        await asyncio.sleep(max(0.0, self.t0 + self.slot["join_at"] - time.monotonic()))
        while time.monotonic() < self.until():
            member, secret = await self.join()
            if member is None:
                return
            self.held = member
            if await self.hold(member, secret) == "gone":
                self.held = None
                # Its lease ran out, or its run ended: a new incarnation, as a restarted worker (one
                # whose run ended leaves first, as a worker exiting does, so that the job id frees).
                if self.run_ended:
                    await self.leave(member, secret)
                await asyncio.sleep(random.uniform(0.5, 1.5))
                continue
            self.held = None
            await self.leave(member, secret)
            return

    async def join(self) -> tuple[str | None, str]:
        """A new member, joined (its id and secret), or None once it is time to stop. A Join refused
        (the job full: an earlier incarnation's seat not yet free; its run over but not yet ended) is
        tried again a second later, with a new id where the refused one was never admitted."""
        self.generation, self.run_ended = 0, False
        member, secret = os.urandom(8).hex(), os.urandom(16).hex()
        self.ids.append((member, secret))
        while time.monotonic() < self.until():
            request = pb.JoinRequest(job_id=self.job, spec=self.spec, node_key=self.fleet.host, address=self.slot["address"],
                                     master_port=self.slot["port"], member_id=member, member_secret=secret,
                                     wait_timeout_ms=30_000)
            try:
                answer, replica, start, epoch = await self.fleet.call("join", "Join", request, self.job, member,
                                                                      self.until(), 35.0)
            except grpc.aio.AioRpcError as err:
                if err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    member, secret = os.urandom(8).hex(), os.urandom(16).hex()
                    self.ids.append((member, secret))
                await asyncio.sleep(random.uniform(0.5, 1.5))
                continue
            self.assigned(answer.assignment, member, "join", replica, start, epoch)
            return member, secret
        return None, ""

    def assigned(self, a: pb.Assignment, member: str, kind: str, replica: str, start: float, epoch: int | None) -> None:
        self.generation = max(self.generation, a.generation)
        self.fleet.record(kind=kind, job=self.job, member=member, replica=replica, start=start, end=time.monotonic(),
                          generation=a.generation, rank=a.rank, node_rank=a.node_rank, world=world_of(a), epoch=epoch,
                          run=a.run)

    async def hold(self, member: str, secret: str) -> str:
        """Renews until it is time to leave or probe ("done"), or the server says the member is gone ("gone")."""
        unary = asyncio.ensure_future(self.renew(member, secret))
        try:
            while time.monotonic() < self.until():
                session = asyncio.ensure_future(self.session(self.fleet.leader, member, secret))
                await asyncio.wait((session, unary), return_when=asyncio.FIRST_COMPLETED)
                if unary.done():  # told by a KeepAlive: the session, wherever it hangs, is not waited for
                    session.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await session
                    return "gone"
                if session.result() == "gone":
                    return "gone"
                await asyncio.sleep(random.uniform(0.05, 0.3))
            return "done"
        finally:
            unary.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await unary

    async def session(self, address: str, member: str, secret: str) -> str:
        """One Session stream on `address` until it breaks ("broke"), the member is gone ("gone") or the time is up ("done")."""
        call = self.fleet.stubs[address].Session()
        start = time.monotonic()
        # Every message offers a spare port: rank 0 of the next world serves its store there (as the client does).
        first = pb.SessionRequest(job_id=self.job, member_id=member, member_secret=secret, generation=self.generation,
                                  spare_port=random.randint(20000, 60000))

        async def renewals() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):  # the reader sees the stream end
                await call.write(first)
                while True:
                    await asyncio.sleep(self.ttl_s / 3 * random.uniform(0.8, 1.0))
                    await call.write(pb.SessionRequest(job_id=self.job, member_id=member, generation=self.generation,
                                                       spare_port=random.randint(20000, 60000)))

        async def reads() -> str:
            while True:
                event = await call.read()
                if event is grpc.aio.EOF:
                    return "broke"
                if event.HasField("gone"):  # a renewal that found the member gone
                    self.fleet.record(kind="keepalive", job=self.job, member=member, replica=address, start=time.monotonic(),
                                      end=time.monotonic(), ok=False, error=gone_why(event.gone), details=event.gone[:300])
                    self.run_ended = gone_why(event.gone) == RUN_ENDED
                    return "gone"
                if event.HasField("assignment"):
                    self.assigned(event.assignment, member, "event", address, time.monotonic(), None)

        writer = asyncio.ensure_future(renewals())
        try:
            return await asyncio.wait_for(reads(), max(0.0, self.until() - time.monotonic()))
        except TimeoutError:
            return "done"
        except grpc.aio.AioRpcError as err:
            self.fleet.record(kind="session", job=self.job, member=member, replica=address, start=start,
                              end=time.monotonic(), ok=False, error=err.code().name, details=(err.details() or "")[:300])
            self.fleet.follow(address, err)
            return "broke"
        finally:
            writer.cancel()
            call.cancel()

    async def renew(self, member: str, secret: str) -> None:
        """A unary KeepAlive every TTL/2; returns when one answers NOT_FOUND (the member is gone)."""
        while True:
            await asyncio.sleep(self.ttl_s / 2 * random.uniform(0.8, 1.0))
            if time.monotonic() >= self.until():
                await asyncio.Event().wait()  # the holder ends this task
            request = pb.KeepAliveRequest(job_id=self.job, member_id=member, member_secret=secret, generation=self.generation)
            try:
                answer, replica, start, epoch = await self.fleet.call("keepalive", "KeepAlive", request, self.job, member,
                                                                      time.monotonic() + self.ttl_s / 2)
            except grpc.aio.AioRpcError as err:
                details = err.details() or ""
                if err.code() is grpc.StatusCode.NOT_FOUND or (
                        err.code() is grpc.StatusCode.FAILED_PRECONDITION and details.startswith("job ")):
                    self.run_ended = gone_why(details) == RUN_ENDED  # FAILED_PRECONDITION: its run stopped
                    return
                continue
            self.fleet.record(kind="keepalive", job=self.job, member=member, replica=replica, start=start,
                              end=time.monotonic(), generation=answer.generation, epoch=epoch)

    async def leave(self, member: str, secret: str) -> None:
        try:
            _, replica, start, epoch = await self.fleet.call("leave", "Leave", pb.LeaveRequest(
                job_id=self.job, member_id=member, member_secret=secret), self.job, member, time.monotonic() + 30)
        except grpc.aio.AioRpcError:
            return  # recorded: NOT_FOUND (a retry of a Leave applied before a failover) counts as answered
        self.fleet.record(kind="leave", job=self.job, member=member, replica=replica, start=start, end=time.monotonic(),
                          epoch=epoch)

    async def probe(self) -> None:
        """A KeepAlive of every member id this slot held: the final state (kind "probe")."""
        for member, secret in self.ids:
            request = pb.KeepAliveRequest(job_id=self.job, member_id=member, member_secret=secret)
            try:
                answer, replica, start, epoch = await self.fleet.call("probe", "KeepAlive", request, self.job, member,
                                                                      time.monotonic() + 30)
            except grpc.aio.AioRpcError:
                continue  # recorded by the call
            self.fleet.record(kind="probe", job=self.job, member=member, replica=replica, start=start,
                              end=time.monotonic(), generation=answer.generation, epoch=epoch)


async def main(args: argparse.Namespace) -> None:
    plan = json.loads(open(args.plan).read())
    t0, ttl_s = plan["t0"], plan["lease_ttl_s"]
    probe_at = t0 + plan["probe_at"]
    with open(args.out, "w", buffering=1) as out:
        fleet = Fleet(plan["replicas"], args.host, out)
        members = [Member(fleet, slot, ttl_s, t0, probe_at) for slot in plan["slots"] if slot["host"] == args.host]
        lives = [asyncio.ensure_future(m.run()) for m in members]
        await asyncio.sleep(max(0.0, probe_at - time.monotonic()))
        # The members held at the probe are the live ones, taken before probing: a host done probing first ends
        # its members (their sessions close without a Leave), which can end a run under another host's members
        # while that host still probes (seed 6 of sweep 10 counted such members dead, and their jobs unconverged).
        live: dict[str, list[str]] = {}
        for m in members:
            if m.held:
                live.setdefault(m.job, []).append(m.held)
        await asyncio.gather(*(m.probe() for m in members))  # the members held renew meanwhile, as live workers do
        for task in lives:
            task.cancel()
        await asyncio.gather(*lives, return_exceptions=True)
        fleet.record(kind="final", live=live)
        await fleet.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--out", required=True)
    asyncio.run(main(parser.parse_args()))
