"""Carrying out what the state machine decided, as torch elastic's
_RendezvousOpExecutor does: persist, then announce, then wake.

`Executor` takes the `Actions` of every transition in submission order. Each
turn it takes everything queued, commits all their writes as one store
transaction (in a worker thread when the store does I/O: group commit comes
from the queue, not from a timer), and only then hands over the notes, puts
the pushed events in their session sinks and wakes the Join waiters, in
order. So a formed world is durable before anyone hears of it, and nobody
hears of a later change before an earlier one. Long lists of pushes and wakes
go in slices, yielding the event loop between them, and worlds too big to
plan inside a transition are planned in a worker thread, from the moment
they are asked for (while the writes before them commit). Writes that a later
one of the same batch replaces (a job put twice) are dropped.

The Join calls waiting for their world are `Waiters` (waiting.py), which
the executor wakes. It also arms the one timer that runs the machine's
`expire_due` when its next deadline comes (coalesced to 10 ms ticks).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable

from ..errors import Unavailable
from .actions import SLICE
from .deadlines import Deadline
from .machine import Actions, Rendezvous, plan_or_error
from .model import Note, PlanRequest
from .store import Fenced, Store, StoreError, without_superseded
from .waiting import Waiters
from .watching import Watchers

log = logging.getLogger("commctx.server")

# Deadlines are served on ticks of this length: a lease or grace that runs out
# is acted on within a tick, and outside an expiry storm the timer fires at
# most once a tick however many leases are due (docs/benchmarks.md).
TICK_S = 0.01
# A deadline timer this late means the event loop heard nothing meanwhile (a long
# GC, a starved or paused process): the renewals that waited are heard first.
STALL_S = 1.0


class Executor:
    """Carries out actions in submission order; owns the deadline timer.

    Start with `start()`, stop with `stop()` (idempotent).
    """

    def __init__(
        self,
        machine: Rendezvous,
        store: Store,
        epoch: int,
        waiters: Waiters,
        notes: Callable[[Note], None],
        *,
        watchers: Watchers | None = None,
        on_store_error: Callable[[Exception | None], None] = lambda exc: None,
        on_fenced: Callable[[Fenced], None] = lambda exc: None,
        retry_s: float = 1.0,
    ) -> None:
        self._machine = machine
        self._store = store
        self._epoch = epoch
        self._waiters = waiters
        self._notes = notes
        self.watchers = watchers if watchers is not None else Watchers()
        self._on_store_error = on_store_error
        self._on_fenced = on_fenced
        self._retry_s = retry_s
        self._queue: collections.deque[tuple[Actions, asyncio.Future[None] | None]] = collections.deque()
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: Deadline | None = None  # the machine's deadline the armed timer serves (None: none)
        self._storm = False  # the armed timer runs at once: an expiry storm goes on, no deadline moves it
        self._after_stall = False  # the armed timer ends a stall's deafness: it expires what is due, late or not
        self._committing_since: float | None = None  # when the commit under way began (None: none)
        self._failing = False
        self._failing_why = ""
        self._busy = False  # a batch is being carried out
        self._planning: set[asyncio.Task] = set()
        # One world planned at a time: each planning thread takes the GIL from
        # the event loop in turn, and several at once would hold it for long
        # stretches (benchmarks/bounds.py).
        self._planner = asyncio.Lock()
        self.fenced: Fenced | None = None
        self._closed: Exception | None = None  # what carry_out raises once nothing more is carried out

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="commctx-executor")
        self._rearm()

    async def stop(self) -> None:
        """Carries out what is queued (if the store allows), then stops. Idempotent."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is None:
            return
        if self._queue and self.fenced is None and not self._failing:
            await self.settled()
        for task in self._planning:
            task.cancel()
        await asyncio.gather(*self._planning, return_exceptions=True)
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    def submit(self, actions: Actions) -> None:
        """Queues a transition's actions (and what transitions that raised still implied)."""
        actions = self._with_outbox(actions)
        if actions:
            self._enqueue(actions, None)
        self._rearm()

    async def carry_out(self, actions: Actions) -> None:
        """Queues a transition's actions and returns once they are carried out
        (its writes durable). For answers that must not outrun the store.

        Raises:
            Unavailable: the writes failed, or another server took the store over.
        """
        if self._closed is not None:
            raise self._closed
        actions = self._with_outbox(actions)
        done = asyncio.get_running_loop().create_future()
        self._enqueue(actions, done)
        self._rearm()
        await done

    def _enqueue(self, actions: Actions, done: asyncio.Future[None] | None) -> None:
        """Queues actions to carry out; the worlds they ask planned are planned
        from now on, while earlier writes commit (planning is pure: the plan
        reaches the machine through `planned`, after whatever is queued now)."""
        self._queue.append((actions, done))
        self._ready.set()
        for request in actions.plans:
            task = asyncio.create_task(self._plan(request), name=f"commctx-plan-{request.job_id}")
            self._planning.add(task)
            task.add_done_callback(self._planning.discard)

    def _with_outbox(self, actions: Actions) -> Actions:
        outbox = self._machine.take_outbox() if self._machine.has_outbox else None
        if outbox is None:
            return actions
        outbox.extend(actions)
        return outbox

    async def settled(self) -> None:
        """Returns once everything submitted so far is carried out."""
        if self._queue or self._busy:
            await self.carry_out(Actions())

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                self._busy = True
                batch = list(self._queue)
                writes = without_superseded([w for actions, _ in batch for w in actions.writes])
                if self._committing_since is None:  # from the first try: answers wait on a failing store as on a slow one
                    self._committing_since = self._machine.now()
                committed = not writes or await self._commit(writes)
                took = self._machine.now() - self._committing_since
                if not committed:
                    if self.fenced is not None:
                        return
                    self._refuse(batch)
                    await asyncio.sleep(self._retry_s)  # the disk may free up; nothing is announced meanwhile
                    continue
                self._committing_since = None
                if took > STALL_S:  # its answers waited on the store: their first leases count from when they can leave
                    log.warning("store_slow", extra={"fields": {"seconds": round(took, 3)}})
                    self._machine.stalled(took)
                for _ in batch:
                    self._queue.popleft()
                for actions, done in batch:
                    for note in actions.notes:
                        self._notes(note)
                    for job_id, event in actions.events:
                        self.watchers.publish(job_id, event)
                    for i, (sink, event) in enumerate(actions.pushes):
                        sink.put_nowait(event)
                        if i % SLICE == SLICE - 1:
                            await asyncio.sleep(0)
                    for job_id, outcome in actions.wakes:
                        await self._waiters.wake(job_id, outcome)
                    if done is not None and not done.done():
                        done.set_result(None)
                self._busy = False

    def _fail_all(self, error: Exception) -> None:
        """Nothing queued will be carried out: every call awaiting it hears `error`."""
        self._closed = error
        for _, done in self._queue:
            if done is not None and not done.done():
                done.set_exception(error)
        self._queue.clear()
        self._waiters.fail_all(error)

    async def abandon(self, error: Exception) -> None:
        """Stops at once, writing nothing more (the store is no longer this
        server's to write): what is queued is dropped, and every call awaiting
        it, and every Join waiting, hears `error`."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in [*self._planning, *([self._task] if self._task is not None else [])]:
            task.cancel()
        await asyncio.gather(*self._planning, *([self._task] if self._task is not None else []), return_exceptions=True)
        self._task = None
        self._fail_all(error)

    def _refuse(self, batch: list[tuple[Actions, asyncio.Future[None] | None]]) -> None:
        """The batch's writes failed: the Join calls it would wake and the calls
        awaiting it (Leave, a re-attaching Join) hear UNAVAILABLE now, not at
        their timeouts. The writes stay queued and are retried, announcing nothing."""
        error = Unavailable(f"the server cannot write its state ({self._failing_why}); retry")
        for actions, done in batch:
            for job_id, outcome in actions.wakes:
                self._waiters.refuse(job_id, outcome, error)
            if done is not None and not done.done():
                done.set_exception(error)

    async def _plan(self, request: PlanRequest) -> None:
        """Plans a big world in a worker thread (the event loop keeps running:
        the thread gives up the GIL every few milliseconds), one at a time, and
        hands the result to the state machine; a request superseded while it
        waited for its turn is not planned at all."""
        async with self._planner:
            if not self._machine.plan_wanted(request):
                return
            plan = await asyncio.to_thread(plan_or_error, request.candidates, request.spec)
        self.submit(self._machine.planned(request, plan))

    async def _commit(self, writes: list) -> bool:
        try:
            if self._store.blocking:
                await asyncio.to_thread(self._store.commit, writes, self._epoch)
            else:
                self._store.commit(writes, self._epoch)
        except Fenced as exc:
            self.fenced = exc
            log.error("store_fenced", extra={"fields": {"reason": str(exc)}})
            self._fail_all(Unavailable(f"this server no longer owns its store ({exc}); retry: another server serves it"))
            self._on_fenced(exc)
            return False
        except StoreError as exc:
            self._failing_why = str(exc)
            if not self._failing:  # once per outage: the log, the health status, the hold on new worlds
                self._failing = True
                log.error("store_failed", extra={"fields": {"reason": str(exc)}})
                self._on_store_error(exc)
                self._machine.hold_worlds(str(exc))
            return False
        if self._failing:
            self._failing = False
            log.warning("store_recovered")
            self._on_store_error(None)
            self.submit(self._machine.hold_worlds(None))
        return True

    # -- deadlines -----------------------------------------------------------------

    def _rearm(self) -> None:
        at = self._machine.next_deadline()
        if at is None or self._storm or (self._timer_at is not None and at >= self._timer_at):
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, at - self._machine.now())
        fire_at = math.ceil((loop.time() + delay) / TICK_S) * TICK_S  # coalesce deadlines into ticks
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(fire_at, self._fire), at

    def _fire(self) -> None:
        late = self._machine.now() - self._timer_at if self._timer_at is not None else 0.0
        self._timer, self._timer_at, self._storm = None, None, False
        committing = self._machine.now() - self._committing_since if self._committing_since is not None else 0.0
        if committing > STALL_S:  # a slow store holds answers back: nobody can renew a lease it has not heard of
            self._machine.stalled(committing)  # (logged as store_slow once the commit ends); the rest is done below
        elif late > STALL_S and not self._after_stall:  # once per stall: a loop that always lags still expires
            log.warning("stalled", extra={"fields": {"seconds": round(late, 3)}})
            self._machine.stalled(late)
            self._after_stall = True
            self._rearm()
            return
        self._after_stall = False
        actions, more = self._machine.expire_due()
        if actions:
            self._enqueue(actions, None)
        if more:  # an expiry storm: the rest after other work has had the loop
            self._timer, self._storm = asyncio.get_running_loop().call_soon(self._fire), True
        else:
            self._rearm()
