"""The channels to the rendezvous server, and gRPC errors -> commctx errors.

This is the only module that turns grpc.RpcError into commctx exceptions.
The server names its error in the standard rich status details (a
google.rpc.ErrorInfo whose reason is a commctx.v1.ErrorReason name); without
details (the call failed before the server answered) the status code decides.
`unhealable` tells, from a failed call, a mistake that trying again will not
heal (TLS that does not match the server's, the HTTP or health port given as
the address, a token refused) from what may heal (refused, no answer).

A highly available server is several replicas, one of them the leader; the
others answer every call UNAVAILABLE with reason NOT_LEADER and the leader's
address (ErrorInfo metadata "leader") when they know it. `Endpoints` holds the
replicas a client knows and which of them leads.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from . import errors
from .addresses import host_port, split_address

log = logging.getLogger("commctx")

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
            raise errors.UsageError(
                f"a TLS client certificate needs its key and the key its certificate (got tls_cert={self.cert!r}, tls_key={self.key!r})")

    def credentials(self) -> grpc.ChannelCredentials:
        """Raises:
            UsageError: a file cannot be read (the message names it).
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
        raise errors.UsageError(f"cannot read {what} {path!r}: {exc.strerror}") from None


CHANNEL_OPTIONS = [
    # Notice a dead connection while a Join waits, without flooding a live one.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
# Channels to one of several replicas: a call there must not wait long for a
# dead one, so each connection attempt is bounded (gRPC's default: 20 s) and a
# replica that comes back is tried again within seconds (default: up to 120 s).
FAILOVER_OPTIONS = [
    ("grpc.min_reconnect_backoff_ms", 2_000),
    ("grpc.max_reconnect_backoff_ms", 3_000),
]


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


MAX_TOKEN_LENGTH = 4096  # gRPC's default limit on all of a call's metadata is 8 KiB


def check_token(token: str, source: str) -> str:
    """Returns `token` if it can be a bearer token: 1-4096 printable ASCII
    characters without spaces. `source` names where it came from ("token=",
    "COMMCTX_TOKEN", "--token").

    Raises:
        InvalidArgument: one line naming `source` and what is wrong, with the
            token's length but never the token itself.
    """
    if not isinstance(token, str):
        raise errors.InvalidArgument(f"{source}: a token is a string, not {type(token).__name__}")
    if not token:
        raise errors.InvalidArgument(f"{source} is empty: give the server's bearer token, or leave it out")
    problem = ("has a space" if any(c.isspace() for c in token) else
               "has a non-ASCII character" if not token.isascii() else
               "has a control character" if not token.isprintable() else
               f"is longer than {MAX_TOKEN_LENGTH}" if len(token) > MAX_TOKEN_LENGTH else "")
    if problem:
        length = f"{len(token)} character{'s' * (len(token) != 1)}"
        raise errors.InvalidArgument(f"{source} is not a usable token ({length}; it {problem}): "
                                     f"a token is printable ASCII without spaces, at most {MAX_TOKEN_LENGTH} characters")
    return token


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str) -> None:
        """Raises:
            InvalidArgument: the token is malformed (see check_token).
        """
        self._header = ("authorization", f"Bearer {check_token(token, 'token= or COMMCTX_TOKEN')}")

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


def server_addresses(server_addr: str) -> list[tuple[str, int]]:
    """(host, port) of each entry of 'host:port' or a comma-separated list of
    them (see split_address), without repeats.

    Raises:
        InvalidArgument (a ValueError): an entry is not host:port (empty, a
            URL, a port out of range); the message names it.
    """
    if not isinstance(server_addr, str):
        return [split_address(server_addr)]  # which says what it wants
    out: list[tuple[str, int]] = []
    parts = server_addr.split(",")
    for part in parts:
        if len(parts) > 1 and not part.strip():
            raise errors.InvalidArgument(f"server address {server_addr[:100]!r} has an empty entry: give host:port, "
                                         f"or the replicas' host:port separated by commas")
        hp = split_address(part)
        if hp not in out:
            out.append(hp)
    return out


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


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
                context.wrap_socket(raw, server_hostname=None if _is_ip(server_name) else server_name) as sock:
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
        if len(given) == 1 and not _is_ip(given[0][0]):
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
        if self._credentials is not None and self._name is not None and _is_ip(split_address(address)[0]):
            # A resolved (or hinted) IP: the certificate names the host name we were given.
            options.append(("grpc.ssl_target_name_override", self._name[0]))
        return _dial(address, self._credentials, self._token, options)

    def _candidates(self) -> list[str]:
        return self._given + [a for a in self._learned if a not in self._given]

    def unhealable(self, exc: grpc.RpcError, address: str, probe_timeout_s: float = 1.0) -> errors.RendezvousError | None:
        """The error that ends a join at once when `exc`, a failed call to replica `address`, will not
        heal by trying again (see the module's unhealable), else None."""
        server_name = self._name[0] if self._name is not None and _is_ip(split_address(address)[0]) else ""
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
