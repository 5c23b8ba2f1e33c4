"""The host link's socket: where it lives (a per-user directory, a name per
server, job and node key) and what goes over it (length-prefixed JSON frames,
a listening socket's descriptor passed alongside)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import socket
import struct

from commctx.v1 import rendezvous_pb2 as pb

from .errors import UsageError

_HEADER = struct.Struct("!I")
_MAX_FRAME = 1 << 24  # an event carries a host's assignments (8 workers' groups): far less than this
_SUN_PATH_MAX = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path, less its NUL)
_NAME_LEN = len("/commctx/") + 24 + len(".sock")


def runtime_dir() -> pathlib.Path:
    """This user's directory for host links: $XDG_RUNTIME_DIR/commctx, else (or
    where that is too long a path for a Unix socket) /tmp/commctx-<uid>; made
    with mode 0700, and refused if another user owns it or others may enter it.

    Raises:
        UsageError: the directory cannot be made, or is not this user's alone.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = pathlib.Path(f"/tmp/commctx-{os.getuid()}")
    if base and os.path.isdir(base) and len(os.fsencode(base)) + _NAME_LEN <= _SUN_PATH_MAX:
        path = pathlib.Path(base) / "commctx"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.stat()
    except OSError as exc:
        raise UsageError(f"cannot make the host link directory {path}: {exc.strerror or exc}") from None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UsageError(f"the host link directory {path} is not this user's alone (owner uid {st.st_uid}, mode "
                         f"{st.st_mode & 0o777:o}); remove it, or pass share_host=False")
    return path


def link_paths(server_addr: str, job_id: str, node_key: str) -> tuple[str, str]:
    """The host link's socket and lock file for this server, job and node key."""
    name = hashlib.sha256(f"{server_addr}\0{job_id}\0{node_key}".encode()).hexdigest()[:24]
    base = runtime_dir()
    return str(base / f"{name}.sock"), str(base / f"{name}.lock")



def send(sock: socket.socket, message: dict, fd: int | None = None) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    frame = _HEADER.pack(len(data)) + data
    if fd is None:
        sock.sendall(frame)
    else:
        sent = socket.send_fds(sock, [frame], [fd])
        if sent < len(frame):
            sock.sendall(frame[sent:])


class Reader:
    """Frames from a stream socket, and the descriptors that came with them, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""
        self._fds: list[int] = []

    def read(self) -> tuple[dict, int | None] | None:
        """The next message and, if it carries one (`"fd": true`), its descriptor; None at EOF."""
        while True:
            if len(self._buffer) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self._buffer)
                if size > _MAX_FRAME:
                    return None  # not one of ours: the link ends, as at EOF
                if len(self._buffer) >= _HEADER.size + size:
                    try:
                        message = json.loads(self._buffer[_HEADER.size:_HEADER.size + size])
                    except ValueError:
                        return None
                    if not isinstance(message, dict):
                        return None
                    self._buffer = self._buffer[_HEADER.size + size:]
                    return message, (self._fds.pop(0) if message.get("fd") and self._fds else None)
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, 1 << 16, 4)
            except OSError:
                return None
            if not data:
                return None
            self._buffer += data
            self._fds += fds


def event_b64(event: pb.SessionEvent) -> str:
    return base64.b64encode(event.SerializeToString()).decode()


def event_of(text: str) -> pb.SessionEvent:
    return pb.SessionEvent.FromString(base64.b64decode(text))
