"""Garbage collection on a timer, for a server that holds many sessions.

CPython starts a young collection when allocations minus deallocations pass a
threshold. A server holding ten thousand sessions frees objects made for the
previous renewal as fast as it makes new ones, so that counter barely moves
while the youngest generation fills with hundreds of thousands of objects,
which one collection then scans in a single pause of 200 ms or more
(measured with benchmarks/reform_scale.py and the commctx_gc_pause_seconds
histogram). Collection cannot simply be turned off: grpc's own method lookup
leaves a few objects in a reference cycle per call.

So the pacer turns automatic collection off and collects the youngest
generation every 20 ms and the middle one every 100 ms: each pass sees only
what was made since the last, a few milliseconds' worth. Full collections,
whose cost grows with everything the server holds, run once the event loop
has been calm for five seconds after busier times (and at least every half
hour, calm or not). After a full collection the C heap is trimmed
(glibc's malloc_trim): a burst of ten thousand calls leaves most of its
buffers free but held by the allocator, which would otherwise count against
the server's memory until the next burst reuses them.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import time

from .telemetry import LoopLag

YOUNG_EVERY_S = 0.02
MIDDLE_EVERY = 5  # young passes
FULL_AT_LEAST_EVERY_S = 1800.0
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
        last_full = time.monotonic()
        passes = 0
        busy = False  # busier times since the last full collection
        try:
            while True:
                await asyncio.sleep(YOUNG_EVERY_S)
                passes += 1
                busy = busy or self._loop_lag.worst(1) >= CALM_LAG_S
                if (busy and self._loop_lag.worst(5) < CALM_LAG_S) or time.monotonic() - last_full > FULL_AT_LEAST_EVERY_S:
                    gc.collect(2)
                    await asyncio.to_thread(_malloc_trim)
                    last_full, busy = time.monotonic(), False
                else:
                    gc.collect(1 if passes % MIDDLE_EVERY == 0 else 0)
        finally:
            if was_enabled:
                gc.enable()
