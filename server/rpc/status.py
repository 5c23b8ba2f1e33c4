"""Domain errors to gRPC status, at the RPC edge: the one table from refusals
to status codes and google.rpc.ErrorInfo reasons, and how a call answers with
a status. Every error leaves a call through here (never as UNKNOWN)."""

from __future__ import annotations

import logging

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from commctx.v1 import rendezvous_pb2 as pb

from ..errors import (
    AlreadyExists,
    BadRequest,
    Closed,
    Conflict,
    Full,
    LimitExceeded,
    NotFound,
    NotLeader,
    Refusal,
    Sealed,
    SessionReplaced,
    Stale,
    Unavailable,
    UnknownToken,
    WaitTimeout,
)

log = logging.getLogger("commctx.server")

DOMAIN = "commctx"
MAX_DETAILS = 1024  # error texts stay far below gRPC's metadata limit

# The one table from domain errors to status codes and ErrorInfo reasons.
STATUS_OF: dict[type[Refusal], tuple[grpc.StatusCode, int]] = {
    BadRequest: (grpc.StatusCode.INVALID_ARGUMENT, pb.INVALID_REQUEST),
    Conflict: (grpc.StatusCode.FAILED_PRECONDITION, pb.JOB_CONFLICT),
    Stale: (grpc.StatusCode.FAILED_PRECONDITION, pb.STALE_GENERATION),
    Closed: (grpc.StatusCode.FAILED_PRECONDITION, pb.JOB_CLOSED),
    AlreadyExists: (grpc.StatusCode.ALREADY_EXISTS, pb.RANK_TAKEN),
    Full: (grpc.StatusCode.RESOURCE_EXHAUSTED, pb.JOB_FULL),
    NotFound: (grpc.StatusCode.NOT_FOUND, pb.MEMBER_NOT_FOUND),
    WaitTimeout: (grpc.StatusCode.DEADLINE_EXCEEDED, pb.RENDEZVOUS_TIMEOUT),
    Unavailable: (grpc.StatusCode.UNAVAILABLE, pb.SERVER_UNAVAILABLE),
    NotLeader: (grpc.StatusCode.UNAVAILABLE, pb.NOT_LEADER),
    UnknownToken: (grpc.StatusCode.UNAUTHENTICATED, pb.UNAUTHENTICATED_CALLER),
    Sealed: (grpc.StatusCode.PERMISSION_DENIED, pb.JOB_SEALED),
    LimitExceeded: (grpc.StatusCode.RESOURCE_EXHAUSTED, pb.SERVER_FULL),
    SessionReplaced: (grpc.StatusCode.ABORTED, pb.SESSION_REPLACED),
}


def error_status(exc: BaseException) -> grpc.Status:
    """The status a failed call answers with: code, bounded message, ErrorInfo details."""
    if isinstance(exc, Refusal):
        code, reason = STATUS_OF[type(exc)]
        message = str(exc)
    else:
        log.error("internal error", exc_info=exc)
        code, reason, message = grpc.StatusCode.INTERNAL, pb.ERROR_REASON_UNSPECIFIED, f"internal error: {type(exc).__name__}"
    if len(message) > MAX_DETAILS:
        message = message[: MAX_DETAILS - 3] + "..."
    detail = any_pb2.Any()
    metadata = {"leader": exc.leader} if isinstance(exc, NotLeader) and exc.leader else {}
    detail.Pack(error_details_pb2.ErrorInfo(reason=pb.ErrorReason.Name(reason), domain=DOMAIN, metadata=metadata))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


def answer_error(context: grpc.aio.ServicerContext, status: grpc.Status) -> None:
    """Makes `status` the call's answer; the handler then returns (None).

    Not `context.abort`: grpc.aio keeps the AbortError it raises on the call's
    state, and its traceback holds the handler frames, which hold the context,
    so every aborted call is a reference cycle. GcPacer's middle passes move the
    cycles of calls in flight into the oldest generation, which it collects
    seldom, so a refusal retried in a loop would grow the server with every
    answer. Set this way, a failed call is freed on return."""
    context.set_code(status.code)
    context.set_details(status.details)
    context.set_trailing_metadata(status.trailing_metadata)
