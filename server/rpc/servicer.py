"""The gRPC adapter: decode (codec), await the domain (the state machine, its
executor, `Joining`), encode (codec, paging). Limits, paging and waiting are
the domain's; every error leaves through `status.error_status` (never UNKNOWN)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

import grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from ..errors import BadRequest, LimitExceeded, NotFound, SessionReplaced, WaitTimeout
from ..rendezvous.executor import Executor
from ..rendezvous.machine import Rendezvous
from ..rendezvous.model import DISCONNECTED, Gone, Replaced
from ..rendezvous.params import check_job_id, check_member_id
from ..rendezvous.shares import Caller
from ..rendezvous.views import MAX_NODE_PAGE_SIZE, NODE_PAGE_SIZE
from ..rendezvous.waiting import Joining, Waiters
from ..rendezvous.watching import JOB_GONE, TooSlow
from ..tokens import Callers
from . import codec, paging
from .auth import caller_of, is_admin, secret_of
from .specs import SpecCache
from .status import answer_error, error_status
from .undecodable import Undecodable

T = TypeVar("T")


class RendezvousServicer(pb_grpc.RendezvousServicer):
    """Serves commctx.v1.Rendezvous over the state machine."""

    def __init__(self, machine: Rendezvous, executor: Executor, waiters: Waiters,
                 rpc_error: Callable[[str, str], None] = lambda method, code: None, callers: Callers | None = None,
                 session_ended: Callable[[str], None] = lambda how: None,
                 deposed: Callable[[], Exception | None] = lambda: None) -> None:
        self._machine = machine
        self._deposed = deposed  # NOT_LEADER once this term no longer leads: "gone" is the leader's word only
        self._session_ended = session_ended
        self._callers = callers
        self._sinks: set[asyncio.Queue] = set()  # of the open sessions
        self._executor = executor
        self._joining = Joining(machine, executor, waiters)
        self._rpc_error = rpc_error
        self._specs = SpecCache()
        self._worlds = codec.Worlds()  # the encodings of the worlds being delivered now
        self._answering = asyncio.Lock()  # encoding a node or host membership's workers' assignments (_encoded)

    def _fail(self, context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
        """Answers the call with `exc`'s status; the handler then returns None
        (status.answer_error: no context.abort, and no exception kept in a local,
        where its traceback would hold the frame: nothing left for the collector)."""
        status = error_status(exc)
        self._rpc_error(method, status.code.name)
        answer_error(context, status)

    async def _call(self, context: grpc.aio.ServicerContext, method: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except Exception as exc:  # every failure leaves through the status table
            self._fail(context, method, exc)
            return None

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> bytes | None:
        try:
            params = codec.join_params(request, await self._specs.spec_of(request, self._machine.limits))
            caller = caller_of(context, self._callers)  # its workers count against its share in the machine's join
            answer = await self._joining.join(params, request.member_secret, caller, request.wait_timeout_ms / 1000,
                                              context.time_remaining())
            slices = codec.join_slices(answer, request.workers, self._worlds)  # the JoinResponse, encoded
            return await self._encoded(slices) if codec.many_workers(answer, request.workers) else b"".join(slices)
        except Exception as exc:
            self._fail(context, "Join", exc)
            del exc  # its traceback holds this frame, which would hold it: no cycle
            return None

    async def _encoded(self, slices: Iterator[bytes]) -> bytes:
        """A message of many workers' assignments (a node or host membership's): a slice
        per turn of the event loop, one message at a time (a world's node Joins, woken
        at once, would otherwise each encode a slice in the same turn)."""
        async with self._answering:
            out = []
            for piece in slices:
                out.append(piece)
                await asyncio.sleep(0)
        return b"".join(out)

    @property
    def open_member_sessions(self) -> int:
        """Session streams open now that named their member."""
        return len(self._sinks)

    @property
    def open_sessions(self) -> int:
        """Session and WatchEvents streams open now."""
        return self._machine.shares.streams

    def close(self, error: Exception) -> None:
        """Ends every open Session with `error` (the server stops serving; the
        clients reconnect elsewhere), and shuts the spec parser down. The members
        and their leases stay as they are."""
        self._specs.close()
        for sink in self._sinks:
            sink.put_nowait(error)
        self._executor.watchers.end_all(error)

    async def Session(self, requests: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext) -> None:
        caller = caller_of(context, self._callers)
        try:
            self._machine.shares.open_stream(caller, "session streams")
        except LimitExceeded as exc:
            self._fail(context, "Session", exc)
            return
        try:
            await self._session(context, caller)
        finally:
            self._machine.shares.close_stream(caller)

    async def _session(self, context: grpc.aio.ServicerContext, caller: Caller) -> None:
        # The first message names the member; every message renews its lease.
        # Events the executor puts in the member's sink are written as they
        # come (through context.read/write, so `requests` is not iterated).
        wait = self._machine.naming_wait_s(self._machine.shares.streams)
        try:  # a stream that never names its member would be held forever
            first = await asyncio.wait_for(context.read(), wait)
        except asyncio.TimeoutError:
            self._fail(context, "Session", WaitTimeout(
                f"no SessionRequest within {wait:g} s (the lease TTL, and 1 ms for each open stream or for each worker of the "
                f"widest world, as its first lease): a session starts by naming its member"))
            return
        if first is grpc.aio.EOF:
            return
        if isinstance(first, Undecodable):
            self._fail(context, "Session", first.error())
            return
        sink: asyncio.Queue = asyncio.Queue()
        try:
            job_id, member_id = check_job_id(first.job_id), check_member_id(first.member_id)
            ttl, missed, actions = self._machine.open_session(job_id, member_id, first.generation, sink, first.spare_port,
                                                              first.member_secret)
        except NotFound as exc:  # a renewal for an unknown member: "gone, re-join", not an error
            if (deposed := self._deposed()) is not None:
                self._fail(context, "Session", deposed)
                return
            await context.write(pb.SessionEvent(gone=str(exc)))
            return
        except Exception as exc:
            self._fail(context, "Session", exc)
            return
        # What it missed is told after everything queued is written: never a world that is not yet durable
        # (a leader that loses its term before writing it leaves that world unformed).
        actions.pushes[:0] = [(sink, event) for event in missed]
        self._executor.submit(actions)
        if first.restart_generation:  # asked for before this stream opened (a launcher restarting at once)
            self._restart(job_id, member_id, first.restart_generation, sink)
        if first.failed_generation:  # its collectives failed while its stream was down
            self._executor.submit(self._machine.report_failure(job_id, member_id, first.failed_generation))
        if first.gone_workers or first.left_workers:  # a host's workers that ended while its stream was down
            try:
                self._executor.submit(self._machine.remove_workers(job_id, member_id, first.gone_workers, DISCONNECTED))
                self._executor.submit(self._machine.remove_workers(job_id, member_id, first.left_workers, "left"))
            except NotFound as exc:
                if (deposed := self._deposed()) is not None:
                    self._fail(context, "Session", deposed)
                    return
                await context.write(pb.SessionEvent(gone=str(exc)))
                return
        reader = asyncio.ensure_future(self._renewals(context, job_id, member_id, sink))
        self._sinks.add(sink)
        self._machine.shares.live.add(caller, sink.put_nowait)  # a revoked token's session ends (UnknownToken)
        # How the stream ended: by its client ("finished", or "cancelled": it
        # cancelled it, or its connection broke), by a newer session ("replaced"),
        # or by this server ("server": stopping, handing over, the member gone).
        how = "cancelled"
        try:
            await context.write(pb.SessionEvent(lease_ttl_ms=round(ttl * 1000)))
            while True:
                event = await sink.get()
                if event is None:  # the reader saw the client finish
                    how = "finished"
                    return
                if isinstance(event, Exception):  # close() (this server stopped serving), or a message that does not parse
                    how = "server"
                    self._fail(context, "Session", event)
                    return
                if isinstance(event, Replaced):
                    how = "replaced"
                    self._fail(context, "Session", SessionReplaced(event.reason))
                    return
                if codec.session_sliced(event, member_id):
                    message = await self._encoded(codec.session_slices(event, member_id, self._worlds))
                else:
                    message = codec.session_event(event, member_id, self._worlds)
                if message is not None:
                    await context.write(message)
                if isinstance(event, Gone):
                    how = "server"
                    return
        finally:
            self._sinks.discard(sink)
            self._machine.shares.live.discard(caller, sink.put_nowait)
            reader.cancel()
            how, actions = self._machine.end_session(job_id, member_id, sink, how)
            self._session_ended(how)
            self._executor.submit(actions)

    async def _renewals(self, context: grpc.aio.ServicerContext, job_id: str, member_id: str, sink: asyncio.Queue) -> None:
        while True:
            request = await context.read()
            if request is grpc.aio.EOF:
                sink.put_nowait(None)  # the client finished the stream
                return
            if isinstance(request, Undecodable):
                sink.put_nowait(request.error())  # ends the stream, INVALID_ARGUMENT; the lease runs on
                return
            try:
                _, actions = self._machine.renew(job_id, member_id, request.generation, request.spare_port)
                if request.failed_generation:
                    actions.extend(self._machine.report_failure(job_id, member_id, request.failed_generation))
                if request.gone_workers:
                    actions.extend(self._machine.remove_workers(job_id, member_id, request.gone_workers, DISCONNECTED))
                if request.left_workers:
                    actions.extend(self._machine.remove_workers(job_id, member_id, request.left_workers, "left"))
                if request.expired_workers:
                    actions.extend(self._machine.remove_workers(job_id, member_id, request.expired_workers, "expired"))
                if actions:
                    self._executor.submit(actions)
            except NotFound as exc:
                sink.put_nowait(self._deposed() or Gone(str(exc)))
                return
            except BadRequest as exc:  # ends the stream, INVALID_ARGUMENT; the lease runs on
                sink.put_nowait(exc)
                return
            if request.restart_generation and not self._restart(job_id, member_id, request.restart_generation, sink):
                return

    def _restart(self, job_id: str, member_id: str, generation: int, sink: asyncio.Queue) -> bool:
        """A launcher's request to restart the world of `generation`; False once
        the member is gone (its session hears it)."""
        try:
            actions = self._machine.restart(job_id, member_id, generation)
        except NotFound as exc:
            sink.put_nowait(self._deposed() or Gone(str(exc)))
            return False
        if actions:
            self._executor.submit(actions)
        return True

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.aio.ServicerContext) -> pb.KeepAliveResponse | None:
        def renew() -> pb.KeepAliveResponse:
            ttl, generation, actions = self._machine.keep_alive(
                check_job_id(request.job_id), check_member_id(request.member_id), request.generation, request.member_secret)
            self._executor.submit(actions)
            return pb.KeepAliveResponse(lease_ttl_ms=round(ttl * 1000), generation=generation)

        answer = await self._call(context, "KeepAlive", renew)
        if answer is not None and answer.generation != request.generation:
            # News (a generation the member does not hold) is told once it is written: a leader that loses
            # its term first never formed it. A renewal of the generation it holds is answered at once.
            try:
                await self._executor.settled()
            except Exception as exc:
                self._fail(context, "KeepAlive", exc)
                return None
        return answer

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse | None:
        try:
            actions = self._machine.leave(check_job_id(request.job_id), check_member_id(request.member_id), request.member_secret,
                                          request.job_secret, caller_of(context, self._callers), request.close)
            await self._executor.carry_out(actions)  # answered once the departure is durable
        except Exception as exc:
            self._fail(context, "Leave", exc)
            return None
        return pb.LeaveResponse()

    async def DescribeJob(self, request: pb.DescribeJobRequest, context: grpc.aio.ServicerContext) -> pb.JobDescription | None:
        secret, caller = secret_of(context, self._callers, request.job_secret), caller_of(context, self._callers)

        def describe() -> pb.JobDescription:
            size = paging.page_size(request.node_page_size, "node_page_size", NODE_PAGE_SIZE, MAX_NODE_PAGE_SIZE)
            first = paging.position(request.node_page_token, "node_page_token", "DescribeJob", 9)
            view = self._machine.describe(check_job_id(request.job_id), secret, first, size, caller, request.run)
            return paging.description_page(view, first)

        return await self._call(context, "DescribeJob", describe)

    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse | None:
        admin = is_admin(context, self._callers)

        def jobs() -> pb.ListJobsResponse:
            views, more = self._machine.job_page(request.page_token, paging.page_size(request.page_size), request.include_ended)
            return paging.jobs_page(views, more, admin, request.include_ended)

        return await self._call(context, "ListJobs", jobs)

    async def ListEvents(self, request: pb.ListEventsRequest, context: grpc.aio.ServicerContext) -> pb.ListEventsResponse | None:
        secret, caller = secret_of(context, self._callers, request.job_secret), caller_of(context, self._callers)

        def page() -> pb.ListEventsResponse:
            size = paging.page_size(request.page_size)
            after = paging.position(request.page_token, "page_token", "ListEvents", 19)
            return paging.events_page(self._machine.events(check_job_id(request.job_id), after, size + 1, secret, caller,
                                                          request.run), size)

        return await self._call(context, "ListEvents", page)

    async def WatchEvents(self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext) -> None:
        watchers = self._executor.watchers
        caller = caller_of(context, self._callers)
        try:
            job_id = check_job_id(request.job_id)
            snapshot = self._machine.events(job_id, request.after_seq, None, secret_of(context, self._callers, request.job_secret),
                                            caller)
            self._machine.shares.open_stream(caller, "open streams")
        except Exception as exc:
            self._fail(context, "WatchEvents", exc)
            return
        if not self._machine.live(job_id):  # only runs that ended: their history, and the watch ends
            self._machine.shares.close_stream(caller)
            for event in snapshot:
                await context.write(codec.event_message(event))
            return
        watch = watchers.open(job_id, snapshot)  # no await since the snapshot: nothing falls in between
        self._machine.shares.live.add(caller, watch.end)  # a revoked token's watch ends (UnknownToken)
        sent = request.after_seq
        try:
            while True:
                item = await watch.queue.get()
                if item is JOB_GONE:
                    return
                if isinstance(item, TooSlow):
                    self._fail(context, "WatchEvents", LimitExceeded(
                        f"this watch of job {job_id!r} fell {watchers.QUEUE} events behind its reader and was cut off; "
                        f"watch again with after_seq {sent}"))
                    return
                if isinstance(item, Exception):  # the server stops serving
                    self._fail(context, "WatchEvents", item)
                    return
                await context.write(codec.event_message(item))
                sent = item.seq
        finally:
            watchers.close(watch)
            self._machine.shares.live.discard(caller, watch.end)
            self._machine.shares.close_stream(caller)
