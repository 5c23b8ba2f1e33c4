"""Addresses, for the client and the server alike: `host:port` text with IPv6
in brackets, and IP literals in canonical form. Pure: no I/O. (Parsing a
server address a user typed is the client's: commctx.addresses.)"""

from __future__ import annotations

import socket

DEFAULT_PORT = 50051


def host_port(host: str, port: int) -> str:
    """'host:port', with an IPv6 literal in brackets ('[::1]:50051')."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def canonical_ip(value: str) -> tuple[str, bool]:
    """The canonical form of an IPv4 or IPv6 literal, and whether it is a loopback address.

    Raises:
        ValueError: `value` is not an IP literal, or is the unspecified address.
    """
    family = socket.AF_INET6 if ":" in value else socket.AF_INET
    try:
        packed = socket.inet_pton(family, value)
    except (OSError, ValueError):
        raise ValueError(f"{value[:64]!r} is not an IP address") from None
    if packed == bytes(len(packed)):
        raise ValueError(f"{value} is unspecified")
    if family == socket.AF_INET:
        return socket.inet_ntop(family, packed), packed[0] == 127
    if packed[:12] == bytes(10) + b"\xff\xff":  # IPv4-mapped
        return socket.inet_ntop(family, packed), packed[12] == 127
    return socket.inet_ntop(family, packed), packed == bytes(15) + b"\x01"
