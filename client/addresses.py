"""Addresses, for the client and the server alike: `host:port` text with IPv6
in brackets, and IP literals in canonical form. Pure: no I/O."""

from __future__ import annotations

import re
import socket

from .errors import InvalidArgument

DEFAULT_PORT = 50051
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # 'http://', 'grpc://', ...: a URL, not host:port


def host_port(host: str, port: int) -> str:
    """'host:port', with an IPv6 literal in brackets ('[::1]:50051')."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(server_addr: str) -> tuple[str, int]:
    """'host:port', '[v6]:port' or 'host' -> (host, port).

    gRPC's own 'dns:///host:port' is accepted too; any other scheme
    ('http://', 'grpc://', 'https://') is refused.

    Raises:
        InvalidArgument (a ValueError): the address is empty, has a URL
            scheme, or its port is not a number in 1..65535.
    """
    if not isinstance(server_addr, str):
        raise InvalidArgument(f"server address must be a 'host:port' string, not {type(server_addr).__name__}")
    addr = server_addr.strip()
    if addr.startswith("dns:///"):
        addr = addr[len("dns:///"):]
    if not addr:
        raise InvalidArgument("server address is empty: give host:port (e.g. 127.0.0.1:50051)")
    scheme = _SCHEME.match(addr)
    if scheme:
        raise InvalidArgument(f"server address {_shown(server_addr)} has a URL scheme: drop {scheme.group(0)!r} and give host:port")
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
    elif addr.count(":") == 1:
        host, port_s = addr.split(":")
    else:
        host, port_s = addr, ""
    if port_s and not (port_s.isascii() and port_s.isdigit()):
        raise InvalidArgument(f"server address {_shown(server_addr)}: port {port_s[:20]!r} is not a number; "
                              f"give host:port with a port in 1..65535")
    port = int(port_s) if port_s else DEFAULT_PORT
    if not host:
        raise InvalidArgument(f"server address {_shown(server_addr)} has no host: give host:port")
    if not 1 <= port <= 65535:
        raise InvalidArgument(f"server address {_shown(server_addr)}: port {port} is out of range; give host:port "
                              f"with a port in 1..65535")
    return host, port


def _shown(value: str) -> str:
    """repr() of an address, cut to about 100 characters."""
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


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
