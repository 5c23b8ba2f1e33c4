"""The channel to the rendezvous server, and gRPC errors -> commctx errors.

This is the only module that turns grpc.RpcError into commctx exceptions.
The server names its error in the standard rich status details (a
google.rpc.ErrorInfo whose reason is a commctx.v1.ErrorReason name); without
details (the call failed before the server answered) the status code decides.
"""

from __future__ import annotations

import collections
import dataclasses

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from . import errors
from .addresses import host_port, split_address

DOMAIN = "commctx"

_BY_CODE: dict[grpc.StatusCode, type[errors.RendezvousError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: errors.JobConflict,
    grpc.StatusCode.ALREADY_EXISTS: errors.RankTaken,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.JobFull,
    grpc.StatusCode.NOT_FOUND: errors.MemberNotFound,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.RendezvousTimeout,
    grpc.StatusCode.UNAVAILABLE: errors.ServerUnavailable,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
}
_BY_REASON: dict[str, type[errors.RendezvousError]] = {
    pb.ErrorReason.Name(pb.INVALID_REQUEST): errors.InvalidRequest,
    pb.ErrorReason.Name(pb.JOB_CONFLICT): errors.JobConflict,
    pb.ErrorReason.Name(pb.STALE_GENERATION): errors.StaleGeneration,
    pb.ErrorReason.Name(pb.RANK_TAKEN): errors.RankTaken,
    pb.ErrorReason.Name(pb.JOB_FULL): errors.JobFull,
    pb.ErrorReason.Name(pb.MEMBER_NOT_FOUND): errors.MemberNotFound,
    pb.ErrorReason.Name(pb.RENDEZVOUS_TIMEOUT): errors.RendezvousTimeout,
    pb.ErrorReason.Name(pb.SERVER_UNAVAILABLE): errors.ServerUnavailable,
    pb.ErrorReason.Name(pb.UNAUTHENTICATED_CALLER): errors.Unauthenticated,
    pb.ErrorReason.Name(pb.JOB_SEALED): errors.PermissionDenied,
    pb.ErrorReason.Name(pb.SERVER_FULL): errors.ServerFull,
}


def error_reason(exc: grpc.RpcError) -> str:
    """The ErrorInfo reason the server put in a failed call's status details, or ""."""
    try:
        status = rpc_status.from_call(exc)
    except (AttributeError, ValueError):  # not a call, or details that do not match the status
        return ""
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                return info.reason
    return ""


def error_from_rpc(exc: grpc.RpcError) -> errors.RendezvousError:
    """Translates a failed call into the matching commctx exception."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    reason = error_reason(exc)
    cls = _BY_REASON.get(reason) or _BY_CODE.get(code, errors.RendezvousError)
    return cls(code.name, details, reason)


@dataclasses.dataclass(frozen=True)
class Tls:
    """TLS to the rendezvous server: PEM files of the CA that signed the
    server's certificate (None: the system's roots) and, for mutual TLS, this
    client's certificate chain and key."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise errors.CommContextError(
                f"a TLS client certificate needs its key and the key its certificate (got tls_cert={self.cert!r}, tls_key={self.key!r})")

    def credentials(self) -> grpc.ChannelCredentials:
        """Raises:
            CommContextError: a file cannot be read (the message names it).
        """
        return grpc.ssl_channel_credentials(_read(self.ca, "tls_ca"), _read(self.key, "tls_key"), _read(self.cert, "tls_cert"))


def tls_of(ca: str | None, cert: str | None, key: str | None,
           env_ca: str | None = None, env_cert: str | None = None, env_key: str | None = None) -> Tls | None:
    """The Tls the arguments ask for, or None (plaintext) when none is given.

    The COMMCTX_TLS_* values (env_*) fill in only what the arguments leave
    open, and the certificate and key only once a CA is known: inside the
    server's own container COMMCTX_TLS_CERT/KEY are the server's files, and
    must not turn a plaintext health probe there into a TLS client.
    """
    ca = ca or env_ca or None
    if ca:
        cert, key = cert or env_cert, key or env_key
    return Tls(ca, cert or None, key or None) if (ca or cert or key) else None


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise errors.CommContextError(f"cannot read {what} {path!r}: {exc.strerror}") from None


CHANNEL_OPTIONS = [
    # Notice a dead connection while a Join waits, without flooding a live one.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str) -> None:
        if not token or not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
            raise errors.CommContextError("a token is printable ASCII without spaces (check token= or COMMCTX_TOKEN)")
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._header], d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def channel_to(target: str, tls: Tls | None = None, token: str | None = None) -> grpc.Channel:
    """A channel to `target`, over TLS when `tls` is given, sending `token` on every call when given.

    Raises:
        CommContextError: a TLS file cannot be read, or the token is not printable ASCII.
    """
    if tls is None:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.secure_channel(target, tls.credentials(), options=CHANNEL_OPTIONS)
    return grpc.intercept_channel(channel, BearerToken(token)) if token else channel


def open_channel(server_addr: str, tls: Tls | None = None, token: str | None = None) -> tuple[grpc.Channel, pb_grpc.RendezvousStub]:
    """A channel and stub for `server_addr` ('host:port'; the port defaults to 50051);
    see channel_to.

    Raises:
        ValueError: the address is not host:port.
        CommContextError: as for channel_to.
    """
    channel = channel_to(host_port(*split_address(server_addr)), tls, token)
    return channel, pb_grpc.RendezvousStub(channel)
