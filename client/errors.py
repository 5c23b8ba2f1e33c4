"""Every error commctx raises, in one hierarchy.

Server answers become `RendezvousError` subclasses in one place
(`commctx.transport.error_from_rpc`); local misuse raises `UsageError`,
and an argument that cannot be right (a backend torch does not know, a
timeout of -1, a server address with a URL scheme) its subclass
`InvalidArgument`, at the call, before any wait or network call.
"""

from __future__ import annotations


class CommCtxError(Exception):
    """Base class of every commctx error."""


class UsageError(CommCtxError):
    """CommContext was used in a way its state does not allow (not initialised,
    already initialised, a value it cannot know)."""


# UsageError's other name, kept for code that catches it by that name.
CommContextError = UsageError


class InvalidArgument(UsageError, ValueError):
    """An argument (or the variable standing for it) cannot be right: a backend
    torch does not know, a world size or timeout that is not positive, a server
    address that is not host:port, a malformed token or job secret. Raised at
    the call, before any wait or network call; the one-line message names the
    argument and says what is expected (never a secret's value). Also a
    ValueError, so that code catching a ValueError for a bad value catches it."""


class GroupNotFound(UsageError, KeyError):
    """No group is registered for a mode on this rank (also a KeyError, as in the seed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class WorldChanged(CommCtxError, RuntimeError):
    """A collective of this worker's world failed because the world changed: a
    member of it is gone (crashed, hung, or left) or the next world formed.
    Raised by commctx.elastic's guard in place of torch's error (kept as
    __cause__), so that a training loop can tell a world change from a bug;
    `rejoin()` (or `Elastic.recover()`) moves the worker on. Also a
    RuntimeError, as torch's collective errors are.

    Attributes:
        change: the commctx.session.WorldChange the server announced
            (generation replaced, reason, whether it is final).
    """

    def __init__(self, change: object) -> None:
        generation, reason = getattr(change, "generation", "?"), getattr(change, "reason", "")
        final = " (final: the job cannot go on for this worker)" if getattr(change, "final", False) else ""
        super().__init__(f"the world of generation {generation} changed{final}: {reason}")
        self.change = change


class RendezvousError(CommCtxError):
    """The rendezvous server refused or could not serve a request.

    Attributes:
        code: the gRPC status code name, e.g. "FAILED_PRECONDITION".
        details: the server's message.
        reason: the server's reason for the error, a commctx.v1.ErrorReason
            name (e.g. "RENDEZVOUS_TIMEOUT"), or "" when the call failed before
            the server answered.
    """

    def __init__(self, code: str, details: str, reason: str = "") -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details
        self.reason = reason


class InvalidRequest(RendezvousError, ValueError):
    """INVALID_ARGUMENT: a request field is malformed; the message names it.

    Also raised before any call for a `spec=` dict that is not a JobSpec (an
    unknown key, a wrong type); a ValueError too.
    """


class JobConflict(RendezvousError):
    """FAILED_PRECONDITION: the request disagrees with the job (world size, node
    rank, address family) or the job cannot form."""


class JobClosed(JobConflict):
    """FAILED_PRECONDITION: the job was closed (a launcher shut the run down, as
    torchrun's rendezvous shutdown does); it takes no more joins."""


class StaleGeneration(JobConflict):
    """FAILED_PRECONDITION: the caller holds a generation that is no longer current."""


class RankTaken(RendezvousError):
    """ALREADY_EXISTS: another worker holds that local rank or node rank."""


class JobFull(RendezvousError):
    """RESOURCE_EXHAUSTED: the job already has all its workers."""


class MemberNotFound(RendezvousError):
    """NOT_FOUND: unknown job or member (left, expired or never joined)."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """DEADLINE_EXCEEDED: the world did not form in time; the message says who is missing."""


class ServerUnavailable(RendezvousError):
    """UNAVAILABLE: the server cannot be reached or is shutting down."""


class ConnectionMismatch(ServerUnavailable):
    """The address answers, but not as this client's settings expect, and
    trying again will not change that: a TLS handshake failed (a plaintext
    client and a TLS server or the reverse, a server certificate that tls_ca=
    does not trust or that does not name the host dialled, a client
    certificate missing or refused under mutual TLS), the address is an HTTP/1
    server (commctx-server's HTTP port, say) rather than its gRPC port, or a
    gRPC server without commctx's Rendezvous service (its health port, say).
    A join raises it at its first try, not at its timeout; the one-line message
    names the cause and the setting to change (tls_ca=, tls_cert=, server_addr=
    or their COMMCTX_* variables). `code` is the call's status ("UNAVAILABLE",
    or "UNIMPLEMENTED" for another gRPC service) and `reason`
    "CONNECTION_MISMATCH", the client's own (no server sent it). A
    ServerUnavailable, so that code catching an unreachable server catches it too."""


class ServerFull(RendezvousError):
    """RESOURCE_EXHAUSTED: the server holds as many jobs or members as its limits allow (the message names the limit)."""


class PermissionDenied(RendezvousError):
    """PERMISSION_DENIED: the job is sealed and this call's job secret (job_secret= or COMMCTX_JOB_SECRET) is missing or wrong."""


class Unauthenticated(RendezvousError):
    """UNAUTHENTICATED: the server requires a token (token= or COMMCTX_TOKEN) and got none it knows."""
