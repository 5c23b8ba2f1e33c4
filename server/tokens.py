"""Who may call: bearer tokens from a file, with the role each grants.

With `--auth-tokens FILE`, every call except grpc.health.v1 needs
`authorization: Bearer <token>` naming a token of the file (the gRPC edge:
rpc/auth.py; the HTTP edge's JSON API: web/). The file holds one token per
line, optionally followed by the word `admin` (an operator); blank lines and
lines starting with `#` are skipped. Only SHA-256 digests of the tokens are
kept, and no token is ever logged or echoed in an error. The file is re-read
on SIGHUP (server/main.py); a file that no longer parses leaves the tokens as
they were. Both edges read it, so it lives below them.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Sequence
from typing import Any

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
