"""Workers of one job on one host share one membership: the host link.

The server sees a host membership (JoinRequest.host_workers): one Join, one
lease and one session for the CommContext workers of one job and node key on
one machine, each worker seated with its own role. One of them, the first to
take the host's lock, also runs the `Hub`: it holds the membership, its Join
and its session with the server, and a Unix socket the host's workers (itself
included) reach it on, each as a `HostLink`. The socket lives in a
per-user runtime directory (mode 0700: only this user's processes reach it),
named after the server, job and node key.

Over the socket, a worker says hello (who it is and the job it means) and the
hub answers with its number in the membership; then the hub passes on the
server's news, each worker getting its own assignment, and the worker that
becomes rank 0 the listening socket its TCPStore is served on (the
membership's spare, which the hub then replaces). A worker's failed
collectives go back to the server through the hub, as does its leaving; a
worker whose connection closes without a leave died: the hub reports it gone
at once (SessionRequest.gone_workers), and its peers keep their seats.

When the hub's process dies, its workers see their connections close; one of
them takes the lock and becomes the hub, opening the membership's session
anew within the server's reconnect grace (every worker knows the membership's
id, secret and workers), the others reconnect, and the dead process's workers
are reported gone. Nobody else in the job notices beyond the workers that died.

Before the membership is seated, a worker joining or leaving changes the Join:
a newcomer is listed in a Join re-attaching to the membership (which takes over
from the call before); a leaver makes the hub withdraw the membership and join
anew with the others.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from typing import Any

from commctx.v1 import rendezvous_pb2 as pb

from .assignment import Assignment
from .errors import RendezvousError, RendezvousTimeout
from .host_wire import Reader, event_of, send
from .hub import HostJob, Hub
from .news import News
from .progress import DEFAULT_EVERY_S
from .transport import error_of

log = logging.getLogger("commctx")

RECONNECT_S = 2.0  # how long a worker tries to reach a new hub after its hub went


class HostLink(News):
    """A worker's end of the host link: its part in the member its host's
    workers share, reached through the hub. It offers what CommContext uses of
    a Session (news, failure reports, leaving), and starts the hub when no
    process of the host runs one."""

    def __init__(self, server_addr: str, job: HostJob, paths: tuple[str, str], worker: dict) -> None:
        super().__init__()
        self.server_addr = server_addr
        self._job = job
        self._path, self._lock_path = paths
        self._worker = worker  # role, local_rank, timeout_s: what its hellos say
        self._sock: socket.socket | None = None
        self._hub: Hub | None = None  # the hub this process runs, if it does
        self.index: int | None = None
        self._state: dict = {}
        self._spare: tuple[int, socket.socket] | None = None  # (generation, the listening socket rank 0 serves on)
        self._refused: RendezvousError | None = None
        self._welcomed = threading.Event()
        self._bye = threading.Event()  # the hub has this worker's leave
        self._closing = False
        self._reader: threading.Thread | None = None
        self._pinger: threading.Thread | None = None
        self._job_id = job.request.job_id

    # -- joining -------------------------------------------------------------------------

    def join(self, timeout_s: float, progress_s: float = DEFAULT_EVERY_S) -> None:
        """Reaches the host's hub (becoming it, if nobody is) and waits to be seated.

        Raises:
            RendezvousError: the server, or the hub on its behalf, refused it, or no world within `timeout_s`.
        """
        self._worker["progress_s"] = progress_s
        deadline = time.monotonic() + timeout_s
        self._connect(deadline)
        # The hub's Join ends by `timeout_s` with the server's answer (who is missing), a little later if the server
        # is silent (Session._join's slack): this worker waits for that answer, and says so itself only if none comes.
        slack_s = min(5.0, 0.5 + timeout_s * 0.05) + 1.0
        try:
            seated = self.next_assignment_or_refusal(max(0.0, deadline + slack_s - time.monotonic()))
        except KeyboardInterrupt:  # Ctrl-C in the wait: the hub withdraws this worker; no threading frames shown
            self.close(leave=False)
            raise KeyboardInterrupt(f"while joining job {self._job_id!r} at {self.server_addr}: "
                                    f"the join was withdrawn") from None
        if seated is None:
            self.close(leave=True)
            raise RendezvousTimeout("DEADLINE_EXCEEDED", f"the host's membership was not placed within {timeout_s:g} s")

    def next_assignment_or_refusal(self, timeout_s: float):
        with self._lock:
            self._lock.wait_for(lambda: self._next is not None or self._refused is not None or self.lease_error is not None,
                                timeout_s)
            if self._refused is not None:
                raise self._refused
        if self._next is None and self.lease_error is None:
            return None
        return self.next_assignment(0.001)

    def _connect(self, deadline: float, *, leaving: bool = False) -> None:
        """Connects to the hub, starting one here if there is none."""
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self._path)
                break
            except OSError:
                sock.close()
            if self._become_hub():
                continue
            if time.monotonic() >= deadline:
                raise RendezvousTimeout("DEADLINE_EXCEEDED", f"cannot reach this host's hub at {self._path}")
            time.sleep(0.01)
        self._sock = sock
        hello = {"kind": "hello", "pid": os.getpid(), "job": self._job.fingerprint(), **self._worker}
        if self.index is not None:
            hello["index"] = self.index
        if leaving:
            hello["leaving"] = True
        send(sock, hello)
        self._reader = threading.Thread(target=self._read, args=(sock,), name="commctx-host-link", daemon=True)
        self._reader.start()
        if self._pinger is None:
            self._pinger = threading.Thread(target=self._ping, name="commctx-host-ping", daemon=True)
            self._pinger.start()

    def _ping(self) -> None:
        """Says it is alive every third of the lease: a worker silent for a lease is gone (Hub._watch)."""
        sent = time.monotonic()
        while not self._stop.wait(max(min(self._ttl_s / 3, 0.2), 0.02)):  # the lease's TTL may be learnt meanwhile
            if time.monotonic() - sent >= self._ttl_s / 3:
                sent = time.monotonic()
                self._send({"kind": "ping"})

    def _become_hub(self) -> bool:
        """Takes the host's lock and starts its hub here, if no process holds it."""
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)  # a dead hub's
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self._path)
        os.chmod(self._path, 0o600)
        listener.listen(1024)
        self._hub = Hub(listener, fd, self._path, self._job, self._state or None)
        log.info("this process holds the host membership of job %r on node %r", self._job.request.job_id,
                 self._job.request.node_key)
        return True

    def apply(self, event: pb.SessionEvent, assignment: pb.Assignment | None = None) -> bool:
        if self.assignment is None and event.WhichOneof("event") == "assignment":  # its first world: no change
            with self._lock:
                self._next = Assignment.from_proto(event.assignment, self.member_id)
                self._lock.notify_all()
            return False
        return super().apply(event, assignment)

    # -- the link --------------------------------------------------------------------------

    def _read(self, sock: socket.socket) -> None:
        reader = Reader(sock)
        over = False
        while True:
            got = reader.read()
            if got is None:
                break
            message, fd = got
            kind = message.get("kind")
            if kind == "bye":
                self._bye.set()
                return
            if kind == "welcome":
                self.index = int(message["index"])
                self._ttl_s = float(message.get("ttl_s") or self._ttl_s)
                self._welcomed.set()
            elif kind == "state":
                self._state = message
                self.member_id = message["member_id"]
            elif kind == "refused":  # the hub closes the link: this worker is not of the host's membership
                with self._lock:
                    self._refused = error_of(message["code"], message["details"], message.get("reason", ""))
                    self._lock.notify_all()
                return
            elif kind == "event":
                event = event_of(message["event"])
                if fd is not None:
                    with self._lock:
                        self._spare = (event.assignment.generation, socket.socket(fileno=fd))
                if message.get("ttl_s"):
                    self._ttl_s = float(message["ttl_s"])
                self.member_id = message.get("member_id", self.member_id)
                if self.apply(event):  # the membership is over: the link stays, for this worker's leave
                    over = True
        if not self._closing and not over:  # (a hub that closed before welcoming it, too: it finds or becomes the next)
            self._take_over()

    def _take_over(self) -> None:
        """The hub went: take it over, or reach the worker that does."""
        log.warning("the process holding this host's membership went; taking over or reconnecting")
        self._state["ttl_s"] = self._ttl_s
        try:
            self._connect(time.monotonic() + RECONNECT_S)
        except RendezvousError as exc:
            self.apply(pb.SessionEvent(gone=f"this host's membership was lost with the process that held it ({exc.details})"))

    # -- what the worker does -----------------------------------------------------------------

    def take_spare(self, generation: int, port: int) -> socket.socket | None:
        """The listening socket rank 0 of `generation` serves its store on (the hub sent it), if it is `port`."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None or spare[0] != generation or spare[1].getsockname()[1] != port:
            if spare is not None:
                spare[1].close()
            return None
        return spare[1]

    def offer_spare(self, port: int) -> None:
        """The hub keeps the membership's spare port: nothing to offer."""

    def _leave(self, deadline: float) -> None:
        """Tells the hub this worker leaves, and waits until it has it (bye). A hub that went
        meanwhile (its process ended with the job's) is reached again: the worker taking over
        from it, or this one, takes the leave, so the membership's last leave reaches the server."""
        if self._send({"kind": "leave"}) and self._bye.wait(max(0.0, deadline - time.monotonic())):
            return
        while not self._bye.is_set() and time.monotonic() < deadline:
            if self._reader is not None and self._reader is not threading.current_thread():
                self._reader.join(max(0.0, deadline - time.monotonic()))  # the old link's end
            with contextlib.suppress(OSError):
                self._sock.close()
            try:
                self._connect(deadline, leaving=True)
            except RendezvousError:
                return
            self._bye.wait(max(0.0, deadline - time.monotonic()))

    def report_failure(self, generation: int) -> None:
        self._send({"kind": "failed", "generation": generation})

    def _send(self, message: dict) -> bool:
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                send(sock, message)
                return True
        return False

    def close(self, *, leave: bool = True, leave_timeout_s: float = 3.0, close_job: bool = False) -> None:
        """Leaves the host's membership (its hub tells the server), or just goes. Idempotent.
        (3 s: a leave may have to wait for a takeover, the hub's process ending with the job.)"""
        del close_job
        if self._closing:
            return
        self._closing = True
        self._stop.set()
        if leave and self.index is not None:
            self._leave(time.monotonic() + leave_timeout_s)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        if self._spare is not None:
            self._spare[1].close()


def host_worker(role: str, local_rank: int | None, timeout_s: float) -> dict[str, Any]:
    """What a worker's hello says of it."""
    return {"role": role, "local_rank": local_rank, "timeout_s": timeout_s}
