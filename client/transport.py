"""The channel to the rendezvous server, and gRPC errors -> commctx errors.

This is the only module that turns grpc.RpcError into commctx exceptions.
The server names its error in the standard rich status details (a
google.rpc.ErrorInfo whose reason is a commctx.v1.ErrorReason name); without
details (the call failed before the server answered) the status code decides.
"""

from __future__ import annotations

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


def open_channel(server_addr: str) -> tuple[grpc.Channel, pb_grpc.RendezvousStub]:
    """A channel and stub for `server_addr` ('host:port'; the port defaults to 50051).

    Raises:
        ValueError: the address is not host:port.
    """
    channel = grpc.insecure_channel(
        host_port(*split_address(server_addr)),
        options=[
            # Notice a dead connection while a Join waits, without flooding a live one.
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ],
    )
    return channel, pb_grpc.RendezvousStub(channel)
