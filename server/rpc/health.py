"""Health statuses, answered on the main port from the event loop and on the
health-only port from threads of their own.

The main port's grpc.health.v1 is grpc_health's asyncio servicer: its answers
wait for the event loop, and behind every completion gRPC has queued for the
loop before them. grpc.aio hands completions to the loop through one socket
pair, a byte per completion, and the loop reads one byte per turn; while the
executor pushes a re-form's assignments (a slice of session writes per turn),
their completions fill that socket, gRPC's poller thread blocks on it, and
nothing more reaches the loop, a new health Check included, until the loop has
read it back down, many turns later: for a large world, about as long as the
re-form itself (benchmarks/reform_health.py).

So the health-only port (--health-port, what the Kubernetes manifests probe)
is a sync gRPC server: its own completion queue, polled by its own thread, and
a small pool of its own that runs the handlers. A Check there needs the GIL
for a few short steps, which a thread gets within sys.getswitchinterval()
(5 ms) however busy the loop is; it never waits for the loop. Its servicer
holds the statuses under a lock; `Health.set` writes them there from the loop
thread before the asyncio servicer's, so both ports answer the same.

An answer that never waits for the loop would also say SERVING over a loop
that is stuck for good, where the main port's Check would time out and a
liveness probe restart the server. So the loop beats every BEAT_S, and while
it has not beaten for LOOP_STALLED_S (far longer than any pause measured
here) the health-only port answers NOT_SERVING for every service.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

CHECK_THREADS = 4  # run Check (a dictionary read under a lock): a few suffice
MAX_WATCHES = 16  # Watch streams open at once on the health-only port; more are refused RESOURCE_EXHAUSTED
BEAT_S = 0.5  # how often the event loop says it runs
LOOP_STALLED_S = 10.0  # no beat for this long: the loop is stuck, and the health-only port says NOT_SERVING


class ThreadedHealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for a sync gRPC server, with statuses any thread may set.

    As grpc_health's servicers: "" starts SERVING; Check of an unknown service
    is NOT_FOUND; Watch sends the current status, then each change
    (SERVICE_UNKNOWN while unknown); after `enter_graceful_shutdown` every
    status is NOT_SERVING and stays so. Check also answers NOT_SERVING while
    the event loop has not beaten (`beat`) for LOOP_STALLED_S. Unlike grpc_health's sync servicer,
    `set` never waits for a Watch stream's send (it only wakes the stream's
    thread), so the event loop can call it; each Watch stream holds a thread
    of a pool of its own, and at most MAX_WATCHES are open, so watchers never
    hold up a Check.
    """

    def __init__(self, shut: Callable[[str], bool] = lambda service: False) -> None:
        self._shut = shut  # a service whose Check says NOT_SERVING whatever was set (Health's gate)
        self._changed = threading.Condition(threading.Lock())
        self._status: dict[str, int] = {"": SERVING}
        self._shutting_down = False
        self._watching = 0
        self._beat = time.monotonic()  # when the event loop last said it runs
        self.watch_pool = concurrent.futures.ThreadPoolExecutor(MAX_WATCHES + 2, thread_name_prefix="commctx-health-watch")

        def watch(request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> Iterator[health_pb2.HealthCheckResponse]:
            return self._watch(request, context)

        watch.experimental_thread_pool = self.watch_pool  # read by grpc's sync server: Watch runs on this pool
        self.Watch = watch

    def set(self, service: str, status: int) -> None:
        with self._changed:
            if self._shutting_down:
                return
            self._status[service] = status
            self._changed.notify_all()

    def enter_graceful_shutdown(self) -> None:
        with self._changed:
            if self._shutting_down:
                return
            self._shutting_down = True
            for service in self._status:
                self._status[service] = NOT_SERVING
            self._changed.notify_all()

    def beat(self) -> None:
        """The event loop runs (called from it every BEAT_S)."""
        self._beat = time.monotonic()

    def status(self, service: str) -> int | None:
        """What Check answers for `service`; None when it is unknown."""
        with self._changed:
            status = self._status.get(service)
        if status is not None and (time.monotonic() - self._beat > LOOP_STALLED_S or self._shut(service)):
            return NOT_SERVING
        return status

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    def _watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> Iterator[health_pb2.HealthCheckResponse]:
        with self._changed:
            if self._watching >= MAX_WATCHES:
                context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
                context.set_details(f"this port holds at most {MAX_WATCHES} Watch streams; use Check")
                return
            self._watching += 1
        context.add_callback(self._wake)  # the call ended: its thread stops waiting
        try:
            last = None
            while True:
                with self._changed:
                    while context.is_active() and self._status.get(request.service, SERVICE_UNKNOWN) == last:
                        self._changed.wait()
                    if not context.is_active():
                        return
                    last = self._status.get(request.service, SERVICE_UNKNOWN)
                yield health_pb2.HealthCheckResponse(status=last)
        finally:
            with self._changed:
                self._watching -= 1

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class HealthPort:
    """grpc.health.v1 alone on a port of its own, served by a sync gRPC server
    (its completion queue's thread, a pool for Check, the servicer's pool for
    Watch). Starts and stops as a grpc.aio server does, from the event loop,
    and runs the loop's heartbeat meanwhile."""

    def __init__(self, servicer: ThreadedHealthServicer) -> None:
        self._servicer = servicer
        self._beating: asyncio.Task | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="commctx-health")
        self._server = grpc.server(self._pool, options=[("grpc.so_reuseport", 0)])  # a busy port fails, not shared
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self._server)

    def add_insecure_port(self, address: str) -> int:
        """Raises: RuntimeError, when the address cannot be bound."""
        return self._server.add_insecure_port(address)

    async def start(self) -> None:
        self._server.start()
        self._beating = asyncio.create_task(self._beat(), name="commctx-health-beat")

    async def _beat(self) -> None:
        while True:
            self._servicer.beat()
            await asyncio.sleep(BEAT_S)

    async def stop(self, grace: float | None) -> None:
        """New calls are refused at once; calls in flight get `grace` seconds (Watch streams end then)."""
        stopped = self._server.stop(grace)
        await asyncio.to_thread(stopped.wait)
        if self._beating is not None:
            self._beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
        self._pool.shutdown(wait=False)
        self._servicer.watch_pool.shutdown(wait=False)


class _GatedAioServicer(health.aio.HealthServicer):
    """grpc_health's asyncio servicer whose Check of the gated service says
    NOT_SERVING while the gate is shut, whatever status was set."""

    def __init__(self, shut: Callable[[str], bool]) -> None:
        super().__init__()
        self._shut = shut

    async def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
        if self._shut(request.service):
            return health_pb2.HealthCheckResponse(status=NOT_SERVING)
        return await super().Check(request, context)


class Health:
    """The server's health statuses, as both ports answer them: `aio` is the
    main port's servicer (on the event loop); `port()` makes the health-only
    port, whose servicer is set first, from the loop thread, on every change.

    `service` is SERVING only while `leading()` also says so, read at each Check
    on either port: a leader frozen past its election lease and thawed answers
    NOT_SERVING at once, before its loop has heard that it lost the lease."""

    def __init__(self, service: str, leading: Callable[[], bool]) -> None:
        self._service, self._leading = service, leading
        self.aio = _GatedAioServicer(self._shut)
        self.threaded = ThreadedHealthServicer(self._shut)

    def _shut(self, service: str) -> bool:
        return service == self._service and not self._leading()

    def port(self) -> HealthPort:
        return HealthPort(self.threaded)

    async def set(self, service: str, status: int) -> None:
        self.threaded.set(service, status)
        await self.aio.set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        self.threaded.enter_graceful_shutdown()
        await self.aio.enter_graceful_shutdown()
