"""Waiting for a world: the domain's Join, and the Join calls it holds.

`Joining.join` is the one coroutine a Join is (over gRPC, or from a test):
it registers the member, waits for its world (bounded by the caller's wait,
--max-join-wait-s and the call's own deadline) and returns where the member
sits, or raises why not; a wait that ends without a seat withdraws the
member, once the withdrawal is durable. It mints the member's secret when the
caller brought none, counts the caller's Joins waiting against its share, and
ends the wait at once if the caller's token is revoked.

`Waiters` holds the waiting calls' futures, by job and member, with their
deadlines; the executor wakes them with each world, stopped job or gone member.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ..errors import Closed, Conflict, NotFound, Unavailable, WaitTimeout
from .actions import SLICE, Actions
from .deadlines import Deadline, Deadlines
from .model import JobStopped, Joined, MemberGone, NewWorld, WaitOutcome
from .params import JoinParams, secret_digest
from .shares import WAITING, Caller

if TYPE_CHECKING:
    from .machine import Rendezvous


class Carrier(Protocol):
    """What carries out the machine's actions for a Join (the executor, executor.py,
    which imports this module: named here by what it does, not by its class)."""

    def submit(self, actions: Actions) -> None: ...

    async def carry_out(self, actions: Actions) -> None: ...

    async def settled(self) -> None: ...


class JoinAnswer(NamedTuple):
    """A Join's answer: the membership, the world it sits in, and its secret."""

    joined: Joined
    world: NewWorld
    member_secret: str


class Joining:
    """The domain's Join over a machine, its executor and its waiters."""

    def __init__(self, machine: Rendezvous, executor: Carrier, waiters: Waiters) -> None:
        self._machine = machine
        self._executor = executor
        self._waiters = waiters

    async def join(self, params: JoinParams, member_secret: str, caller: Caller, wait_s: float,
                   call_remaining_s: float | None) -> JoinAnswer:
        """Joins and waits for the world.

        Args:
            params: the validated request; its member secret is `member_secret`
                ("": none given, one is minted).
            caller: who asks (its share of Joins waiting, and its token's revocation).
            wait_s: how long the caller asks to wait (0: as long as allowed).
            call_remaining_s: the call's own time left (None: no deadline): the
                answer, with who is missing, comes before it.

        Raises:
            BadRequest: a malformed member secret.
            LimitExceeded: the server or the caller's share is full.
            WaitTimeout: the world did not form in time; names who is missing.
            UnknownToken: the caller's token was revoked meanwhile.
            Unavailable: the server is stopping, or the store cannot record
                the join or its end.
            and what Rendezvous.join raises, or the wait ends with (NotFound:
            the member left; Conflict: the job failed, or a later Join of the
            member took over).
        """
        if self._machine.draining:
            raise Unavailable("the server is shutting down; join another rendezvous server or retry")
        secret = member_secret or os.urandom(16).hex()
        params = params._replace(secret=secret_digest(secret))
        shares = self._machine.shares
        shares.take(WAITING, caller)
        try:
            try:
                joined, actions, formed = self._machine.join(params, caller)
            except Exception:
                self._executor.submit(self._machine.take_outbox())  # a refusal the job records
                raise
            longest = self._machine.limits.max_join_wait_s  # no Join is held longer, whatever it asks
            timeout = min(wait_s, longest) if wait_s else longest
            if call_remaining_s is not None:  # answer with who is missing before the call's own deadline cuts it:
                # a tenth of its time early, at least 0.5 s (half, for a shorter call), at most 1 s
                margin = min(1.0, max(call_remaining_s * 0.1, min(0.5, call_remaining_s / 2)))
                timeout = min(timeout, call_remaining_s - margin)
            # Registered before the actions run: the world may form with this very join.
            waiter = self._waiters.add(params.job_id, joined.member_id, timeout) if formed is None else None
            self._executor.submit(actions)
            world = await self._wait(params.job_id, joined.member_id, waiter, formed, timeout, caller)
            self._machine.answered(params.job_id, joined.member_id)
            return JoinAnswer(joined, world, secret)
        finally:
            shares.give(WAITING, caller)

    async def _wait(self, job_id: str, member_id: str, waiter: asyncio.Future | None, formed: NewWorld | None,
                    timeout: float, caller: Caller) -> NewWorld:
        live = self._machine.shares.live
        end = (lambda exc: waiter.done() or waiter.set_exception(exc)) if waiter is not None else None
        if end is not None:
            live.add(caller, end)
        try:
            if waiter is None:  # a re-attached member of a formed world: answer once that world is durable
                await self._executor.settled()
                return formed
            world = await waiter
        except asyncio.CancelledError:  # the caller went away: withdrawn, nobody to answer
            self._executor.submit(self._stop_waiting(job_id, member_id, waiter))
            raise
        except TimeoutError:
            error: Exception = WaitTimeout(f"job {job_id!r} did not form within {timeout:g} s: {self._why_waiting(job_id)}")
        except Exception as exc:
            error = exc
        else:
            self._stop_waiting(job_id, member_id, waiter)  # seated: nothing to withdraw
            return world
        finally:
            if end is not None:
                live.discard(caller, end)
        try:  # answered once the withdrawal is durable: a restart does not bring the member back
            await self._executor.carry_out(self._stop_waiting(job_id, member_id, waiter))
        except Unavailable as exc:
            error = exc
        try:
            raise error
        finally:
            error = None  # its traceback holds this frame, which would hold it: no cycle for the collector

    def _stop_waiting(self, job_id: str, member_id: str, waiter: asyncio.Future | None) -> Actions:
        """Ends this call's wait; withdraws the member unless it was seated or a
        later Join call for it took over."""
        if waiter is not None:
            self._waiters.discard(job_id, member_id, waiter)
        if self._waiters.waiting(job_id, member_id):
            return Actions()
        return self._machine.withdraw(job_id, member_id)

    def _why_waiting(self, job_id: str) -> str:
        try:
            return self._machine.describe(job_id).reason
        except NotFound:
            return "the job is gone"


class Waiters:
    """Join calls waiting to be seated, by job and member, with their deadlines."""

    def __init__(self) -> None:
        self._by_job: dict[str, dict[str, asyncio.Future[NewWorld]]] = {}
        self._deadlines = Deadlines()  # (job id, member id, id of the future)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: Deadline | None = None  # when the armed timer fires, on the loop's clock (None: none armed)
        self._live = 0  # waiting futures

    def add(self, job_id: str, member_id: str, timeout_s: float | None) -> asyncio.Future[NewWorld]:
        """A future that resolves to the member's world, or raises NotFound,
        Conflict, or TimeoutError after `timeout_s`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[NewWorld] = loop.create_future()
        waiting = self._by_job.setdefault(job_id, {})
        earlier = waiting.get(member_id)
        if earlier is not None:  # a retried Join took over: the earlier call is answered now, not left to time out
            self._live -= 1
            if not earlier.done():
                earlier.set_exception(Conflict(f"a later Join call for member {member_id} of job {job_id!r} took over this one"))
        waiting[member_id] = future
        self._live += 1
        if timeout_s is not None:
            at = loop.time() + timeout_s
            self._deadlines.push(at, (job_id, member_id, id(future)))
            if self._timer_at is None or at < self._timer_at:
                self._arm(loop, at)
        return future

    def discard(self, job_id: str, member_id: str, future: asyncio.Future) -> None:
        waiting = self._by_job.get(job_id)
        if waiting is not None and waiting.get(member_id) is future:
            del waiting[member_id]
            self._live -= 1
            if not waiting:
                del self._by_job[job_id]
        if len(self._deadlines) > 2 * self._live + 1024:  # answered waits' deadlines: drop them, not hold them for the timeout
            self._deadlines.keep(self._waiting)

    def waiting(self, job_id: str, member_id: str) -> bool:
        """Whether a Join call waits for this member."""
        return member_id in self._by_job.get(job_id, {})

    def _waiting(self, key: tuple[str, str, int]) -> bool:
        future = self._by_job.get(key[0], {}).get(key[1])
        return future is not None and id(future) == key[2]

    def _ended_by(self, job_id: str, outcome: WaitOutcome) -> list[asyncio.Future[NewWorld]]:
        """The waits `outcome` ends: its member's, the whole job's, or those of the world's members."""
        waiting = self._by_job.get(job_id, {})
        if isinstance(outcome, MemberGone):
            return [f for f in (waiting.get(outcome.member_id),) if f is not None]
        if isinstance(outcome, JobStopped):
            return list(waiting.values())
        return [f for mid, f in waiting.items() if outcome.has_seat(mid)]

    def refuse(self, job_id: str, outcome: WaitOutcome, exc: Exception) -> None:
        """Ends with `exc` the waits `outcome` would have ended."""
        for future in self._ended_by(job_id, outcome):
            if not future.done():
                future.set_exception(exc)

    def fail_all(self, exc: Exception) -> None:
        """Ends every wait with `exc` (the server can no longer answer them)."""
        for waiting in self._by_job.values():
            for future in waiting.values():
                if not future.done():
                    future.set_exception(exc)

    async def wake(self, job_id: str, outcome: WaitOutcome) -> None:
        futures = self._ended_by(job_id, outcome)
        if isinstance(outcome, MemberGone):
            error: Exception | None = NotFound(f"member {outcome.member_id} left job {job_id!r} while waiting")
        else:
            error = (Closed if outcome.closed else Conflict)(outcome.reason) if isinstance(outcome, JobStopped) else None
        for i, future in enumerate(futures):
            if not future.done():
                if error is None:
                    future.set_result(outcome)
                else:
                    future.set_exception(error)
            if i % SLICE == SLICE - 1:
                await asyncio.sleep(0)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(at, self._expire, loop), at

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer, self._timer_at = None, None
        now = loop.time()
        while (entry := self._deadlines.pop_due(now)) is not None:
            job_id, member_id, key = entry[1]
            future = self._by_job.get(job_id, {}).get(member_id)
            if future is not None and id(future) == key and not future.done():
                future.set_exception(TimeoutError())
        at = self._deadlines.next()
        if at is not None:
            self._arm(loop, at)
