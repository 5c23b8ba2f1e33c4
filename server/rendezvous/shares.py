"""Fair shares: what one caller may hold of the server's limits.

A caller is who a call comes from, as the RPC edge tells (rpc/auth.py, caller_of): a
bearer token (with --auth-tokens), else the identity of a client certificate
(mutual TLS), else the peer's IP address. Each caller may hold at most
`caller_share` of each server-wide limit (--caller-share, default 1/4): jobs
it created (--max-jobs), Joins waiting (--max-members) and open streams
(Session and WatchEvents, and the HTTP port's event streams: --max-streams).
One caller filling its share leaves three quarters of every limit to the
others. Its Joins waiting also hold at most --max-workers-per-caller workers
together (a node Join counts its workers, up to 1,024: Joins alone would let
one caller wait with 50,000 x 1,024 workers). An admin token is exempt.

Accounting is O(1) per call: a counter per caller and kind, taken when the
call (or job) begins and given back when it ends.
"""

from __future__ import annotations

import collections
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from ..errors import LimitExceeded, Sealed
from .model import Limits
from .params import job_secret_matches

log = logging.getLogger("commctx.server")


class Caller(NamedTuple):
    """Who a call comes from."""

    key: str  # what its shares are counted by: "token:<digest>", "cert:<identity>" or "peer:<ip>"
    shown: str  # how messages name it, never the token: "this token", "client certificate 'x'", "peer 10.0.0.5"
    exempt: bool = False  # an admin token: no shares


SERVER = Caller("", "the server", True)  # the server itself (restored jobs, tests below the RPC edge)

JOBS, WAITING, STREAMS, WORKERS = "jobs", "waiting joins", "open streams", "workers"
_LIMIT = {JOBS: ("max_jobs", "--max-jobs"), WAITING: ("max_members", "--max-members"), STREAMS: ("max_streams", "--max-streams")}


TOKEN = "token:"  # Caller.key of a call with a bearer token: "token:" + the token's SHA-256 digest (hex)


class LiveCalls:
    """The calls in flight of each token caller (Joins waiting, sessions,
    watches), each with how to end it, so that a revoked token's calls end at once."""

    def __init__(self) -> None:
        self._by_key: dict[str, set[Callable[[Exception], object]]] = {}

    def add(self, caller: Caller, end: Callable[[Exception], object]) -> None:
        if caller.key.startswith(TOKEN):
            self._by_key.setdefault(caller.key, set()).add(end)

    def discard(self, caller: Caller, end: Callable[[Exception], object]) -> None:
        ends = self._by_key.get(caller.key)
        if ends is not None:
            ends.discard(end)
            if not ends:
                del self._by_key[caller.key]

    def revoke(self, known: Callable[[str], bool], error: Exception) -> int:
        """Ends, with `error`, every call of a token whose digest (hex) `known` no longer knows; returns how many."""
        ended = 0
        for key in [k for k in self._by_key if not known(k[len(TOKEN):])]:
            for end in self._by_key.pop(key):
                end(error)
                ended += 1
        return ended


class Shares:
    """Per-caller counts of jobs created, Joins waiting and streams open, within
    their caps; and the calls in flight of each token (`live`)."""

    def __init__(self, limits: Limits) -> None:
        self.caps = {kind: max(1, math.floor(getattr(limits, name) * limits.caller_share)) for kind, (name, _) in _LIMIT.items()}
        self.caps[WORKERS] = limits.max_workers_per_caller  # a caller's own, not a share of a server-wide limit
        self._held: dict[str, Counter[str]] = {kind: Counter() for kind in self.caps}
        self._max_streams = limits.max_streams
        self.streams = 0  # open now (Session and WatchEvents), all callers
        self.live = LiveCalls()

    def open_stream(self, caller: Caller, what: str) -> None:
        """Counts one more open stream (`what`: "session streams", "open streams"),
        within --max-streams and the caller's share.

        Raises:
            LimitExceeded: naming the limit, or the caller's share and its use.
        """
        if self.streams >= self._max_streams:
            raise LimitExceeded(f"this server holds its maximum of {self._max_streams} {what} (--max-streams); retry later")
        self.take(STREAMS, caller)
        self.streams += 1

    def close_stream(self, caller: Caller) -> None:
        self.streams -= 1
        self.give(STREAMS, caller)

    def take(self, kind: str, caller: Caller, n: int = 1) -> None:
        """Counts `n` more `kind` for `caller` (WORKERS: the workers of a Join waiting).

        Raises:
            LimitExceeded: the caller would pass its share; the message names
                its cap and use ("this token holds 2,500 of its 2,500 jobs").
        """
        if caller.exempt:
            return
        held, cap = self._held[kind], self.caps[kind]
        if held[caller.key] + n > cap:
            if kind == WORKERS:
                raise LimitExceeded(f"{caller.shown} holds {held[caller.key]:,} workers (waiting or placed, all its jobs); "
                                    f"this Join's {n:,} more would pass its {cap:,} (--max-workers-per-caller); end some, "
                                    f"or retry later")
            name, flag = _LIMIT[kind]
            raise LimitExceeded(f"{caller.shown} holds {held[caller.key]:,} of its {cap:,} {kind} (a caller's "
                                f"share of the server's limit, --caller-share of {flag}); end some, or retry later")
        held[caller.key] += n

    def give(self, kind: str, caller: Caller, n: int = 1) -> None:
        """Gives back `n` `kind` taken for `caller`."""
        if caller.exempt:
            return
        held = self._held[kind]
        held[caller.key] -= n
        if held[caller.key] <= 0:
            del held[caller.key]

    def held(self, kind: str, caller: Caller) -> int:
        return self._held[kind][caller.key]


class Guesses:
    """Wrong job secrets, by caller and job: a caller that gives LIMIT wrong
    ones for a job within WINDOW_S has its calls on that job refused
    (RESOURCE_EXHAUSTED) for BLOCK_S, logged once. O(1) per call; the
    KEPT most recent (caller, job) pairs are remembered."""

    LIMIT, WINDOW_S, BLOCK_S, KEPT = 10, 60.0, 60.0, 10_000

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._by: collections.OrderedDict[tuple[str, str], list[float]] = collections.OrderedDict()  # [count, since, blocked until]

    def check(self, caller: Caller, job_id: str) -> None:
        """Raises LimitExceeded while `caller` is blocked on `job_id`."""
        if caller.exempt:
            return
        entry = self._by.get((caller.key, job_id))
        if entry is not None and entry[2] > (now := self._clock()):
            raise LimitExceeded(f"{caller.shown} gave {self.LIMIT} wrong job secrets for job {job_id!r} within "
                                f"{self.WINDOW_S:g} s: its calls on that job are refused for {entry[2] - now:.0f} s more")

    def failed(self, caller: Caller, job_id: str) -> None:
        """Counts a wrong job secret of `caller` for `job_id`."""
        if caller.exempt:
            return
        now, key = self._clock(), (caller.key, job_id)
        entry = self._by.get(key)
        if entry is None or now - entry[1] > self.WINDOW_S:
            entry = self._by[key] = [0, now, 0.0]
        self._by.move_to_end(key)
        entry[0] += 1
        if entry[0] >= self.LIMIT and entry[2] <= now:
            entry[0], entry[1], entry[2] = 0, now, now + self.BLOCK_S
            log.warning("wrong_job_secrets", extra={"fields": {"caller": caller.shown, "job": job_id, "blocked_s": self.BLOCK_S}})
        while len(self._by) > self.KEPT:
            self._by.popitem(last=False)

    def unseal(self, job_id: str, seal: str, secret: str | None, caller: Caller, what: str) -> None:
        """Passes when `secret` opens the job sealed with `seal` (None: not
        asked, for operators and the server); counts a wrong one.

        Raises:
            LimitExceeded: a wrong secret, from a caller that gave too many
                wrong ones for this job lately (a right one always passes).
            Sealed: `secret` does not open the job (`what`: what to do instead).
        """
        if secret is None or job_secret_matches(seal, secret):
            return
        self.check(caller, job_id)  # only guessers are slowed: the team that holds the secret never is
        self.failed(caller, job_id)
        raise Sealed(f"job {job_id!r} is sealed: {what}")
