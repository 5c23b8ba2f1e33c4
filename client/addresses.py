"""A server's address as a user gives it ('host:port', a replica list's
entries), parsed and checked; the rules both halves share (host_port,
canonical_ip) are commctx.common.addresses'. Pure: no I/O."""

from __future__ import annotations

import re

from commctx.common.addresses import DEFAULT_PORT, host_port

from .errors import InvalidArgument

__all__ = ["DEFAULT_PORT", "host_port", "split_address"]
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # 'http://', 'grpc://', ...: a URL, not host:port


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
