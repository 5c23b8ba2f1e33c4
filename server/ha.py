"""High availability: replicas over one etcd, one leader at a time.

Each replica campaigns for the leader key (`{prefix}/leader`) on an etcd
lease of `--election-ttl-s`. The winner writes its advertise address there;
the key's revision is its epoch, which every store write compares (fencing,
etcd.py). The others follow: they answer the rendezvous UNAVAILABLE with the
leader's address (app.Router) and campaign again when the key goes.

Every replica keeps a copy of the state by watching the prefix (warm
standby): a new leader restores from it as soon as the copy has seen its own
election, without reading the whole prefix again. The leader steps down
(stops serving at once) when it can no longer be sure of its lease: at the
last renewal sent + TTL - a margin, before etcd could let another win.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable

import grpc
from aetcd import rpc

from .rendezvous.etcd import EtcdConfig, EtcdStore, credentials, prefix_end, records_of, target_and_options
from .rpc.app import RendezvousServer

log = logging.getLogger("commctx.server")


class LeaseLost(Exception):
    """The election lease can no longer be trusted."""


class Replica:
    """One replica's election loop; `await replica(server)` runs it for the server's life."""

    def __init__(self, config: EtcdConfig, store: EtcdStore, advertise: str, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._store = store
        self._advertise = advertise
        self._ttl = max(1, math.ceil(ttl_s))  # etcd leases count whole seconds
        self._margin = min(1.0, self._ttl / 5)
        self._clock = clock
        target, options = target_and_options(config)
        creds = credentials(config)
        self._channel = grpc.aio.secure_channel(target, creds, options) if creds else grpc.aio.insecure_channel(target, options)
        self._kv, self._leases = rpc.KVStub(self._channel), rpc.LeaseStub(self._channel)
        self._watch, self._auth = rpc.WatchStub(self._channel), rpc.AuthStub(self._channel)
        self._token: tuple[tuple[str, str], ...] = ()
        # The warm copy: every key under the prefix, whole up to revision `_revision`
        # (a new leader waits for its own election's put to come through).
        self._copy: dict[bytes, bytes] = {}
        self._revision = 0
        self._progress = asyncio.Condition()
        self._leader_changed = asyncio.Event()
        # Election leases this replica gave up but could not revoke (etcd out of reach as it lost
        # them): revoked before its next campaign. Left alone, one holds the leader key until etcd
        # expires it, which etcd puts off by a whole TTL whenever it elects a leader of its own.
        self._unrevoked: set[int] = set()
        self.role = "unknown"  # "leader", "follower" or "unknown"
        # Until when this replica may be sure of its election lease (the keeper
        # thread moves it on with each renewal etcd confirms): past it, another
        # replica may lead, so this one answers nothing (RendezvousServer.leading).
        self.trusted_until: float | None = None  # None: not yet, no lease granted

    async def __call__(self, server: RendezvousServer) -> None:
        mirror = asyncio.create_task(self._mirror(), name="commctx-etcd-mirror")
        try:
            await self._elect(server)
        finally:
            mirror.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mirror
            await self._channel.close()

    # -- etcd calls ------------------------------------------------------------------

    async def _metadata(self, renew: bool = False) -> tuple[tuple[str, str], ...]:
        if self._config.user and (renew or not self._token):
            reply = await self._auth.Authenticate(
                rpc.AuthenticateRequest(name=self._config.user, password=self._config.password), timeout=self._config.timeout_s)
            self._token = (("token", reply.token),)
        return self._token

    async def _unary(self, method, request):
        try:
            return await method(request, timeout=self._config.timeout_s, metadata=await self._metadata())
        except grpc.aio.AioRpcError as exc:
            if not (self._config.user and "auth token" in (exc.details() or "")):
                raise
            return await method(request, timeout=self._config.timeout_s, metadata=await self._metadata(renew=True))

    # -- the election ----------------------------------------------------------------

    async def _elect(self, server: RendezvousServer) -> None:
        attempt = 0
        while True:
            lease_id = 0
            try:
                await self._revoke_unrevoked()
                granted_at = self._clock()
                lease_id = (await self._unary(self._leases.LeaseGrant, rpc.LeaseGrantRequest(TTL=self._ttl))).ID
                self.trusted_until = granted_at + self._ttl - self._margin
                stop_keeping = threading.Event()
                keeper = asyncio.ensure_future(asyncio.to_thread(self._keep, lease_id, granted_at, stop_keeping))
                keeper.add_done_callback(lambda t: t.cancelled() or t.exception())  # read here or in _lead
                keeper.add_done_callback(lambda _, stop=stop_keeping: stop.set())  # cancelling the task stops the thread
                self._leader_changed.clear()
                reply = await self._unary(self._kv.Txn, rpc.TxnRequest(
                    compare=[rpc.Compare(key=self._config.leader_key, target=rpc.Compare.CREATE,
                                         result=rpc.Compare.EQUAL, create_revision=0)],
                    success=[rpc.RequestOp(request_put=rpc.PutRequest(
                        key=self._config.leader_key, value=self._advertise.encode(), lease=lease_id))],
                    failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=self._config.leader_key))]))
                if reply.succeeded:
                    await self._lead(server, reply.header.revision, keeper)
                else:
                    kvs = reply.responses[0].response_range.kvs
                    if kvs and kvs[0].lease in self._unrevoked:  # its own key, of a lease it gave up: not a leader to follow
                        keeper.cancel()
                        continue  # revoked (finally) before the next campaign
                    await self._follow(server, kvs[0].value.decode() if kvs else "", keeper)
                attempt = 0
            except (grpc.aio.AioRpcError, LeaseLost) as exc:
                if self.role == "leader":
                    log.error("leadership_lost", extra={"fields": {"reason": _reason(exc)}})
                elif attempt == 0:
                    log.warning("election_failed", extra={"fields": {"reason": _reason(exc)}})
                self.role = "unknown"
                await server.end_term()
                await asyncio.sleep(min(0.2 * 2 ** attempt, self._ttl / 3))
                attempt = min(attempt + 1, 8)
            finally:
                if lease_id:
                    stop_keeping.set()
                    self._unrevoked.add(lease_id)
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self._revoke_unrevoked()

    async def _revoke_unrevoked(self) -> None:
        """Revokes the election leases this replica gave up (its leader key goes with one).

        Raises:
            grpc.aio.AioRpcError: etcd cannot be reached (those not revoked are tried again next time).
        """
        for lease_id in sorted(self._unrevoked):
            try:
                await self._unary(self._leases.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id))
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it expired meanwhile
                    raise
            self._unrevoked.discard(lease_id)

    async def _lead(self, server: RendezvousServer, epoch: int, keeper: asyncio.Task) -> None:
        """Serves from the warm copy once it has seen this election (revision
        `epoch`), until the lease is lost or another replica fences this one."""
        try:
            async with self._progress:
                await asyncio.wait_for(self._progress.wait_for(lambda: self._revision >= epoch), self._ttl)
            jobs, members, events = self._values("jobs"), self._values("members"), self._values("events")
            start = self._config.key_of("worlds", "")
            worlds = {k: v for k, v in self._copy.items() if start <= k < prefix_end(start)}  # big worlds, in parts
        except TimeoutError:  # the watch lags: read the prefix itself
            jobs = members = events = worlds = None
        records = (await asyncio.to_thread(records_of, jobs, members, events, worlds, self._config) if jobs is not None
                   else await asyncio.to_thread(self._store.load))
        self.role = "leader"
        server.deposed.clear()
        server.leading = self.certain
        server.begin_term(self._store, epoch, records)
        log.info("leading", extra={"fields": {"epoch": epoch, "advertise": self._advertise, "jobs": len(records)}})
        deposed = asyncio.ensure_future(server.deposed.wait())
        try:
            await asyncio.wait([keeper, deposed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            deposed.cancel()
        if keeper.done():
            keeper.result()  # raises LeaseLost
        keeper.cancel()
        raise LeaseLost("another replica fenced this one")

    def certain(self) -> bool:
        """Whether this replica leads and its election lease is surely still its own."""
        return self.role == "leader" and self.trusted_until is not None and self._clock() < self.trusted_until

    async def _follow(self, server: RendezvousServer, leader: str, keeper: asyncio.Task) -> None:
        """Points callers at `leader` until the leader key changes."""
        keeper.cancel()  # a follower holds no lease; it campaigns anew with a fresh one
        self.role = "follower"
        await server.end_term(leader)
        log.info("following", extra={"fields": {"leader": leader}})
        await self._leader_changed.wait()

    def _keep(self, lease_id: int, granted_at: float, stop: threading.Event) -> None:
        """Renews the lease every TTL/3 until `stop`; raises LeaseLost once the
        last renewal etcd confirmed could have run out (less a margin). Runs in a
        worker thread, off the event loop, through the blocking gRPC API: a leader busy with a
        burst of ten thousand joins must not lose its lease because its
        renewals wait behind them on the event loop.

        A renewal counts once a linearizable read has come back after it: etcd's
        leader renews leases by itself, and one that lost its quorum does so until
        it notices, which a one-way partition can put off for as long as it lasts;
        the read needs the quorum."""
        leases, kv = rpc.LeaseStub(self._store.channel), rpc.KVStub(self._store.channel)
        trusted_until = granted_at + self._ttl - self._margin
        while not stop.is_set():
            sent = self._clock()
            try:
                replies = leases.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]), metadata=self._token,
                                                timeout=max(0.05, trusted_until - sent))
                reply = next(replies)
                if reply.TTL <= 0:
                    raise LeaseLost("the election lease expired")
                kv.Range(rpc.RangeRequest(key=self._config.leader_key), metadata=self._token,
                         timeout=max(0.05, trusted_until - self._clock()))
                trusted_until = self.trusted_until = sent + reply.TTL - self._margin
                pause = self._ttl / 3
            except (grpc.RpcError, StopIteration):
                pause = 0.2  # etcd unreachable for now: try again while the lease may still hold
            if self._clock() >= trusted_until:
                raise LeaseLost("no lease renewal answered in time")
            stop.wait(min(pause, max(0.0, trusted_until - self._clock())))

    # -- the warm copy ---------------------------------------------------------------

    def _values(self, name: str) -> list[bytes]:
        start = self._config.key_of(name, "")
        end = prefix_end(start)
        return [v for k, v in self._copy.items() if start <= k < end]

    async def _mirror(self) -> None:
        """Keeps `_copy` equal to the prefix: one read, then its watch events;
        again from a fresh read after any error or a compaction."""
        prefix = self._config.key_of("")
        end = prefix_end(prefix)
        while True:
            try:
                reply = await self._unary(self._kv.Range, rpc.RangeRequest(key=prefix, range_end=end))
                async with self._progress:
                    self._copy = {kv.key: kv.value for kv in reply.kvs}
                    self._revision = reply.header.revision
                    self._progress.notify_all()
                self._leader_changed.set()
                call = self._watch.Watch(metadata=await self._metadata())
                await call.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                    key=prefix, range_end=end, start_revision=self._revision + 1, progress_notify=True)))
                while True:
                    response = await call.read()
                    if response is grpc.aio.EOF or response.canceled or response.compact_revision:
                        break
                    async with self._progress:  # events come in revision order: the copy is whole up to the last
                        for ev in response.events:
                            if ev.type == ev.DELETE:
                                self._copy.pop(ev.kv.key, None)
                            else:
                                self._copy[ev.kv.key] = ev.kv.value
                            if ev.kv.key == self._config.leader_key:
                                self._leader_changed.set()
                            self._revision = max(self._revision, ev.kv.mod_revision)
                        self._progress.notify_all()
                call.cancel()
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"etcd: {exc.code().name}: {exc.details()}"
    return str(exc)
