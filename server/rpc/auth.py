"""Callers: bearer tokens from a file, checked by a server interceptor.

With `--auth-tokens FILE`, every call except grpc.health.v1 needs
`authorization: Bearer <token>` metadata naming a token of the file; any other
call is answered UNAUTHENTICATED before it reaches a servicer (reflection
included). The file holds one token per line, optionally followed by the word
`admin` (an operator); blank lines and lines starting with `#` are skipped.
Only SHA-256 digests of the tokens are kept, and no token is ever logged or
echoed in an error. The file is re-read on SIGHUP (server/main.py); a file
that no longer parses leaves the tokens as they were.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from ..errors import UnknownToken
from ..rendezvous.shares import TOKEN, Caller
from . import codec

HEALTH_PREFIX = "/grpc.health.v1.Health/"
USER, ADMIN = "user", "admin"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Callers:
    """The tokens of a file, by digest, with the role each grants."""

    def __init__(self, path: str | pathlib.Path) -> None:
        """Raises:
            OSError: the file cannot be read (the message names it).
            ValueError: a line is not `TOKEN [admin]` (the message names the line, not its text).
        """
        self.path = str(path)
        self._roles = self._read()

    def __len__(self) -> int:
        return len(self._roles)

    def reload(self) -> None:
        """Re-reads the file; on any error the tokens stay as they were.

        Raises:
            OSError, ValueError: as for the constructor.
        """
        self._roles = self._read()

    def role(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """USER or ADMIN for the call's bearer token, or None."""
        return self.lookup(metadata)[1]

    def lookup(self, metadata: Sequence[tuple[str, Any]] | None) -> tuple[bytes, str | None]:
        """The digest of the call's bearer token (b"": none) and the role it grants (None: unknown)."""
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer" and token:
                    digest = _digest(token.strip())
                    return digest, self._roles.get(digest)
        return b"", None

    def knows(self, digest: bytes | str) -> bool:
        """Whether the token of this digest (bytes, or hex) is in the file (as last read)."""
        try:
            return (bytes.fromhex(digest) if isinstance(digest, str) else digest) in self._roles
        except ValueError:
            return False

    def _read(self) -> dict[bytes, str]:
        try:
            text = pathlib.Path(self.path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise OSError(f"cannot read --auth-tokens {self.path}: {getattr(exc, 'strerror', None) or exc}") from None
        roles: dict[bytes, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if len(words) > 2 or (len(words) == 2 and words[1] != ADMIN) or not words[0].isprintable():
                raise ValueError(f"--auth-tokens {self.path} line {number}: expected a token, optionally followed by 'admin'")
            roles[_digest(words[0])] = ADMIN if len(words) == 2 else USER
        if not roles:
            raise ValueError(f"--auth-tokens {self.path} holds no token: no caller could get in")
        return roles


def caller_of(context: grpc.aio.ServicerContext, callers: Callers | None) -> Caller:
    """Who a call comes from, for fair shares: its token (with --auth-tokens; an
    admin one is exempt), else its client certificate's identity (the first
    subject alternative name, else the common name), else its peer's IP."""
    if callers is not None:
        digest, role = callers.lookup(context.invocation_metadata())
        if digest:
            return Caller(TOKEN + digest.hex(), "this token", role == ADMIN)
    auth = context.auth_context() or {}
    for field in ("x509_subject_alternative_name", "x509_common_name"):
        names = auth.get(field)
        if names:
            name = names[0].decode("utf-8", "replace")[:128]
            return Caller("cert:" + name, f"client certificate {name!r}")
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    ip = rest.rsplit(":", 1)[0].strip("[]") if kind in ("ipv4", "ipv6") else peer
    return Caller("peer:" + ip, f"peer {ip[:64]}")


def is_admin(context: grpc.aio.ServicerContext, callers: Callers | None) -> bool:
    """Whether the call carries an admin token."""
    return callers is not None and callers.role(context.invocation_metadata()) == ADMIN


def secret_of(context: grpc.aio.ServicerContext, callers: Callers | None, job_secret: str) -> str | None:
    """The job secret a call opens sealed jobs with; None (not checked) for an admin token."""
    return None if is_admin(context, callers) else job_secret


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to calls without a known token (health excepted)."""

    def __init__(self, callers: Callers, rpc_error: Callable[[str, str], None] = lambda method, code: None) -> None:
        self._callers = callers
        self._rpc_error = rpc_error

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX) or self._callers.role(details.invocation_metadata):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        status = codec.error_status(UnknownToken(
            f"{details.method} needs an 'authorization: Bearer <token>' header with a token this server knows"))

        async def deny(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
            self._rpc_error(method, status.code.name)
            codec.answer_error(context, status)

        kinds = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }
        make = kinds[(handler.request_streaming, handler.response_streaming)]
        return make(deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
