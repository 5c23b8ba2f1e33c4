"""A member's stream to the server: join, wait for the assignment, then hold a session.

The session is one bidirectional stream owned by one background thread: its
messages renew the lease (every TTL/3) and carry the worker's spare port; on
it the server pushes the next generation's assignment when the world changes
(preceded by a world_changed event only when the new world cannot form at
once). If the server is unreachable the thread reconnects with exponential
backoff and jitter; the running job is never disturbed and one warning is
logged per outage. `close` stops and joins it.

Join carries a client-chosen member id, so a Join retried after a broken call
or a server restart re-attaches instead of joining twice. A Join that cannot
reach the server retries with backoff until its timeout, and says so: a
warning after UNREACHABLE_WARN_AFTER_S and every UNREACHABLE_WARN_EVERY_S
after, with the address, why, and how long it goes on trying (a server name
that does not resolve yet is waited for the same way: route_source). A
mistake that trying again cannot heal (TLS that does not match the server's,
the HTTP or health port, a token refused: transport.unhealable) ends the
join at its first try instead. Ctrl-C in the wait withdraws the Join.

A highly available server is several replicas (`server_addr` a comma-separated
list, or a name that resolves to several addresses; see channels.Endpoints).
Every call starts at the known leader; a replica that is not the leader answers
NOT_LEADER, naming the leader, and the call goes there; an unreachable one is
skipped for the next. A NOT_LEADER answer is transient: the join retries it,
and the session moves to the new leader by itself. Once the lease is known,
no pause between tries exceeds a third of it, so a failover costs no member
its lease.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from commctx.v1 import rendezvous_pb2 as pb

from .addresses import host_port
from .assignment import Assignment
from .channels import Endpoints, LeaderStub
from .credentials import Tls
from .errors import ServerUnavailable
from .news import News, WorldChange
from .progress import DEFAULT_EVERY_S, Progress, describe_wait
from .transport import NOT_LEADER, error_from_rpc, leader_hint, why_unreachable

log = logging.getLogger("commctx")

__all__ = ["Session", "WorldChange", "backoff"]  # WorldChange: what a Session announces, defined in news.py

_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "INTERNAL")
_TIMEOUT = pb.ErrorReason.Name(pb.RENDEZVOUS_TIMEOUT)
SESSION_REPLACED = "SESSION_REPLACED"  # matched as text, as NOT_LEADER is
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0
JOIN_BACKOFF_MAX_S = 3.0  # before the lease is known
# A Join that has not reached the server for this long logs a warning, and
# another every UNREACHABLE_WARN_EVERY_S while it still has not.
UNREACHABLE_WARN_AFTER_S = 5.0
UNREACHABLE_WARN_EVERY_S = 30.0


def route_source(server_addr: str, host: str, port: int, timeout_s: float) -> str:
    """The local address of this machine's route to `host`:`port` (the server's, or its first
    replica's; `server_addr` as given, for messages). A name that does not resolve, or a host no
    route leads to, is waited for as an unreachable server is (backoff, the same warnings) until
    `timeout_s`: in a cluster that is starting, names come late (a Kubernetes headless Service's
    resolves only once its pod is ready).

    Raises:
        ServerUnavailable: still no route after `timeout_s`; the message names the host.
    """
    from .netif import route_source_address  # (psutil: a worker's dependency, not the command line's)

    start = time.monotonic()
    deadline, next_warning, attempt = start + timeout_s, start + UNREACHABLE_WARN_AFTER_S, 0
    while True:
        try:
            return route_source_address(host, port)
        except OSError as exc:
            unresolved = isinstance(exc, socket.gaierror)
            cause = exc.strerror or str(exc)
        now = time.monotonic()
        if now + 0.05 >= deadline:
            what = f"host {host!r} did not resolve within {timeout_s:g} s ({cause})" if unresolved else \
                f"host {host!r}: {cause} for {timeout_s:g} s"
            raise ServerUnavailable("UNAVAILABLE", f"cannot reach rendezvous server {server_addr}: {what}; check "
                                                   f"server_addr= or COMMCTX_SERVER")
        if now >= next_warning and deadline - now >= 0.5:
            next_warning = now + UNREACHABLE_WARN_EVERY_S
            log.warning("cannot reach the rendezvous server at %s for %.0f s (%s); still trying for %.0f s",
                        host_port(host, port), now - start,
                        f"host {host!r} does not resolve: {cause}" if unresolved else cause.lower(), deadline - now)
        time.sleep(max(0.0, min(backoff(attempt, JOIN_BACKOFF_MAX_S), next_warning - now, deadline - now)))
        attempt += 1


def backoff(attempt: int, max_s: float = BACKOFF_MAX_S) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(max_s, BACKOFF_MAX_S, first * 2^attempt)]."""
    return random.uniform(0, min(max_s, BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**min(attempt, 30)))


class Session(News):
    """A member's stream to the rendezvous server. It owns the channels to the
    server's replicas, the member's id and secret, its Join, and the thread
    that holds the session stream: renewing the lease, reporting failures and
    departures, and applying the server's news (News) as it comes."""

    def __init__(self, server_addr: str, tls: Tls | None = None, token: str | None = None) -> None:
        """`server_addr`: 'host:port', or a comma-separated list of the replicas'.

        Raises:
            ValueError: an address is not host:port.
            UsageError: a TLS file cannot be read, or the token is not printable ASCII.
        """
        super().__init__(os.urandom(16).hex())
        self.server_addr = server_addr
        self._endpoints = Endpoints(server_addr, tls, token)
        self._secret = os.urandom(16).hex()  # the membership's credential: sent, never logged
        self._job_secret = ""
        self._ttl_known = False
        self._spare_port = 0
        self._restart = 0  # a generation to re-form (a launcher restarting its workers), until sent
        self._failed = 0  # a generation whose collectives failed here, until reported
        self._ended_workers: dict[str, list[int]] = {"gone": [], "left": [], "expired": []}  # a host's, until reported
        self.worker_assignments: tuple[pb.Assignment, ...] = ()  # a node membership's, by local rank
        self._wake: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._call: grpc.Future | None = None
        self._closed = False

    # -- joining ---------------------------------------------------------------

    def connect(self) -> None:
        """Starts connecting to the server now, so that `join` finds the connection up."""
        self._endpoints.connect()

    def join(self, request: pb.JoinRequest, timeout_s: float, progress_s: float = DEFAULT_EVERY_S,
             progress_line: Callable[[str, pb.JobDescription], str] = describe_wait) -> Assignment:
        """Joins and blocks until seated in a world, then starts the session.

        `request.master_port` is the worker's first spare port. While it waits,
        every `progress_s` seconds (0: never) it says who it waits for
        (progress.say, a line made by `progress_line`).

        Retries (with backoff) while the server is unreachable or the replica
        asked is not the leader, re-attaching to the same membership, until
        `timeout_s` has passed.

        Raises:
            RendezvousError: the server refused the join (a subclass says why),
                the world did not form within `timeout_s`, or the server could
                not be reached.
            ConnectionMismatch: at the first try, the address answers but not as
                this client's settings expect (transport.unhealable).
            KeyboardInterrupt: Ctrl-C in the wait; the Join was withdrawn (the
                session is closed), and the traceback holds no gRPC frames.
        """
        request.member_id = self.member_id
        request.member_secret = self._secret
        self._job_id = request.job_id
        self._job_secret = request.job_secret  # a sealed job's: Leave carries it
        self._spare_port = request.master_port
        try:
            with Progress(lambda r, t: self._endpoints.call("DescribeJob", r, t), request.job_id, request.job_secret,
                          progress_s, progress_line):
                response = self._join(request, timeout_s)
        except KeyboardInterrupt:
            # Ctrl-C in the wait: the Join call ends here (the server withdraws the membership), and
            # the interrupt goes on to the program without gRPC's frames in its traceback.
            self.close(leave=False)
            raise KeyboardInterrupt(f"while joining job {request.job_id!r} at {self.server_addr}: "
                                    f"the join was withdrawn") from None
        self.start(response)
        return self.assignment

    def start(self, response: pb.JoinResponse) -> None:
        """Seated (`response`, the Join's answer): starts the session stream."""
        self._endpoints.succeeded()
        self._ttl_s = response.lease_ttl_ms / 1000
        self._ttl_known = True
        self.assignment = Assignment.from_proto(response.assignment, response.member_id)
        self.worker_assignments = tuple(response.worker_assignments)
        self._generation = self.assignment.generation
        self._thread = threading.Thread(target=self._run, name="commctx-session", daemon=True)
        self._thread.start()

    def credentials(self, member_id: str, secret: str, job_id: str, job_secret: str) -> None:
        """This session is for the membership `member_id` (whose secret is
        `secret`), joined before by another process (a host's): set before
        `join` or `start`."""
        self.member_id, self._secret, self._job_id, self._job_secret = member_id, secret, job_id, job_secret

    def _join(self, request: pb.JoinRequest, timeout_s: float) -> pb.JoinResponse:
        """The Join call, retried while the server cannot be reached (see join)."""
        deadline = time.monotonic() + timeout_s
        attempt = 0
        down_since: float | None = None  # since when no try has reached the server
        next_warning = 0.0
        while True:
            remaining = deadline - time.monotonic()
            request.wait_timeout_ms = max(1, round(remaining * 1000))
            # The server answers DEADLINE_EXCEEDED (with who is missing) when the
            # wait ends; the call's own deadline only guards against a silent server.
            slack_s = min(5.0, 0.5 + remaining * 0.05)
            addr = self._endpoints.address
            try:
                # Not wait_for_ready: a server that is down or not there yet fails the
                # try at once, so that this loop can say so and retry with backoff.
                response = self._endpoints.stub.Join(request, timeout=remaining + slack_s)
                break
            except grpc.RpcError as exc:
                err, hint = error_from_rpc(exc), leader_hint(exc)
                # A mistake that trying again cannot heal (TLS that does not match, the HTTP port, another
                # gRPC service, a token refused) ends the join at its first sign, naming what to change.
                final = self._endpoints.unhealable(exc, addr, min(1.0, max(0.05, (deadline - time.monotonic()) / 2)))
                if final is not None:
                    raise final from None
                if err.code in _TRANSIENT and err.reason != _TIMEOUT:
                    self._endpoints.failed(exc)  # to the leader it names, or the next replica
            if err.code not in _TRANSIENT or err.reason == _TIMEOUT:  # the server's own answer: final
                raise err
            now = time.monotonic()
            if now + 0.05 >= deadline:
                raise ServerUnavailable(err.code, f"no answer from rendezvous server {self.server_addr} within {timeout_s:g} s ({err.details})")
            pause = self._backoff(attempt)
            if not hint:  # following a leader's hint is no outage
                if down_since is None:
                    down_since, next_warning = now, now + UNREACHABLE_WARN_AFTER_S
                if now >= next_warning and deadline - now >= 0.5:  # about to give up: the error says it
                    next_warning = now + UNREACHABLE_WARN_EVERY_S
                    following = self._endpoints.address  # another replica, where there are several
                    log.warning("cannot reach the rendezvous server at %s for %.0f s (%s); still trying for %.0f s%s",
                                addr, now - down_since, why_unreachable(addr, min(1.0, (deadline - now) / 2)), deadline - now,
                                f", next at {following}" if following != addr else "")
                pause = min(pause, max(0.01, next_warning - now))  # the warning comes on time
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))  # backoff, not polling a condition
            attempt += 1
        return response

    def _backoff(self, attempt: int) -> float:
        """The pause before try `attempt` + 1: at most a third of the lease once it is known."""
        return backoff(attempt, self._ttl_s / 3 if self._ttl_known else JOIN_BACKOFF_MAX_S)

    # -- the session thread -------------------------------------------------------

    def _requests(self) -> Iterator[pb.SessionRequest]:
        while True:
            with self._lock:
                message = pb.SessionRequest(
                    job_id=self._job_id, member_id=self.member_id, generation=self._generation, spare_port=self._spare_port,
                    member_secret=self._secret, restart_generation=self._restart, failed_generation=self._failed,
                    gone_workers=self._ended_workers["gone"], left_workers=self._ended_workers["left"],
                    expired_workers=self._ended_workers["expired"],
                )
                self._restart = self._failed = 0
                self._ended_workers = {"gone": [], "left": [], "expired": []}
            yield message
            try:  # the next renewal after TTL/3, or at once for a new spare port or to stop
                self._wake.get(timeout=max(self._ttl_s / 3, 0.01))
            except queue.Empty:
                pass
            if self._stop.is_set():
                return

    def _run(self) -> None:
        attempt = 0
        outage: tuple[float, str] | None = None  # since when, and the replica that went away
        warned = False  # about this outage
        while not self._stop.is_set():
            addr = self._endpoints.address
            call = self._endpoints.stub.Session(self._requests())
            self._call = call
            answered, opened_at = False, time.monotonic()
            try:
                for event in call:
                    if not answered:
                        answered, attempt = True, 0
                        self._endpoints.succeeded()  # warns when the leader moved
                        if outage is not None and warned and outage[1] == addr:
                            log.warning("rendezvous server %s answers again after %.1f s", addr, time.monotonic() - outage[0])
                        outage, warned = None, False
                    if self._handle(event):
                        return
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                err = error_from_rpc(exc)
                if err.reason == SESSION_REPLACED:  # another process holds this membership now: do not fight over it
                    log.error("membership %s of job %r: %s; this session stops", self.member_id, self._job_id, err.details)
                    return
                moved = self._endpoints.failed(exc)  # to the leader it names, or the next replica
                if answered and err.code == "UNAVAILABLE" and time.monotonic() - opened_at > 1.0:
                    # A working stream dropped (its connection reached its age, or
                    # broke): reconnect at once, within the server's reconnect grace.
                    # Only a reconnect that fails is an outage worth a warning.
                    log.debug("session stream to %s ended (%s); reconnecting", addr, err.details)
                    continue
                if outage is None:
                    outage = (time.monotonic(), addr)
                if not warned and not leader_hint(exc):  # a replica handing over to a known leader is no outage
                    warned = True
                    if err.reason == NOT_LEADER:
                        log.warning("rendezvous server %s is not the leader and knows none yet; the job keeps running, "
                                    "and the session reconnects when a leader answers", addr)
                    elif moved:  # a failover: say where the session goes
                        log.warning("rendezvous server %s unreachable (%s); the job keeps running, and the session "
                                    "moves to %s (then the other replicas in turn) until the leader answers",
                                    addr, err.code, self._endpoints.address)
                    else:
                        log.warning(
                            "rendezvous server %s unreachable (%s); the job keeps running, and the session "
                            "reconnects when %s answers again", addr, err.code,
                            "the leader" if self._endpoints.several else "it",
                        )
            if self._stop.wait(self._backoff(attempt)):
                return
            attempt = min(attempt + 1, 10)

    def _handle(self, event: pb.SessionEvent) -> bool:
        """Applies one event; True when the session is over."""
        if event.WhichOneof("event") == "world_changed":
            self._wake.put(True)  # renew now: the server awaits survivors it has not heard from lately
        return self.apply(event)

    # -- world changes --------------------------------------------------------------

    def report_failure(self, generation: int) -> None:
        """Tells the server (now) that this worker's collectives in `generation` failed:
        members of that world whose session closed are gone without their reconnect grace."""
        with self._lock:
            self._failed = generation
        self._wake.put(True)

    def report_workers(self, indexes: list[int], why: str) -> None:
        """Tells the server (now) that these workers of its host membership are
        gone: `why` "gone" (their process ended), "left" or "expired" (went silent)."""
        with self._lock:
            self._ended_workers[why].extend(indexes)
        self._wake.put(True)

    def offer_spare(self, port: int) -> None:
        """Tells the server (now, not at the next renewal) of a new spare listening port."""
        with self._lock:
            self._spare_port = port
        self._wake.put(True)

    def request_restart(self) -> None:
        """Asks the server for the next generation of the current world with the
        same members (a launcher restarting its workers after a failure)."""
        with self._lock:
            self._restart = self._generation
        self._wake.put(True)

    def describe(self, timeout_s: float) -> pb.JobDescription:
        """The job as DescribeJob says (its first node only), from the leader.

        Raises:
            RendezvousError: the server refused it, or could not be reached.
        """
        try:
            return self._endpoints.call("DescribeJob", pb.DescribeJobRequest(
                job_id=self._job_id, job_secret=self._job_secret, node_page_size=1), timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def current_world(self, request: pb.JoinRequest, timeout_s: float) -> pb.JoinResponse:
        """The answer to `request` (the one `join` sent, which names this
        membership) for the world this member sits in now: a Join re-attaching to
        the membership. A node membership's session events carry its first
        worker's assignment; this gives all.

        Raises:
            RendezvousError: the server refused it (a subclass says why).
        """
        request.wait_timeout_ms = max(1, round(timeout_s * 1000))
        try:
            response = self._endpoints.call("Join", request, timeout_s + 5.0)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return response

    # -- closing -------------------------------------------------------------------

    def close(self, *, leave: bool = True, leave_timeout_s: float = 1.0, close_job: bool = False, wait: bool = True) -> None:
        """Stops the session, leaves the job (best effort), closes the channel. Idempotent.

        `close_job` also closes the job for every member (torchrun's shutdown of the run). Without
        `wait`, the session thread ends by itself (a host's hub closes it holding a lock that thread takes)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        # Leave before the stream ends: a session ended without a Leave is a
        # crash to the server (the member goes after its reconnect grace, and
        # the job may fail); one that left first is a departure.
        if leave and self._thread is not None:  # seated (or a host's session, taken over)
            try:  # to the leader, following a hint if the leader moved
                LeaderStub(self._endpoints).Leave(
                    pb.LeaveRequest(job_id=self._job_id, member_id=self.member_id, member_secret=self._secret,
                                    job_secret=self._job_secret, close=close_job),
                    timeout=leave_timeout_s)
            except grpc.RpcError as exc:
                log.debug("leave failed: %s", error_from_rpc(exc))
        self._wake.put(True)
        if self._call is not None:
            self._call.cancel()
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
        self._endpoints.close()
