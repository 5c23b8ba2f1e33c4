"""A member's news of its world: what the server pushes, applied in one place.

`News` holds what a worker knows of its membership between calls: its
current assignment, the next one pushed but not yet taken, the pending world
change, whether the membership is over, and the callbacks that hear of these
(the user's `on_world_changed`, the membership's `on_world_ended`, which
aborts a world members went from without a Leave). `apply` takes one
SessionEvent. Two classes feed it: `Session`, a member's own stream to the
server, and `host.HostLink`, a worker of a host membership, fed by the hub
that holds the host's Session.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable

from commctx.v1 import rendezvous_pb2 as pb

from .assignment import Assignment
from .errors import MemberNotFound, RendezvousError, RendezvousTimeout

log = logging.getLogger("commctx")


@dataclasses.dataclass(frozen=True)
class WorldChange:
    """The server is re-forming the world this worker is in or, `final`, the
    job cannot go on for this worker (below its minimum, ended, or its lease
    lost): then `rejoin()` raises MemberNotFound with `reason`."""

    generation: int  # the generation being replaced
    reason: str
    final: bool = False
    closed: bool = False  # final: the job was closed (a launcher shut the run down)


class News:
    """One worker's news of its membership; fed by `apply`, read by the worker's threads."""

    def __init__(self, member_id: str = "") -> None:
        self.member_id = member_id
        self.assignment: Assignment | None = None
        self.lease_error: RendezvousError | None = None  # set when the server says the member is gone
        self._job_id = ""
        self._ttl_s = 10.0
        self._lock = threading.Condition()
        self._generation = 0
        self._change: WorldChange | None = None
        self._next: Assignment | None = None  # a pushed assignment not yet taken
        self._callbacks: list[Callable[[WorldChange], None]] = []
        self._ended: Callable[[float, str], None] | None = None  # on_world_ended's
        self._stop = threading.Event()  # the worker is leaving: no more news is acted on

    def apply(self, event: pb.SessionEvent, assignment: pb.Assignment | None = None) -> bool:
        """Applies one event (`assignment`: this worker's, where the event
        carries a host's workers' assignments); True when the membership is over."""
        kind = event.WhichOneof("event")
        if kind == "lease_ttl_ms":
            self._ttl_s = event.lease_ttl_ms / 1000
        elif kind == "world_changed":
            change = event.world_changed
            if change.lost:
                self._world_ended(change.generation + 1, change.reason)
            self._changed(WorldChange(change.generation, change.reason))
        elif kind == "assignment":
            m = assignment if assignment is not None else event.assignment
            a = Assignment.from_proto(m, self.member_id)
            with self._lock:
                self._next = a
                held = self._generation  # read with _next set: a rejoin taking it moves _generation on
                self._lock.notify_all()
            if m.previous_lost:
                self._world_ended(a.generation, a.reason)
            self._changed(WorldChange(held, a.reason))  # unless world_changed said so already
        elif kind == "gone":
            if not event.job_ended:  # a job finishing (its members left) ends no collective
                self._world_ended(math.inf, event.gone)
            if not self._stop.is_set():  # no news while this worker is leaving anyway
                # A job whose members are leaving (it finished) is no trouble: INFO, not WARNING.
                log.log(logging.INFO if event.job_ended else logging.WARNING,
                        "membership of %s in job %r is over: %s", self.member_id, self._job_id, event.gone)
                self._changed(WorldChange(self._generation, event.gone, final=True, closed=event.job_closed))  # first: waiters wake
            with self._lock:
                self.lease_error = MemberNotFound("NOT_FOUND", event.gone)
                self._lock.notify_all()
            return True
        return False

    def _world_ended(self, before: float, reason: str) -> None:
        if self._ended is not None and not self._stop.is_set():
            try:
                self._ended(before, reason)
            except Exception:  # the news must keep coming
                log.exception("ending the old world failed")

    def _changed(self, change: WorldChange) -> None:
        with self._lock:
            if self._change is not None and (self._change.final or not change.final):
                return  # once per change; a final one replaces one that was not
            self._change = change
            callbacks = list(self._callbacks)
            self._lock.notify_all()
        if not change.final:
            log.warning("the world of generation %d is changing: %s", change.generation, change.reason)
        for callback in callbacks:
            try:
                callback(change)
            except Exception:  # a user's callback must not stop the news
                log.exception("world-changed callback failed")

    # -- what the worker reads ----------------------------------------------------------

    @property
    def world_change(self) -> WorldChange | None:
        """The pending change of the world, if the server announced one."""
        with self._lock:
            return self._change

    def on_world_changed(self, callback: Callable[[WorldChange], None]) -> None:
        """Calls `callback(change)` from the thread that brings the news when the world changes."""
        with self._lock:
            self._callbacks.append(callback)

    def on_world_ended(self, callback: Callable[[float, str], None]) -> None:
        """Calls `callback(before, reason)` from the thread that brings the news, first
        thing, when a collective of a world older than generation `before` may
        block for ever: members of it went without a Leave (their lease
        expired, their session closed), as a world_changed or the assignment
        of generation `before` says, or this membership is over and not
        because its job finished (`before` is infinite). Members that left,
        and a world that only grows, end no collective: those complete or
        fail by themselves. One callback: the membership's."""
        self._ended = callback

    @property
    def next_ready(self) -> bool:
        """Whether the next world's assignment is here, for next_assignment to take at once."""
        with self._lock:
            return self._next is not None

    @property
    def lease_ttl_s(self) -> float:
        """The lease TTL the server granted (before the join: the default's)."""
        return self._ttl_s

    def wait_world_change(self, timeout_s: float | None = None) -> WorldChange | None:
        with self._lock:
            self._lock.wait_for(lambda: self._change is not None or self.lease_error is not None, timeout_s)
            return self._change

    def settle(self, generation: int) -> None:
        """This member now runs in `generation` (a node membership read it with
        `current_world`): news of that generation or older is spent."""
        with self._lock:
            if self._next is not None and self._next.generation <= generation:
                self._next = None
            if self._change is not None and not self._change.final and self._change.generation < generation:
                self._change = None
            self._generation = max(self._generation, generation)

    def next_assignment(self, timeout_s: float) -> Assignment:
        """Waits for the next generation's assignment and takes it.

        Raises:
            MemberNotFound: the server says the member is gone or the job cannot continue.
            RendezvousTimeout: no new world within `timeout_s`.
        """
        with self._lock:
            self._lock.wait_for(lambda: self._next is not None or self.lease_error is not None, timeout_s)
            if self._next is not None:
                self.assignment, self._next, self._change = self._next, None, None
                self._generation = self.assignment.generation
                return self.assignment
            if self.lease_error is not None:
                raise self.lease_error
        raise RendezvousTimeout("DEADLINE_EXCEEDED", f"no new world within {timeout_s:g} s")
