"""Garbage collection on a timer, for a server that holds many sessions.

CPython starts a young collection when allocations minus deallocations pass a
threshold. A server holding ten thousand sessions frees objects made for the
previous renewal as fast as it makes new ones, so that counter barely moves
while the youngest generation fills with hundreds of thousands of objects,
which one collection then scans in a single long pause (the
commctx_gc_pause_seconds histogram shows it; docs/benchmarks.md has the
numbers). Collection cannot simply be turned off: grpc's own method lookup
leaves a few objects in a reference cycle per call.

So the pacer turns automatic collection off and collects the youngest
generation every 20 ms and the middle one every fifth pass: each pass sees
only what was made since the last, a few milliseconds' worth. (When passes
find next to nothing, an idle server, the period stretches to 100 ms.)
Full collections, whose cost grows with everything the server holds (with
its open sessions, mostly), run once the event loop has been calm
for 30 seconds after busier times, at most every 5 minutes, and at least
every hour, calm or not. Five calm seconds after a burst the C heap is
trimmed (glibc's malloc_trim, in a worker thread): a burst of ten thousand
calls leaves many of its buffers free but held by the allocator.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import time

from .telemetry import LoopLag

YOUNG_EVERY_S = 0.02
IDLE_EVERY_S = 0.1
IDLE_PASS_S = 0.0002  # a young pass this quick found next to nothing
MIDDLE_EVERY = 5  # young passes
FULL_AT_MOST_EVERY_S = 300.0
FULL_AT_LEAST_EVERY_S = 3600.0
CALM_FOR_S = 30
TRIM_CALM_FOR_S = 5
CALM_LAG_S = 0.01


def _malloc_trim() -> None:
    """Returns free heap memory to the OS where the C library can (glibc); else nothing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class GcPacer:
    def __init__(self, loop_lag: LoopLag) -> None:
        self._loop_lag = loop_lag

    async def run(self) -> None:
        """Collects until cancelled; automatic collection is restored then."""
        was_enabled = gc.isenabled()
        gc.disable()
        last_full = last_late = time.monotonic()
        own_pause_until = 0.0  # the lag a full collection causes itself is not "busy"
        collect_after_calm = trim_after_calm = False  # busier times since the last full collection / trim
        passes = 0
        period = YOUNG_EVERY_S
        try:
            while True:
                await asyncio.sleep(period)
                passes += 1
                now = time.monotonic()
                if now > own_pause_until and self._loop_lag.worst(1) >= CALM_LAG_S:
                    last_late, collect_after_calm, trim_after_calm = now, True, True
                calm_for = now - last_late
                if (collect_after_calm and calm_for > CALM_FOR_S and now - last_full > FULL_AT_MOST_EVERY_S) \
                        or now - last_full > FULL_AT_LEAST_EVERY_S:
                    gc.collect(2)
                    last_full, collect_after_calm, trim_after_calm = time.monotonic(), False, True
                    own_pause_until = last_full + 1.1
                    continue
                if trim_after_calm and calm_for > TRIM_CALM_FOR_S:
                    trim_after_calm = False
                    await asyncio.to_thread(_malloc_trim)
                started = time.perf_counter()
                gc.collect(1 if passes % MIDDLE_EVERY == 0 else 0)
                period = IDLE_EVERY_S if time.perf_counter() - started < IDLE_PASS_S else YOUNG_EVERY_S
        finally:
            if was_enabled:
                gc.enable()
