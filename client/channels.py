"""The channels to the rendezvous server, and which of its replicas leads.

A highly available server is several replicas, one of them the leader; the
others answer every call UNAVAILABLE with reason NOT_LEADER and the leader's
address (ErrorInfo metadata "leader") when they know it. `Endpoints` holds the
replicas a client knows and which of them leads; `LeaderStub` sends each unary
call to the leader through it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from . import errors
from .addresses import host_port, is_ip, server_addresses, split_address
from .credentials import BearerToken, Tls
from .transport import leader_hint, unhealable

log = logging.getLogger("commctx")


CHANNEL_OPTIONS = [
    # Notice a dead connection within 6 s: a server killed or frozen where its
    # FIN cannot reach us (a partition, a stalled VM) leaves a session or a
    # waiting Join hanging, unanswered, while a new leader's grace for the
    # member (a lease TTL) runs out. A ping is a few bytes each way; a waiting
    # Join sends no data, so pings must not wait for data to be sent. gRPC core
    # closes a connection on ping_timeout (default: a minute), not on the
    # keepalive timeout, so both are set.
    ("grpc.keepalive_time_ms", 3_000),
    ("grpc.keepalive_timeout_ms", 3_000),
    ("grpc.http2.ping_timeout_ms", 3_000),
    ("grpc.http2.max_pings_without_data", 0),
    # A server that comes back (restarted on its state, which gives every
    # member one lease TTL to be heard from) is dialled again within 3 s. gRPC's
    # backoff between failed attempts otherwise grows towards two minutes: after
    # a 30 s outage the sessions came back 12 s late, past the default lease.
    ("grpc.max_reconnect_backoff_ms", 3_000),
]
# Channels to one of several replicas: a call there must not wait long for a
# dead one, so each connection attempt is bounded (gRPC's default: 20 s).
FAILOVER_OPTIONS = [
    ("grpc.min_reconnect_backoff_ms", 2_000),
]



def channel_to(target: str, tls: Tls | None = None, token: str | None = None) -> grpc.Channel:
    """A channel to `target`, over TLS when `tls` is given, sending `token` on every call when given.

    Raises:
        UsageError: a TLS file cannot be read, or (InvalidArgument) the token is malformed.
    """
    return _dial(target, tls.credentials() if tls is not None else None, BearerToken(token) if token else None)


def _dial(target: str, credentials: grpc.ChannelCredentials | None, token: BearerToken | None,
          options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS) -> grpc.Channel:
    if credentials is None:
        channel = grpc.insecure_channel(target, options=list(options))
    else:
        channel = grpc.secure_channel(target, credentials, options=list(options))
    return grpc.intercept_channel(channel, token) if token is not None else channel


def open_channel(server_addr: str, tls: Tls | None = None, token: str | None = None) -> tuple[grpc.Channel, pb_grpc.RendezvousStub]:
    """A channel and stub for `server_addr` ('host:port'; the port defaults to 50051);
    see channel_to.

    Raises:
        ValueError: the address is not host:port.
        UsageError: as for channel_to.
    """
    channel = channel_to(host_port(*split_address(server_addr)), tls, token)
    return channel, pb_grpc.RendezvousStub(channel)



def _resolve(host: str, port: int) -> list[str]:
    """Every 'ip:port' `host` resolves to, in the resolver's order; [] when it does not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    out: list[str] = []
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6) and host_port(str(sockaddr[0]), port) not in out:
            out.append(host_port(str(sockaddr[0]), port))
    return out


def _ignore(_state: grpc.ChannelConnectivity) -> None:
    pass


class Endpoints:
    """The replicas of a rendezvous server this client knows, and which of them leads.

    `server_addr` is 'host:port' or a comma-separated list of them. A single
    host name that resolves to several addresses stands for all of them: each
    is dialed by IP (with TLS, the certificate must still name the host), and
    the name is resolved again after a round in which none answered.

    Calls go to `stub`, the current replica: the last one that answered, else
    the leader a replica named, else the first. After a failed call `failed`
    moves on: to the leader a NOT_LEADER answer names (also one not in the
    list), else, on UNAVAILABLE or DEADLINE_EXCEEDED, to the next replica
    round-robin. One address and no such hint: nothing moves, and its channel
    is the one `open_channel` would make.

    Channels open on first use, with the same credentials, options and token,
    and stay open until `close`. Thread-safe.
    """

    MAX_LEARNED = 8  # leader addresses learned from hints and kept beyond the given ones

    def __init__(self, server_addr: str, tls: Tls | None = None, token: str | None = None) -> None:
        """Raises:
            ValueError: an address is not host:port.
            UsageError: a TLS file cannot be read, or the token is not printable ASCII.
        """
        self.server_addr = server_addr
        given = server_addresses(server_addr)
        self._credentials = tls.credentials() if tls is not None else None
        self.tls = tls
        self._token = BearerToken(token) if token else None
        self._name: tuple[str, int] | None = None  # a host name standing for several addresses
        self._given = [host_port(*hp) for hp in given]
        if len(given) == 1 and not is_ip(given[0][0]):
            resolved = _resolve(*given[0])
            if len(resolved) > 1:
                self._name, self._given = given[0], resolved
        self._single = len(self._given) == 1 and self._name is None  # dialed exactly as given, with CHANNEL_OPTIONS
        self._learned: list[str] = []
        self._current = self._given[0]
        self._leader = ""  # the last replica that answered
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.RendezvousStub]] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> str:
        """The current replica's 'host:port'."""
        with self._lock:
            return self._current

    @property
    def candidates(self) -> list[str]:
        """Every replica's 'host:port', the given (or resolved) ones first."""
        with self._lock:
            return self._candidates()

    @property
    def several(self) -> bool:
        """Whether there is more than one replica to try."""
        with self._lock:
            return len(self._candidates()) > 1

    def _entry(self) -> tuple[grpc.Channel, pb_grpc.RendezvousStub]:
        """The current replica's channel and stub (the channel opens now if it is not open yet)."""
        with self._lock:
            if self._closed:
                raise ValueError("the channels to the rendezvous server are closed")
            entry = self._channels.get(self._current)
            if entry is None:
                channel = self._open(self._current)
                entry = self._channels[self._current] = (channel, pb_grpc.RendezvousStub(channel))
            return entry

    @property
    def stub(self) -> pb_grpc.RendezvousStub:
        """The stub of the current replica (its channel opens now if it is not open yet)."""
        return self._entry()[1]

    def connect(self) -> None:
        """Opens the current replica's channel and starts connecting it now
        (without waiting), so that the first call finds it ready."""
        channel = self._entry()[0]
        # grpc's core channel (under an intercepted one), asked directly, starts connecting without the
        # polling thread of subscribe(), which raises, unhandled, when the channel closes within its
        # 0.2 s poll (a torchrun handler created and dropped at once).
        core = channel
        while core is not None and not hasattr(core, "check_connectivity_state"):
            core = getattr(core, "_channel", None)
        if core is not None:
            core.check_connectivity_state(True)
        else:
            channel.subscribe(_ignore, try_to_connect=True)
            channel.unsubscribe(_ignore)

    def _open(self, address: str) -> grpc.Channel:
        if self._single and address == self._given[0]:
            return _dial(address, self._credentials, self._token)
        options = [*CHANNEL_OPTIONS, *FAILOVER_OPTIONS]
        if self._credentials is not None and self._name is not None and is_ip(split_address(address)[0]):
            # A resolved (or hinted) IP: the certificate names the host name we were given.
            options.append(("grpc.ssl_target_name_override", self._name[0]))
        return _dial(address, self._credentials, self._token, options)

    def _candidates(self) -> list[str]:
        return self._given + [a for a in self._learned if a not in self._given]

    def unhealable(self, exc: grpc.RpcError, address: str, probe_timeout_s: float = 1.0) -> errors.RendezvousError | None:
        """The error that ends a join at once when `exc`, a failed call to replica `address`, will not
        heal by trying again (see transport.unhealable), else None."""
        server_name = self._name[0] if self._name is not None and is_ip(split_address(address)[0]) else ""
        return unhealable(exc, address, self.tls, self._token is not None, server_name, probe_timeout_s)

    def succeeded(self) -> None:
        """The current replica answered: it is the leader, and calls keep going there."""
        with self._lock:
            old, self._leader = self._leader, self._current
        if old and old != self._leader:
            log.warning("rendezvous server: the leader moved from %s to %s", old, self._leader)
        elif not old and self._leader != self._given[0]:
            log.info("rendezvous server: the leader is %s", self._leader)

    def failed(self, exc: grpc.RpcError) -> bool:
        """Moves on after a failed call (see the class); True when the current replica changed."""
        hint = leader_hint(exc)
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        with self._lock:
            old = self._current
            target = ""
            if hint:
                try:
                    target = host_port(*split_address(hint))
                except ValueError:
                    log.debug("rendezvous server %s named a malformed leader address %r", old, hint[:100])
            if target and target != old:
                if target not in self._candidates():
                    self._learned = [*self._learned[-(self.MAX_LEARNED - 1):], target]
                why = f"is not the leader; the leader is {target}"
            else:
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return False
                candidates = self._candidates()
                i = candidates.index(old) + 1 if old in candidates else 0
                if i >= len(candidates):  # a round without an answer
                    i = 0
                    if self._name is not None:
                        self._given = _resolve(*self._name) or self._given
                        candidates = self._candidates()
                target = candidates[i]
                if target == old:
                    return False
                why = f"failed ({code.name}); trying {target}"
            self._current = target
        log.debug("rendezvous server %s %s", old, why)
        return True

    def call(self, method: str, request: Any, timeout_s: float, hops: int | None = None) -> Any:
        """Calls unary Rendezvous `method` on the leader: starting at the current
        replica, it follows up to `hops` hints or failovers (default: as many as
        there are replicas, at least 2), all within `timeout_s`.

        Raises:
            grpc.RpcError: the last replica's error.
        """
        deadline = time.monotonic() + timeout_s
        hops = max(2, len(self.candidates)) if hops is None else hops
        for hop in range(hops + 1):
            try:
                reply = getattr(self.stub, method)(request, timeout=max(0.001, deadline - time.monotonic()))
            except grpc.RpcError as exc:
                if hop == hops or time.monotonic() >= deadline or not self.failed(exc):
                    raise
                continue
            self.succeeded()
            return reply
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Closes every channel. Idempotent."""
        with self._lock:
            self._closed = True
            channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            channel.close()


class LeaderStub:
    """The unary Rendezvous calls, each sent to the leader (see Endpoints.call)."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints

    def KeepAlive(self, request: pb.KeepAliveRequest, timeout: float) -> pb.KeepAliveResponse:
        return self.endpoints.call("KeepAlive", request, timeout)

    def Leave(self, request: pb.LeaveRequest, timeout: float) -> pb.LeaveResponse:
        return self.endpoints.call("Leave", request, timeout)

    def DescribeJob(self, request: pb.DescribeJobRequest, timeout: float) -> pb.JobDescription:
        return self.endpoints.call("DescribeJob", request, timeout)

    def ListJobs(self, request: pb.ListJobsRequest, timeout: float) -> pb.ListJobsResponse:
        return self.endpoints.call("ListJobs", request, timeout)

    def ListEvents(self, request: pb.ListEventsRequest, timeout: float) -> pb.ListEventsResponse:
        return self.endpoints.call("ListEvents", request, timeout)
