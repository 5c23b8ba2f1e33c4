"""The hub: a host membership's Join and session with the server, and the
host's workers over the link (host.py says how the two ends work together).
It runs in threads of one of those workers' processes."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import socket
import struct
import threading
import time

from commctx.v1 import rendezvous_pb2 as pb

from .credentials import Tls
from .errors import RendezvousError
from .host_wire import Reader, event_b64, send
from .netif import listen_on
from .progress import DEFAULT_EVERY_S, Progress
from .session import Session

log = logging.getLogger("commctx")

REJOIN_WINDOW_S = 0.3  # after a takeover: how long the new hub waits for the others to reconnect


class HostJob:
    """What the host's workers must agree on, and what the hub joins with."""

    def __init__(self, server_addr: str, request: pb.JoinRequest, tls: Tls | None, token: str | None) -> None:
        self.server_addr, self.tls, self.token = server_addr, tls, token
        self.request = request  # job, spec, job secret, node key, address; its workers are the hub's to list

    def fingerprint(self) -> dict:
        """What a worker's hello must match (secrets as digests)."""
        r = self.request
        digest = lambda s: hashlib.sha256(s.encode()).hexdigest() if s else ""  # noqa: E731
        return {"job_id": r.job_id, "spec": base64.b64encode(r.spec.SerializeToString(deterministic=True)).decode(),
                "job_secret": digest(r.job_secret), "token": digest(self.token or ""), "address": r.address,
                "node_rank": r.node_rank if r.HasField("node_rank") else None}


class Peer:
    """A worker of the host, as its hub holds it."""

    def __init__(self, sock: socket.socket, index: int, worker: pb.HostWorker, timeout_s: float, progress_s: float) -> None:
        self.sock, self.index, self.worker, self.timeout_s, self.progress_s = sock, index, worker, timeout_s, progress_s
        self.heard = time.monotonic()  # when it last said anything (it pings every lease TTL/3)
        self.generation = 0  # of the latest assignment it was given
        self.lock = threading.Lock()  # one writer at a time

    def send(self, message: dict, fd: int | None = None) -> bool:
        with self.lock:
            try:
                send(self.sock, message, fd)
                return True
            except OSError:
                return False


class HostStream(Session):
    """The membership's stream to the server: its events go to the hub."""

    def __init__(self, hub: Hub, job: HostJob) -> None:
        super().__init__(job.server_addr, job.tls, job.token)
        self._hub = hub

    def _handle(self, event: pb.SessionEvent) -> bool:
        if event.WhichOneof("event") == "world_changed":
            self._wake.put(True)
        if event.WhichOneof("event") == "assignment":
            self.settle(max(a.generation for a in event.worker_assignments) if event.worker_assignments
                        else event.assignment.generation)
        self._hub.dispatch(event)
        return event.WhichOneof("event") == "gone"


class Hub:
    """The host membership: its Join and session with the server, and the host's
    workers over the link. Runs in threads of one of those workers' processes."""

    def __init__(self, listener: socket.socket, lock_fd: int, path: str, job: HostJob, state: dict | None = None) -> None:
        self._listener, self._lock_fd, self._path, self.job = listener, lock_fd, path, job
        self._mutex = threading.RLock()
        self._peers: dict[int, Peer] = {}
        self._stream = HostStream(self, job)
        self._spare: socket.socket | None = None
        self._joined: tuple[int, ...] = ()  # the workers the membership holds on the server
        self._closed = False
        self._over = False  # the server ended the membership
        self._started = False  # the stream runs (the membership was seated once)
        self._next_index = 1
        self._generation = 0
        self._expected: set[int] = set()  # after a takeover: workers still to reconnect
        if state is not None:
            self._stream.credentials(state["member_id"], state["secret"], job.request.job_id, job.request.job_secret)
            self._next_index = state["next_index"]
            self._generation = state["generation"]
            self._workers = {int(w["index"]): pb.HostWorker(**w) for w in state["workers"]}
            self._joined = tuple(sorted(self._workers))
            self._expected = set(self._workers)
        else:
            self._workers: dict[int, pb.HostWorker] = {}
        threading.Thread(target=self._accept, name="commctx-host-hub", daemon=True).start()
        threading.Thread(target=self._watch, name="commctx-host-watch", daemon=True).start()
        if state is not None:
            threading.Thread(target=self._resume, args=(state,), name="commctx-host-resume", daemon=True).start()

    # -- the host's workers -----------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed and not self._over:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
            if uid != os.getuid():  # the directory's mode keeps others out; this, too, if it were changed
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="commctx-host-peer", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = Reader(conn)
        got = reader.read()
        peer = self._welcome(conn, got[0]) if got is not None else None
        if peer is None:
            conn.close()
            return
        why = "left" if got[0].get("leaving") else "gone"  # (a worker whose hub went as it was leaving)
        while why == "gone":
            got = reader.read()
            if got is None:
                break
            peer.heard = time.monotonic()
            message = got[0]
            kind = message.get("kind")
            if kind == "leave":
                why = "left"
            elif kind == "failed":
                self._stream.report_failure(int(message["generation"]))
        self._gone(peer, why)
        if why == "left":
            peer.send({"kind": "bye"})  # the hub has its leave (the server has it, where it was the last worker)
        conn.close()

    def _watch(self) -> None:
        """A worker silent for a lease (hung, paused: its connection stays open) is gone, as its own lease would be."""
        while not self._closed:
            time.sleep(min(0.25, self._stream.lease_ttl_s / 10))
            if not self._started:
                continue
            now, ttl = time.monotonic(), self._stream.lease_ttl_s
            for peer in [p for p in list(self._peers.values()) if now - p.heard > ttl]:
                why = (f"worker {peer.index} of host member {self._stream.member_id} expired: its process went silent "
                       f"for {now - peer.heard:.1f} s, longer than its lease ({ttl:g} s)")
                log.warning("%s", why)
                self._gone(peer, "expired")
                peer.send({"kind": "event", "event": event_b64(pb.SessionEvent(gone=why))})  # it reads it if it wakes
                with contextlib.suppress(OSError):
                    peer.sock.shutdown(socket.SHUT_RDWR)

    def _welcome(self, conn: socket.socket, hello: dict) -> Peer | None:
        theirs, ours = hello.get("job", {}), self.job.fingerprint()
        for key in ("job_id", "spec", "job_secret", "token", "address", "node_rank"):
            if theirs.get(key) != ours[key]:
                send(conn, {"kind": "refused", **_disagreement(key, theirs, ours, self.job.request)})
                return None
        with self._mutex:
            if self._closed or self._over:
                return None  # its membership is over here: the worker joins anew (its hub, or it, takes the lock)
            index = hello.get("index")
            if hello.get("leaving") and index not in self._workers:  # gone already
                send(conn, {"kind": "bye"})
                return None
            if index is not None and index in self._workers:  # a worker reconnecting after a takeover
                worker = self._workers[index]
                self._expected.discard(index)
            else:
                index, self._next_index = self._next_index, self._next_index + 1
                worker = pb.HostWorker(index=index, role=hello.get("role", ""))
                if hello.get("local_rank") is not None:
                    worker.local_rank = int(hello["local_rank"])
                self._workers[index] = worker
            peer = self._peers[index] = Peer(conn, index, worker, float(hello.get("timeout_s", 600)),
                                                    float(hello.get("progress_s", DEFAULT_EVERY_S)))
            peer.send({"kind": "welcome", "index": index, "ttl_s": self._stream.lease_ttl_s})
            self._share_state()
            if index not in self._joined:
                self._join()
        return peer

    def _gone(self, peer: Peer, why: str) -> None:
        """A worker left, its connection closed ("gone": it died) or it went silent ("expired")."""
        with self._mutex:
            if self._peers.get(peer.index) is not peer:
                return
            del self._peers[peer.index]
            self._workers.pop(peer.index, None)
            self._share_state()
            if peer.index in self._joined and self._started:
                if self._peers:
                    self._stream.report_workers([peer.index], why)
                else:  # the membership's last worker: it leaves whole
                    self._close(leave=why == "left")
            elif peer.index in self._joined or (not self._peers and not self._started):
                self._restart_join()  # not seated yet: join anew without it

    def _share_state(self) -> None:
        """Every worker knows what a takeover needs."""
        state = {"kind": "state", "member_id": self._stream.member_id, "secret": self._stream._secret,
                 "generation": self._generation, "next_index": self._next_index,
                 "workers": [{"index": w.index, "role": w.role, **({"local_rank": w.local_rank} if w.HasField("local_rank") else {})}
                             for w in self._workers.values()]}
        for peer in list(self._peers.values()):
            peer.send(state)

    # -- the server ----------------------------------------------------------------------

    def _request(self) -> pb.JoinRequest:
        r = pb.JoinRequest()
        r.CopyFrom(self.job.request)
        r.host_workers.extend(self._workers[i] for i in sorted(self._workers))
        r.member_id, r.member_secret = self._stream.member_id, self._stream._secret
        if self._spare is None:
            self._spare = listen_on(r.address)
        r.master_port = self._spare.getsockname()[1]
        return r

    def _join(self) -> None:
        """(Under the mutex.) Joins with every worker the host has now, taking over from an earlier call."""
        if not self._peers:
            return
        request = self._request()
        joining = tuple(sorted(self._workers))
        timeout = max(p.timeout_s for p in self._peers.values())
        every = min((p.progress_s for p in self._peers.values() if p.progress_s > 0), default=0.0)
        threading.Thread(target=self._call, args=(request, joining, timeout, every), name="commctx-host-join",
                         daemon=True).start()

    def _restart_join(self) -> None:
        """(Under the mutex.) Before the membership is seated: withdraws it and joins anew with the workers left."""
        old = self._stream
        self._stream = HostStream(self, self.job)
        self._joined = ()
        old.close(leave=False, wait=False)  # its Join call ends: the server withdraws the membership
        if self._peers:
            self._join()
        else:
            self._close(leave=False)

    def _call(self, request: pb.JoinRequest, joining: tuple[int, ...], timeout_s: float, progress_s: float) -> None:
        stream = self._stream
        try:  # while it waits, the hub's process says who the job waits for (one line a host, not one a worker)
            with Progress(lambda r, t: stream._endpoints.call("DescribeJob", r, t), request.job_id, request.job_secret,
                          progress_s):
                response = stream._join(request, timeout_s)
        except RendezvousError as exc:
            with self._mutex:
                if stream is not self._stream or joining != tuple(sorted(self._workers)):
                    return  # superseded: a later call (or a restart) took over
                refused = [i for i in joining if i not in self._joined] if self._started else list(joining)
                if not self._started:  # the membership itself was refused: this hub is over before the
                    self._close(leave=False)  # refusal is told, so that a worker's next join starts anew
                for index in refused:
                    self._workers.pop(index, None)
                    peer = self._peers.pop(index, None)
                    if peer is not None:
                        peer.send({"kind": "refused", "code": exc.code, "details": exc.details, "reason": exc.reason})
                        with contextlib.suppress(OSError):
                            peer.sock.shutdown(socket.SHUT_RDWR)
                if self._started and refused:
                    self._share_state()
            return
        except ValueError:  # (not a RendezvousError) its channels were closed under it: superseded, or the hub closed
            return
        with self._mutex:
            if stream is not self._stream:
                return
            self._joined = tuple(sorted(set(self._joined) | set(joining)))
            if not self._started:
                self._started = True
                stream._spare_port = request.master_port
                stream._job_id, stream._job_secret = request.job_id, request.job_secret
                stream.start(response)
            for a in response.worker_assignments:
                self._deliver(a, pb.SessionEvent(assignment=a))

    def _resume(self, state: dict) -> None:
        """After a takeover: the membership's session, anew; then the workers that did not come back are gone."""
        with self._mutex:
            self._spare = listen_on(self.job.request.address)
            stream = self._stream
            stream._spare_port = self._spare.getsockname()[1]
            stream._generation = state["generation"]
            stream._ttl_s, stream._ttl_known = float(state.get("ttl_s", 10.0)), True
            stream._thread = threading.Thread(target=stream._run, name="commctx-session", daemon=True)
            self._started = True
            stream._thread.start()
        deadline = time.monotonic() + REJOIN_WINDOW_S
        while time.monotonic() < deadline and self._expected:
            time.sleep(0.01)
        with self._mutex:
            missing = sorted(self._expected)
            self._expected.clear()
            for index in missing:
                self._workers.pop(index, None)
            if missing:
                log.warning("host workers %s of membership %s did not come back after its holder went; reported gone",
                            missing, stream.member_id)
                stream.report_workers(missing, "gone")
                self._share_state()

    def dispatch(self, event: pb.SessionEvent) -> None:
        """The server's news, passed on: each worker its own assignment."""
        kind = event.WhichOneof("event")
        with self._mutex:
            if kind == "assignment":
                for a in event.worker_assignments or [event.assignment]:
                    self._deliver(a, pb.SessionEvent(assignment=a))
                return
            message = {"kind": "event", "event": event_b64(event)}
            for peer in list(self._peers.values()):
                peer.send(message)
            if kind == "gone":  # the membership is over: a newcomer starts another; its workers' leaves end this one
                self._over = True  # (the last one's a Leave, removing the membership of a job that ended)
                self._retire()

    def _deliver(self, a: pb.Assignment, event: pb.SessionEvent) -> None:
        """(Under the mutex.) One worker's assignment; rank 0's with the spare it serves the store on."""
        self._generation = max(self._generation, a.generation)
        peer = self._peers.get(a.worker)
        if peer is None or a.generation <= peer.generation:
            return  # gone, or given already (a Join's answer and the session both bring a world)
        peer.generation = a.generation
        fd = None
        if a.rank == 0 and self._spare is not None and self._spare.getsockname()[1] == a.master_port:
            spare, self._spare = self._spare, listen_on(self.job.request.address)
            fd = spare.fileno()
            self._stream.offer_spare(self._spare.getsockname()[1])
        peer.send({"kind": "event", "event": event_b64(event), "fd": fd is not None, "ttl_s": self._stream.lease_ttl_s,
                   "member_id": self._stream.member_id}, fd)
        if fd is not None:
            spare.close()  # the worker holds its own copy now
        self._share_state()

    def _close(self, *, leave: bool) -> None:
        """(Under the mutex.) The membership is over for this host (or moves to another hub)."""
        if self._closed:
            return
        self._closed = True
        self._stream.close(leave=leave, wait=False)
        self._retire()
        if self._spare is not None:
            self._spare.close()

    def _retire(self) -> None:
        """(Under the mutex.) Takes no more workers: the link's socket and lock go (the lock last, so that
        the next hub's socket is never the one unlinked here); the workers it has keep their links."""
        if self._lock_fd < 0:
            return
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept() (a close alone does not, on Linux)
        with contextlib.suppress(OSError):
            self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        os.close(self._lock_fd)  # a later membership's first worker takes it
        self._lock_fd = -1

    def close(self) -> None:
        with self._mutex:
            self._close(leave=False)


def _disagreement(key: str, theirs: dict, ours: dict, request: pb.JoinRequest) -> dict:
    """The refusal a worker gets whose job differs from its host's: as the server would say it."""
    if key == "job_secret":
        return {"code": "PERMISSION_DENIED", "reason": "JOB_SEALED",
                "details": f"job {request.job_id!r} is sealed: this join's job_secret is missing or wrong "
                           f"(another worker of this host joined it with another)"}
    if key == "token":
        return {"code": "UNAUTHENTICATED", "reason": "UNAUTHENTICATED_CALLER",
                "details": "this worker's token differs from the one its host's other workers joined with"}
    if key == "spec":
        asked = pb.JobSpec.FromString(base64.b64decode(theirs.get("spec") or ""))
        if asked.world_size != request.spec.world_size:  # the difference people make most: said as the server says it
            return {"code": "FAILED_PRECONDITION", "reason": "JOB_CONFLICT",
                    "details": f"job {request.job_id!r} has world_size={request.spec.world_size} but this worker asked "
                               f"for world_size={asked.world_size} (on host {request.node_key!r}, whose workers joined "
                               f"it first); every worker of a job passes the same"}
    what = {"job_id": "job", "spec": "spec (layout, roles, groups or elastic sizes)", "address": "advertised address",
            "node_rank": "node_rank"}[key]
    return {"code": "FAILED_PRECONDITION", "reason": "JOB_CONFLICT",
            "details": f"job {request.job_id!r}: this worker's {what} differs from that of the workers of host "
                       f"{request.node_key!r} that joined it first; every worker of a job passes the same"}
