"""Who this machine is: the default node key (the hostname and this machine's
id, so that two hosts of one name stay two nodes) and the host id a Join
carries with it (so that one key from two machines is refused)."""

from __future__ import annotations

import functools
import hashlib
import socket

MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")  # systemd's, then D-Bus's copy of it
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"  # new at every boot: cloned images share a machine id, never this


def _first_line(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.readline().strip()
    except OSError:
        return ""


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


@functools.cache
def machine_id() -> str:
    """/etc/machine-id (or D-Bus's copy), else the boot id, else ''."""
    for path in MACHINE_ID_FILES:
        if value := _first_line(path):
            return value
    return _first_line(BOOT_ID_FILE)


def default_node_key(hostname: str | None = None) -> str:
    """'<hostname>_<8 hex digits of this machine's id>': the node key of a
    worker that names none. '_' cannot be in a hostname, so the parts stay
    apart; the digest, not the id itself, goes on the wire."""
    hostname = hostname or socket.gethostname()
    ident = machine_id()
    return f"{hostname}_{_digest(ident, 8)}" if ident else hostname


@functools.cache
def host_id() -> str:
    """A digest of this machine's boot id (JoinRequest.host_id): equal for
    every process and container of one kernel, different on every other
    machine, cloned ones included. '' where the kernel does not say."""
    boot = _first_line(BOOT_ID_FILE)
    return _digest(boot, 16) if boot else ""
