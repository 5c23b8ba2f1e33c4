"""A server's address as a user gives it ('host:port', a replica list's
entries), parsed and checked; the rules both halves share (host_port,
canonical_ip) are commctx.common.addresses'. Pure: no I/O."""

from __future__ import annotations

import ipaddress
import re

from commctx.common.addresses import DEFAULT_PORT, host_port

from .errors import InvalidArgument

__all__ = ["DEFAULT_PORT", "host_port", "is_ip", "server_addresses", "split_address"]
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
            raise InvalidArgument(f"server address {server_addr[:100]!r} has an empty entry: give host:port, "
                                  f"or the replicas' host:port separated by commas")
        hp = split_address(part)
        if hp not in out:
            out.append(hp)
    return out


def is_ip(host: str) -> bool:
    """Whether `host` is an IP address literal rather than a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _shown(value: str) -> str:
    """repr() of an address, cut to about 100 characters."""
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."
