"""Callers at the gRPC edge: the interceptor that answers UNAUTHENTICATED to
a call without a token of the `--auth-tokens` file (server/tokens.py; health
excepted, reflection included), and who a call comes from, for fair shares."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from ..errors import UnknownToken
from ..rendezvous.shares import TOKEN, Caller
from ..tokens import ADMIN, Callers
from .status import answer_error, error_status

HEALTH_PREFIX = "/grpc.health.v1.Health/"


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
        status = error_status(UnknownToken(
            f"{details.method} needs an 'authorization: Bearer <token>' header with a token this server knows"))

        async def deny(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
            self._rpc_error(method, status.code.name)
            answer_error(context, status)

        kinds = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }
        make = kinds[(handler.request_streaming, handler.response_streaming)]
        return make(deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
