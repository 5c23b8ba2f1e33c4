"""Which address a worker advertises, which interface carries it, and the
listening socket that becomes the job's TCPStore port if this worker is rank 0."""

from __future__ import annotations

import ipaddress
import socket

import psutil

from .addresses import server_addresses
from .errors import InvalidRequest, ServerUnavailable


def route_source_address(host: str, port: int) -> str:
    """The local address the kernel would use to reach host:port.

    Connecting a UDP socket sends nothing; it only selects a route. This is the
    address peers can reach us on as long as they reach the server the same way.

    Raises:
        OSError: the host does not resolve or no route leads to it.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    last: OSError | None = None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
            except OSError as exc:
                last = exc
                continue
            return s.getsockname()[0]
    raise last or OSError(f"no address for {host!r}")


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds `address`, if any."""
    wanted = ipaddress.ip_address(address)
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(a.address.split("%")[0]) == wanted:
                        return name
                except ValueError:
                    continue
    return None


def listen_socket(address: str) -> socket.socket:
    """A TCP socket listening on an OS-chosen port of `address`.

    The port stays held until the socket is handed to torch's TCPStore (rank 0)
    or closed, so no other process can take it in between.
    """
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def listen_on(address: str) -> socket.socket:
    try:
        return listen_socket(address)
    except OSError:  # an address that is not on a local interface (NAT): listen everywhere
        return listen_socket("::" if ":" in address else "0.0.0.0")


def advertised_address(server_addr: str, advertise_addr: str | None, timeout_s: float = 0.0) -> str:
    """The IP this worker (or agent) gives peers: `advertise_addr`, else the
    local address of its route to the (first) server. A server's name that
    does not resolve yet (or a host without a route yet) is waited for up to
    `timeout_s` (session.route_source: with the join's warnings).

    Raises:
        InvalidRequest: `advertise_addr` is not an IP address.
        InvalidArgument: `server_addr` is not host:port (addresses.server_addresses).
        ServerUnavailable: the server's host does not resolve or has no route (within `timeout_s`).
    """
    if advertise_addr:
        try:
            return str(ipaddress.ip_address(advertise_addr))
        except ValueError:
            raise InvalidRequest("INVALID_ARGUMENT", f"advertise address {advertise_addr!r} is not an IP address") from None
    host, port = server_addresses(server_addr)[0]  # of several replicas, the route to the first
    try:
        return str(ipaddress.ip_address(route_source_address(host, port)))
    except OSError as exc:  # e.g. a host name that does not resolve (yet)
        if timeout_s > 0:
            from .session import route_source  # (the join's waiting and warnings; session needs this module)

            return str(ipaddress.ip_address(route_source(server_addr, host, port, timeout_s)))
        raise ServerUnavailable("UNAVAILABLE", f"cannot reach rendezvous server {server_addr}: host {host!r}: "
                                f"{exc.strerror or exc}") from None
