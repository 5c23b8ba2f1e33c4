"""Failed gRPC calls -> commctx errors: the only module that makes one from a grpc.RpcError.

The server names its error in the standard rich status details (a
google.rpc.ErrorInfo whose reason is a commctx.v1.ErrorReason name); without
details (the call failed before the server answered) the status code decides.
`unhealable` tells, from a failed call, a mistake that trying again will not
heal (TLS that does not match the server's, the HTTP or health port given as
the address, a token refused) from what may heal (refused, no answer);
`why_unreachable` says why an address gives no answer.
"""

from __future__ import annotations

import re
import socket
import ssl

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from commctx.v1 import rendezvous_pb2 as pb

from . import errors
from .addresses import is_ip, split_address
from .credentials import Tls

DOMAIN = "commctx"
# The ErrorReason name of a replica that is not the leader. Matched as text: the
# generated enum of an older checkout may not have it.
NOT_LEADER = "NOT_LEADER"

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
    pb.ErrorReason.Name(pb.JOB_CLOSED): errors.JobClosed,
    pb.ErrorReason.Name(pb.RANK_TAKEN): errors.RankTaken,
    pb.ErrorReason.Name(pb.JOB_FULL): errors.JobFull,
    pb.ErrorReason.Name(pb.MEMBER_NOT_FOUND): errors.MemberNotFound,
    pb.ErrorReason.Name(pb.RENDEZVOUS_TIMEOUT): errors.RendezvousTimeout,
    pb.ErrorReason.Name(pb.SERVER_UNAVAILABLE): errors.ServerUnavailable,
    pb.ErrorReason.Name(pb.UNAUTHENTICATED_CALLER): errors.Unauthenticated,
    pb.ErrorReason.Name(pb.JOB_SEALED): errors.PermissionDenied,
    pb.ErrorReason.Name(pb.SERVER_FULL): errors.ServerFull,
    NOT_LEADER: errors.ServerUnavailable,
    # The client's own reason (no server sends it): see unhealable. Carried like a
    # server's, so that a host's hub passes the error on to its workers as it is.
    "CONNECTION_MISMATCH": errors.ConnectionMismatch,
}
CONNECTION_MISMATCH = "CONNECTION_MISMATCH"


def error_info(exc: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The commctx ErrorInfo in a failed call's status details, if the server sent one."""
    try:
        status = rpc_status.from_call(exc)
    except (AttributeError, ValueError):  # not a call, or details that do not match the status
        return None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                return info
    return None


def error_reason(exc: grpc.RpcError) -> str:
    """The ErrorInfo reason the server put in a failed call's status details, or ""."""
    info = error_info(exc)
    return info.reason if info is not None else ""


def leader_hint(exc: grpc.RpcError) -> str:
    """The leader's 'host:port' that a replica which is not the leader named, or ""
    (another error, or the replica does not know the leader either)."""
    info = error_info(exc)
    return info.metadata.get("leader", "") if info is not None and info.reason == NOT_LEADER else ""


def error_of(code: str, details: str, reason: str = "") -> errors.RendezvousError:
    """The commctx exception for a status code's name, details and ErrorInfo reason (as error_from_rpc makes them)."""
    status = getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN)
    return (_BY_REASON.get(reason) or _BY_CODE.get(status, errors.RendezvousError))(code, details, reason)


def error_from_rpc(exc: grpc.RpcError) -> errors.RendezvousError:
    """Translates a failed call into the matching commctx exception."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    reason = error_reason(exc)
    cls = _BY_REASON.get(reason) or _BY_CODE.get(code, errors.RendezvousError)
    return cls(code.name, details, reason)


def why_unreachable(address: str, timeout_s: float = 1.0) -> str:
    """Why 'host:port' gives no gRPC answer, as far as one TCP connection can tell
    (e.g. "connection refused")."""
    try:
        host, port = split_address(address)
    except ValueError as exc:
        return str(exc)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except socket.gaierror as exc:
        return f"host {host!r} does not resolve: {exc.strerror or exc}"
    except TimeoutError:
        return f"no TCP answer within {timeout_s:g} s"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
    return "it accepts TCP connections but no gRPC call gets through: check that it is a commctx-server's gRPC port"


# -- failures that trying again will not heal ---------------------------------------------------------
#
# gRPC's C core says why a connection failed only in the status's text (checked
# against real servers with grpcio 1.85, tests/test_fail_fast.py):
#   a TLS client, a plaintext server:  "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL:
#                                       error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: ..."
#   a CA that did not sign it:         "... CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate"
#   a certificate for another name:    "... Hostname Verification Check failed."
#   an HTTP/1 server:                  "Failed parsing HTTP/2 (...) (Trying to connect an http1.x server (HTTP status 400))"
#   a plaintext client, a TLS server,
#   or a client certificate missing
#   or refused (mutual TLS):           "Socket closed": as a server that went away mid-connection would say, so
#                                       one TLS connection of our own (_tls_probe) tells which it is.
# Connection refused, no answer, a name that does not resolve (yet): these heal, and a join retries them.

_SOCKET_CLOSED = re.compile(r"socket closed|connection reset|end of file|unexpected eof|SSL_ERROR_SYSCALL", re.IGNORECASE)
_HTTP1 = re.compile(r"http1\.x server|Failed parsing HTTP/2", re.IGNORECASE)
_VERIFY = re.compile(r"CERTIFICATE_VERIFY_FAILED:?\s*([^:]*)")
_NAME = re.compile(r"Hostname Verification|not in peer certificate|hostname mismatch", re.IGNORECASE)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # and an empty SETTINGS frame
_GRPC_PORT = "set server_addr= or COMMCTX_SERVER to the server's gRPC port (--port, default 50051)"
_CLIENT_CERT = ("tls_cert= and tls_key= (or COMMCTX_TLS_CERT and COMMCTX_TLS_KEY) to a certificate signed by the CA "
                "the server trusts (its --tls-client-ca)")


def _answer(sock: socket.socket) -> bytes | None:
    """What a server answers to the client's half of an HTTP/2 preface: its first bytes, b"" when it
    closes the connection instead, None when it says nothing in time."""
    try:
        sock.sendall(_H2_PREFACE)
        return sock.recv(64)
    except TimeoutError:
        return None
    except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # closed
        return b""
    except ssl.SSLError as exc:  # a TLS alert instead of an answer (a refused client certificate, elsewhere than gRPC)
        return b"" if "CERTIFICATE" in str(exc).upper() or "UNKNOWN_CA" in str(exc).upper() else None
    except OSError:  # reset
        return b""


def _plaintext_probe(address: str, timeout_s: float) -> str:
    """What speaks plaintext at `address`: "http1", "h2" (gRPC's HTTP/2), or "" (cannot tell)."""
    try:
        host, port = split_address(address)
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            data = _answer(sock)
    except OSError:
        return ""
    if data and data.startswith(b"HTTP/"):
        return "http1"
    if data and len(data) >= 9 and data[3] == 4:  # a frame header: type 4 is SETTINGS
        return "h2"
    return ""


def _tls_probe(address: str, tls: Tls | None, server_name: str, timeout_s: float) -> str:
    """One TLS connection to `address` with this client's certificate (none for a plaintext client),
    not checking the server's: "" when no TLS handshake completes, "refused" when it completes but the
    server then closes the connection without a word (it wanted another client certificate, or one),
    "ok" when it answers HTTP/2."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the server's certificate is gRPC's to judge (it did, or said so)
    context.set_alpn_protocols(["h2"])
    try:
        if tls is not None and tls.cert:
            context.load_cert_chain(tls.cert, tls.key)
        host, port = split_address(address)
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=None if is_ip(server_name) else server_name) as sock:
            data = _answer(sock)
    except (OSError, ValueError):  # no TLS there (ssl.SSLError is an OSError), or a file it cannot load
        return ""
    if data == b"":
        return "refused"
    return "ok" if data else ""


def unhealable(exc: grpc.RpcError, address: str, tls: Tls | None, token_sent: bool, server_name: str = "",
               probe_timeout_s: float = 1.0) -> errors.RendezvousError | None:
    """The error that ends a join at once when a failed call to `address` shows a cause that trying
    again will not heal (see the table above), with one line naming the cause and the setting to
    change; None when it may heal (refused, no answer, a name that does not resolve yet, a server
    going away). `tls`: this client's TLS (None: plaintext); `token_sent`: whether it sends a token;
    `server_name`: the name its certificate must bear (default: the address's host).

    A "Socket closed" costs one TLS connection of our own to tell its cause, within `probe_timeout_s`.
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    reason = error_reason(exc)
    where = f"rendezvous server {address}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if token_sent:
            why = ("does not know this client's token (token= or COMMCTX_TOKEN; revoked?): "
                   "pass a token of its --auth-tokens file")
        else:
            why = "requires a token and this client sent none: pass token= or set COMMCTX_TOKEN"
        return errors.Unauthenticated(code.name, f"{where} {why} ({_short(details)})", reason)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        if reason == pb.ErrorReason.Name(pb.JOB_SEALED):
            return errors.PermissionDenied(code.name, f"{details} (job_secret= or COMMCTX_JOB_SECRET)", reason)
        return errors.PermissionDenied(code.name, f"{where} refused the call ({_short(details)}): check token= or "
                                                  f"COMMCTX_TOKEN, and what a proxy in front of it requires", reason)
    if code == grpc.StatusCode.UNIMPLEMENTED and not reason:
        return _mismatch(code, f"{where} serves gRPC but not commctx's Rendezvous service ({_short(details)}): "
                               f"is it the health port (--health-port)? {_GRPC_PORT}")
    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) or reason:
        return None
    host = server_name or split_address(address)[0]
    if _HTTP1.search(details):
        return _mismatch(code, f"{where} answers HTTP/1, not gRPC (is it commctx-server's HTTP port, "
                               f"--http-port?): {_GRPC_PORT}")
    if tls is not None and "WRONG_VERSION_NUMBER" in details:
        kind = _plaintext_probe(address, probe_timeout_s)
        if kind == "http1":
            return _mismatch(code, f"{where} answers plaintext HTTP/1, not TLS nor gRPC (is it commctx-server's "
                                   f"HTTP port, --http-port?): {_GRPC_PORT}")
        said = "it answers plaintext gRPC" if kind == "h2" else "its answer is not TLS"
        return _mismatch(code, f"{where} does not speak TLS ({said}): drop tls_ca= and COMMCTX_TLS_CA to talk "
                               f"plaintext, or start the server with --tls-cert and --tls-key")
    verify = _VERIFY.search(details)
    if tls is not None and verify:
        trusted = f"the CA in tls_ca={tls.ca!r}" if tls.ca else "a CA this system trusts (no tls_ca= given)"
        return _mismatch(code, f"{where}: its TLS certificate is not signed by {trusted} (CERTIFICATE_VERIFY_FAILED: "
                               f"{verify.group(1).strip() or 'no reason given'}): set tls_ca= or COMMCTX_TLS_CA to the "
                               f"PEM file of the CA that signed the server's certificate")
    if tls is not None and _NAME.search(details):
        return _mismatch(code, f"{where}: its TLS certificate does not name {host!r}: set server_addr= or "
                               f"COMMCTX_SERVER to a host name or IP address its certificate names, or reissue "
                               f"it for {host!r}")
    if tls is not None and "handshake failed" in details.lower() and "SSL_ERROR_SSL" in details:
        return _mismatch(code, f"{where}: the TLS handshake failed ({_short(details)}): check tls_ca=, tls_cert= "
                               f"and tls_key= (or COMMCTX_TLS_*) against the server's --tls-cert, --tls-key and "
                               f"--tls-client-ca")
    if not _SOCKET_CLOSED.search(details):
        return None
    probe = _tls_probe(address, tls, host, probe_timeout_s)
    if tls is None and probe:
        extra = f", and {_CLIENT_CERT}: it requires one" if probe == "refused" else ""
        return _mismatch(code, f"{where} speaks TLS and this client does not: set tls_ca= or COMMCTX_TLS_CA to the "
                               f"PEM file of the CA that signed its certificate{extra}")
    if tls is not None and probe == "refused":
        if not tls.cert:
            return _mismatch(code, f"{where} requires a client certificate (mutual TLS) and this client has none: "
                                   f"set {_CLIENT_CERT}")
        return _mismatch(code, f"{where} refused this client's certificate tls_cert={tls.cert!r} (mutual TLS): "
                               f"set {_CLIENT_CERT}")
    return None


def _mismatch(code: grpc.StatusCode, details: str) -> errors.ConnectionMismatch:
    return errors.ConnectionMismatch(code.name, details, CONNECTION_MISMATCH)


def _short(details: str) -> str:
    """gRPC's text without its "failed to connect to all addresses; last error: " preamble, at most 300 characters."""
    text = details.split("last error: ", 1)[-1].strip()
    return text if len(text) <= 300 else text[:297] + "..."
