"""The health-only port (--health-port) answers from threads of its own, never
waiting for the event loop, and says exactly what the main port says:
SERVING, or NOT_SERVING while the store refuses writes, once another server
took the store over, while draining, and for commctx.v1.Rendezvous on an HA
replica that does not lead ("" stays SERVING there).

A real server on port 0, in this process, so that a test can block its loop.
How fast the port answers during a re-form is benchmarks/reform_health.py's
business; here the one bound is that an answer comes while the loop is held
for longer than the Check's deadline.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commctx.server import start_server
from commctx.server.rendezvous.store import Fenced, StoreError
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .conftest import eventually, join_request
from .stores import DictStore as MemoryStore  # the contract tests' reference store, keeping records

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE = "commctx.v1.Rendezvous"
NAMES = ("", SERVICE)

BLOCK_S = 5.0  # how long the test holds the event loop
DEADLINE_S = 2.5  # a Check's deadline: well inside the block


def spin(seconds: float) -> None:
    """Holds the event loop running Python (as a busy loop does: the GIL is
    given up only when another thread asks for it, every switch interval)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


async def test_the_health_port_answers_while_the_event_loop_is_blocked():
    server = await start_server("127.0.0.1", 0, health_port=0)
    try:
        connected = {name: threading.Event() for name in ("main", "health")}
        go = threading.Event()
        answers: dict[str, tuple[object, float]] = {}

        def probe(name: str, port: int) -> None:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                grpc.channel_ready_future(ch).result(timeout=30)  # connecting needs no event loop
                connected[name].set()
                go.wait(30)
                try:
                    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=DEADLINE_S)
                    answers[name] = (reply.status, time.monotonic())
                except grpc.RpcError as err:
                    answers[name] = (err.code(), time.monotonic())

        threads = [threading.Thread(target=probe, args=("main", server.port), daemon=True),
                   threading.Thread(target=probe, args=("health", server.health_port), daemon=True)]
        for t in threads:
            t.start()
        for event in connected.values():
            assert await asyncio.to_thread(event.wait, 30)
        go.set()
        spin(BLOCK_S)  # the loop is held from here ...
        released = time.monotonic()  # ... to here
        for t in threads:
            await asyncio.to_thread(t.join, 30)

        status, at = answers["health"]
        assert status == SERVING
        assert at < released, "the health-only port answered only once the event loop was free"
        # The control: the main port's health is served by the loop, so it could not answer.
        assert answers["main"][0] == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await server.stop(0)


async def test_a_loop_stuck_for_good_reads_not_serving_on_the_health_port(monkeypatch):
    """An answer that never waits for the loop must not hide a loop that no
    longer runs (a liveness probe would never restart the server)."""
    from commctx.server.rpc import health

    monkeypatch.setattr(health, "LOOP_STALLED_S", 1.0)
    server = await start_server("127.0.0.1", 0, health_port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert await asyncio.to_thread(stub.Check, health_pb2.HealthCheckRequest(service=""), timeout=10) \
                == health_pb2.HealthCheckResponse(status=SERVING)
            answers = []

            def probe(at: float) -> None:
                time.sleep(max(0.0, at - time.monotonic()))  # the scenario, not a wait for something: ask mid-stall
                answers.append(stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10).status)

            thread = threading.Thread(target=probe, args=(time.monotonic() + 2.5,), daemon=True)
            thread.start()
            spin(4.0)  # no beat for 4 s; the probe asks 2.5 s in
            await asyncio.to_thread(thread.join, 30)
            assert answers == [NOT_SERVING]

            async def serving_again() -> bool:
                reply = await asyncio.to_thread(stub.Check, health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
                return reply.status == SERVING

            await eventually(serving_again, what="the loop beats again")
    finally:
        await server.stop(0)


async def check(stub: health_pb2_grpc.HealthStub, name: str) -> object:
    try:
        return (await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
    except grpc.aio.AioRpcError as err:
        return err.code()


class Ports:
    """Health stubs on a server's main port and its health-only port."""

    def __init__(self, server) -> None:
        self.channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in (server.port, server.health_port)]
        self.main, self.health = (health_pb2_grpc.HealthStub(c) for c in self.channels)

    async def statuses(self, stub: health_pb2_grpc.HealthStub) -> dict[str, object]:
        return {name: await check(stub, name) for name in NAMES}

    async def agree_on(self, expected: dict[str, object], what: str) -> None:
        """Waits until the main port says `expected` (the server sets statuses
        from tasks); the health-only port must then say the same."""

        async def main_says() -> bool:
            return await self.statuses(self.main) == expected

        await eventually(main_says, what=f"the main port says {expected} ({what})")
        assert await self.statuses(self.health) == expected, what
        assert await self.statuses(self.main) == expected, what

    async def close(self) -> None:
        for c in self.channels:
            await c.close()


class FlakyStore(MemoryStore):
    """A memory store whose commits fail with StoreError (a full disk) or
    Fenced (another server took it over) while told to."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: Exception | None = None

    def commit(self, writes, epoch):
        if self.fail is not None:
            raise self.fail
        super().commit(writes, epoch)


async def join_in_background(server, job: str) -> asyncio.Task:
    """A Join (one write to the store), answered or refused: only its write matters."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")

    async def join() -> None:
        async with channel:
            try:
                await pb_grpc.RendezvousStub(channel).Join(join_request(job, 2, wait_timeout_ms=2_000), timeout=10)
            except grpc.aio.AioRpcError:
                pass

    return asyncio.ensure_future(join())


async def test_a_store_failure_and_its_recovery_read_the_same_on_both_ports():
    store = FlakyStore()
    server = await start_server("127.0.0.1", 0, health_port=0, store=store)
    ports = Ports(server)
    try:
        await ports.agree_on({"": SERVING, SERVICE: SERVING}, "serving")
        store.fail = StoreError("disk full (simulated)")
        joining = await join_in_background(server, "full")
        await ports.agree_on({"": NOT_SERVING, SERVICE: NOT_SERVING}, "the store refuses writes")
        store.fail = None  # the executor retries every second
        await ports.agree_on({"": SERVING, SERVICE: SERVING}, "the store took the writes")
        await joining
    finally:
        await ports.close()
        await server.stop(0)


async def test_a_fenced_server_reads_not_serving_on_both_ports():
    store = FlakyStore()
    server = await start_server("127.0.0.1", 0, health_port=0, store=store)
    ports = Ports(server)
    try:
        store.fail = Fenced("another server took over the store (simulated)")
        joining = await join_in_background(server, "fenced")
        await ports.agree_on({"": NOT_SERVING, SERVICE: NOT_SERVING}, "fenced: this server stops")
        assert server.deposed.is_set()
        await joining
    finally:
        await ports.close()
        await server.stop(0)


async def test_an_ha_replica_serves_the_rendezvous_on_both_ports_only_while_it_leads():
    async def follow(server) -> None:  # the election, stood in for by the test below
        await asyncio.Event().wait()

    server = await start_server("127.0.0.1", 0, health_port=0, replica=follow)
    ports = Ports(server)
    try:
        await ports.agree_on({"": SERVING, SERVICE: NOT_SERVING}, "a follower: alive, not serving the rendezvous")
        store = MemoryStore()
        server.begin_term(store, store.take_over(), store.load())
        await ports.agree_on({"": SERVING, SERVICE: SERVING}, "elected")
        await server.end_term("127.0.0.1:1")
        await ports.agree_on({"": SERVING, SERVICE: NOT_SERVING}, "leadership lost")
    finally:
        await ports.close()
        await server.stop(0)


async def test_draining_reads_not_serving_on_both_ports():
    server = await start_server("127.0.0.1", 0, health_port=0)
    ports = Ports(server)
    seen: dict[tuple[str, str], list[int]] = {}

    async def watch(port: str, stub: health_pb2_grpc.HealthStub, name: str) -> None:
        statuses = seen.setdefault((port, name), [])
        try:
            async for reply in stub.Watch(health_pb2.HealthCheckRequest(service=name)):
                statuses.append(reply.status)
        except grpc.aio.AioRpcError:
            pass  # the server stopped

    watches = [asyncio.ensure_future(watch(port, stub, name))
               for port, stub in (("main", ports.main), ("health", ports.health)) for name in NAMES]
    try:
        await eventually(lambda: len(seen) == 4 and all(seen.values()), what="every watcher heard SERVING")
        stopping = asyncio.ensure_future(server.stop(30))  # Watch streams are calls in flight: they hold the stop
        await eventually(lambda: all(s[-1] == NOT_SERVING for s in seen.values()), what="every watcher heard NOT_SERVING")
        assert {key: s for key, s in seen.items()} == {key: [SERVING, NOT_SERVING] for key in seen}
        for w in watches:
            w.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
        await ports.close()
        await asyncio.wait_for(stopping, 30)
    finally:
        for w in watches:
            w.cancel()
        await ports.close()
        await server.stop(0)


async def test_watch_streams_on_the_health_port_are_bounded():
    from commctx.server.rpc.health import MAX_WATCHES

    server = await start_server("127.0.0.1", 0, health_port=0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}")
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        calls = [stub.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(MAX_WATCHES)]
        for call in calls:
            assert (await call.read()).status == SERVING
        extra = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await extra.read()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await check(stub, "") == SERVING  # a Check still gets an answer
        calls[0].cancel()

        async def one_more() -> bool:  # once the cancelled stream's place is free
            call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                return (await call.read()).status == SERVING
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False
            finally:
                call.cancel()

        await eventually(one_more, what="a cancelled Watch frees its place")
        for call in calls:
            call.cancel()
    finally:
        await channel.close()
        await server.stop(0)
