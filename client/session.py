"""A worker's membership: join, wait for the assignment, keep the lease alive.

The keep-alive runs on one daemon thread owned by the Session; `close` stops and
joins it. An unreachable server never disturbs the running job: renewals keep
being retried and one warning is logged per outage.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from commctx.v1 import rendezvous_pb2 as pb

from .assignment import Assignment
from .errors import RendezvousError, RendezvousTimeout, ServerUnavailable
from .transport import error_from_rpc, open_channel

log = logging.getLogger("commctx")

_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


class Session:
    """One membership in one job on one rendezvous server."""

    def __init__(self, server_addr: str) -> None:
        self.server_addr = server_addr
        self._channel, self._stub = open_channel(server_addr)
        self.member_id: str | None = None
        self.assignment: Assignment | None = None
        self.lease_error: RendezvousError | None = None
        self._job_id = ""
        self._ttl_s = 0.0
        self._generation = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def join(self, request: pb.JoinRequest, timeout_s: float) -> Assignment:
        """Joins and blocks until the world has formed, then starts the keep-alive.

        Raises:
            RendezvousError: the server refused the join (a subclass says why),
                the world did not form within `timeout_s`, or the server could
                not be reached.
        """
        request.wait_timeout_ms = max(1, round(timeout_s * 1000))
        self._job_id = request.job_id
        # The server answers DEADLINE_EXCEEDED (with who is missing) at timeout_s;
        # the call's own deadline only guards against a server that went silent.
        # wait_for_ready: a worker may start before the server does.
        slack_s = min(5.0, 0.5 + timeout_s * 0.05)
        try:
            response = self._stub.Join(request, timeout=timeout_s + slack_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            err = error_from_rpc(exc)
            if isinstance(err, RendezvousTimeout) and "did not form" not in err.details:
                raise ServerUnavailable(
                    err.code, f"no answer from rendezvous server {self.server_addr} within {timeout_s + slack_s:g} s"
                ) from exc
            raise err from exc
        self.member_id = response.member_id
        self._ttl_s = response.lease_ttl_ms / 1000
        self.assignment = Assignment.from_proto(response.assignment, response.member_id)
        self._generation = self.assignment.generation
        self._start_keepalive()
        return self.assignment

    def _start_keepalive(self) -> None:
        self._thread = threading.Thread(target=self._keepalive, name="commctx-keepalive", daemon=True)
        self._thread.start()

    def _keepalive(self) -> None:
        interval = max(self._ttl_s / 3, 0.01)
        outage_since: float | None = None
        while not self._stop.wait(interval):
            request = pb.KeepAliveRequest(job_id=self._job_id, member_id=self.member_id, generation=self._generation)
            try:
                self._stub.KeepAlive(request, timeout=min(max(interval, 0.5), 5.0))
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
                if err.code in _TRANSIENT:
                    if outage_since is None:
                        outage_since = time.monotonic()
                        log.warning(
                            "rendezvous server %s unreachable (%s); the job keeps running and the "
                            "lease is renewed when it answers again", self.server_addr, err.code,
                        )
                    continue
                self.lease_error = err
                log.error("lease of member %s in job %r lost: %s", self.member_id, self._job_id, err)
                return
            if outage_since is not None:
                log.warning("rendezvous server %s answers again after %.1f s", self.server_addr, time.monotonic() - outage_since)
                outage_since = None

    def _stop_keepalive(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def close(self, *, leave: bool = True, leave_timeout_s: float = 1.0) -> None:
        """Stops the keep-alive, leaves the job (best effort), closes the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_keepalive()
        if leave and self.member_id is not None:
            try:
                self._stub.Leave(pb.LeaveRequest(job_id=self._job_id, member_id=self.member_id), timeout=leave_timeout_s)
            except grpc.RpcError as exc:
                log.debug("leave failed: %s", error_from_rpc(exc))
        self._channel.close()
