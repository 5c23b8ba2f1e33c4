"""What a client shows the rendezvous server: TLS files and a bearer token, checked."""

from __future__ import annotations

import collections
import dataclasses

import grpc

from . import errors


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
