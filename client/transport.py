"""The channel to the rendezvous server, and gRPC errors -> commctx errors.

This is the only module that turns grpc.RpcError into commctx exceptions.
"""

from __future__ import annotations

import grpc

from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from . import errors

DEFAULT_PORT = 50051
ERROR_KEY = "commctx-error"

_BY_CODE: dict[grpc.StatusCode, type[errors.RendezvousError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: errors.JobConflict,
    grpc.StatusCode.ALREADY_EXISTS: errors.RankTaken,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.JobFull,
    grpc.StatusCode.NOT_FOUND: errors.MemberNotFound,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.RendezvousTimeout,
    grpc.StatusCode.UNAVAILABLE: errors.ServerUnavailable,
}
# Where one status code carries several meanings, the server names the error.
_BY_NAME: dict[str, type[errors.RendezvousError]] = {"StaleGeneration": errors.StaleGeneration}


def error_from_rpc(exc: grpc.RpcError) -> errors.RendezvousError:
    """Translates a failed call into the matching commctx exception."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    name = ""
    if hasattr(exc, "trailing_metadata"):
        name = dict(exc.trailing_metadata() or ()).get(ERROR_KEY, "")
    cls = _BY_NAME.get(name) or _BY_CODE.get(code, errors.RendezvousError)
    return cls(code.name, details, name)


def split_address(server_addr: str) -> tuple[str, int]:
    """'host:port', '[v6]:port' or 'host' -> (host, port).

    Raises:
        ValueError: the address is empty or its port is not a number in 1..65535.
    """
    addr = server_addr.strip()
    if addr.startswith("dns:///"):
        addr = addr[len("dns:///"):]
    if not addr:
        raise ValueError("server address is empty")
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
    elif addr.count(":") == 1:
        host, port_s = addr.split(":")
    else:
        host, port_s = addr, ""
    try:
        port = int(port_s) if port_s else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"server address {server_addr!r}: port {port_s!r} is not a number") from None
    if not host or not 1 <= port <= 65535:
        raise ValueError(f"server address {server_addr!r} is not host:port with a port in 1..65535")
    return host, port


def open_channel(server_addr: str) -> tuple[grpc.Channel, pb_grpc.RendezvousStub]:
    """A channel and stub for `server_addr` ('host:port'; the port defaults to 50051)."""
    host, port = split_address(server_addr)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    channel = grpc.insecure_channel(
        target,
        options=[
            # Notice a dead connection while a Join waits, without flooding a live one.
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ],
    )
    return channel, pb_grpc.RendezvousStub(channel)
