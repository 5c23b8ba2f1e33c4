"""A worker's membership: join, wait for the assignment, then hold a session.

The session is one bidirectional stream owned by one background thread: its
messages renew the lease (every TTL/3) and carry the worker's spare port; on
it the server pushes the next generation's assignment when the world changes
(preceded by a world_changed event only when the new world cannot form at
once). If the server is unreachable the thread reconnects with exponential
backoff and jitter; the running job is never disturbed and one warning is
logged per outage. `close` stops and joins it.

Join carries a client-chosen member id, so a Join retried after a broken call
or a server restart re-attaches instead of joining twice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from commctx.v1 import rendezvous_pb2 as pb

from .assignment import Assignment
from .errors import MemberNotFound, RendezvousError, RendezvousTimeout, ServerUnavailable
from .transport import Tls, error_from_rpc, open_channel

log = logging.getLogger("commctx")

_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "INTERNAL")
_TIMEOUT = pb.ErrorReason.Name(pb.RENDEZVOUS_TIMEOUT)
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0


@dataclasses.dataclass(frozen=True)
class WorldChange:
    """The server is re-forming the world this worker is in."""

    generation: int  # the generation being replaced
    reason: str


def backoff(attempt: int) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(max, first * 2^attempt)]."""
    return random.uniform(0, min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**attempt))


class Session:
    """One membership in one job on one rendezvous server."""

    def __init__(self, server_addr: str, tls: Tls | None = None, token: str | None = None) -> None:
        self.server_addr = server_addr
        self._channel, self._stub = open_channel(server_addr, tls, token)
        self.member_id = os.urandom(16).hex()
        self._secret = os.urandom(16).hex()  # the membership's credential: sent, never logged
        self.assignment: Assignment | None = None
        self.lease_error: RendezvousError | None = None  # set when the server says the member is gone
        self._job_id = ""
        self._ttl_s = 10.0
        self._lock = threading.Condition()
        self._generation = 0
        self._spare_port = 0
        self._change: WorldChange | None = None
        self._next: Assignment | None = None  # a pushed assignment not yet taken
        self._callbacks: list[Callable[[WorldChange], None]] = []
        self._wake: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._call: grpc.Future | None = None
        self._closed = False

    # -- joining ---------------------------------------------------------------

    def join(self, request: pb.JoinRequest, timeout_s: float) -> Assignment:
        """Joins and blocks until placed in a world, then starts the session.

        `request.master_port` is the worker's first spare port.

        Retries (with backoff) while the server is unreachable, re-attaching to
        the same membership, until `timeout_s` has passed.

        Raises:
            RendezvousError: the server refused the join (a subclass says why),
                the world did not form within `timeout_s`, or the server could
                not be reached.
        """
        request.member_id = self.member_id
        request.member_secret = self._secret
        self._job_id = request.job_id
        self._spare_port = request.master_port
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            request.wait_timeout_ms = max(1, round(remaining * 1000))
            # The server answers DEADLINE_EXCEEDED (with who is missing) when the
            # wait ends; the call's own deadline only guards against a silent server.
            slack_s = min(5.0, 0.5 + remaining * 0.05)
            try:
                response = self._stub.Join(request, timeout=remaining + slack_s, wait_for_ready=True)
                break
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
            if err.code not in _TRANSIENT or err.reason == _TIMEOUT:  # the server's own answer: final
                raise err
            if time.monotonic() + 0.05 >= deadline:
                raise ServerUnavailable(err.code, f"no answer from rendezvous server {self.server_addr} within {timeout_s:g} s ({err.details})")
            if attempt == 0:
                log.warning("rendezvous server %s: %s; retrying the join", self.server_addr, err)
            time.sleep(min(backoff(attempt), max(0.0, deadline - time.monotonic())))  # backoff, not polling a condition
            attempt += 1
        self._ttl_s = response.lease_ttl_ms / 1000
        self.assignment = Assignment.from_proto(response.assignment, response.member_id)
        self._generation = self.assignment.generation
        self._thread = threading.Thread(target=self._run, name="commctx-session", daemon=True)
        self._thread.start()
        return self.assignment

    # -- the session thread -------------------------------------------------------

    def _requests(self) -> Iterator[pb.SessionRequest]:
        while True:
            with self._lock:
                message = pb.SessionRequest(
                    job_id=self._job_id, member_id=self.member_id, generation=self._generation, spare_port=self._spare_port,
                    member_secret=self._secret,
                )
            yield message
            try:  # the next renewal after TTL/3, or at once for a new spare port or to stop
                self._wake.get(timeout=max(self._ttl_s / 3, 0.01))
            except queue.Empty:
                pass
            if self._stop.is_set():
                return

    def _run(self) -> None:
        attempt = 0
        outage_since: float | None = None
        while not self._stop.is_set():
            call = self._stub.Session(self._requests())
            self._call = call
            try:
                for event in call:
                    if outage_since is not None:
                        log.warning("rendezvous server %s answers again after %.1f s", self.server_addr, time.monotonic() - outage_since)
                        outage_since = None
                    attempt = 0
                    if self._handle(event):
                        return
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                err = error_from_rpc(exc)
                if outage_since is None:
                    outage_since = time.monotonic()
                    log.warning(
                        "rendezvous server %s unreachable (%s); the job keeps running, and the session "
                        "reconnects when it answers again", self.server_addr, err.code,
                    )
            if self._stop.wait(backoff(attempt)):
                return
            attempt = min(attempt + 1, 10)

    def _handle(self, event: pb.SessionEvent) -> bool:
        """Applies one event; True when the session is over."""
        kind = event.WhichOneof("event")
        if kind == "lease_ttl_ms":
            self._ttl_s = event.lease_ttl_ms / 1000
        elif kind == "world_changed":
            self._changed(WorldChange(event.world_changed.generation, event.world_changed.reason))
        elif kind == "assignment":
            a = Assignment.from_proto(event.assignment, self.member_id)
            with self._lock:
                self._next = a
                self._lock.notify_all()
            self._changed(WorldChange(self._generation, a.reason))  # unless world_changed said so already
        elif kind == "gone":
            with self._lock:
                self.lease_error = MemberNotFound("NOT_FOUND", event.gone)
                self._lock.notify_all()
            if not self._stop.is_set():  # no news while this worker is leaving anyway
                log.warning("membership of %s in job %r is over: %s", self.member_id, self._job_id, event.gone)
            return True
        return False

    def _changed(self, change: WorldChange) -> None:
        with self._lock:
            if self._change is not None:
                return
            self._change = change
            callbacks = list(self._callbacks)
            self._lock.notify_all()
        log.warning("the world of generation %d is changing: %s", change.generation, change.reason)
        for callback in callbacks:
            try:
                callback(change)
            except Exception:  # a user's callback must not end the session
                log.exception("world-changed callback failed")

    # -- world changes --------------------------------------------------------------

    @property
    def world_change(self) -> WorldChange | None:
        """The pending change of the world, if the server announced one."""
        with self._lock:
            return self._change

    def on_world_changed(self, callback: Callable[[WorldChange], None]) -> None:
        """Calls `callback(change)` from the session thread when the world changes."""
        with self._lock:
            self._callbacks.append(callback)

    def wait_world_change(self, timeout_s: float | None = None) -> WorldChange | None:
        with self._lock:
            self._lock.wait_for(lambda: self._change is not None or self.lease_error is not None, timeout_s)
            return self._change

    def offer_spare(self, port: int) -> None:
        """Tells the server (now, not at the next renewal) of a new spare listening port."""
        with self._lock:
            self._spare_port = port
        self._wake.put(True)

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

    # -- closing -------------------------------------------------------------------

    def close(self, *, leave: bool = True, leave_timeout_s: float = 1.0) -> None:
        """Stops the session, leaves the job (best effort), closes the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.put(True)
        if self._call is not None:
            self._call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        if leave and self.assignment is not None:
            try:
                self._stub.Leave(pb.LeaveRequest(job_id=self._job_id, member_id=self.member_id, member_secret=self._secret),
                                 timeout=leave_timeout_s)
            except grpc.RpcError as exc:
                log.debug("leave failed: %s", error_from_rpc(exc))
        self._channel.close()
