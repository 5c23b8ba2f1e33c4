"""What a waiting worker (or torchrun agent) says while it waits for its world.

`say` logs on the `commctx` logger; when the application has configured no
logging at all (the root logger has no handler), the line is printed on stderr
instead, so that it shows by default without commctx configuring anyone's
logging. `Progress` is the background thread that, while a Join waits, asks
the server who is missing (DescribeJob) and says so every `every_s` seconds.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable

import grpc

from commctx.v1 import rendezvous_pb2 as pb

log = logging.getLogger("commctx")

DEFAULT_EVERY_S = 10.0


def say(message: str, *args: object) -> None:
    """An INFO line on the `commctx` logger, or on stderr when nothing is configured to show it."""
    if log.isEnabledFor(logging.INFO) or logging.getLogger().handlers:
        log.info(message, *args)  # the application's logging decides
    else:
        print("commctx: " + (message % args if args else message), file=sys.stderr, flush=True)


def describe_wait(job_id: str, d: pb.JobDescription, nodes_wanted: tuple[int, int] | None = None) -> str:
    """One line on a job that has not formed: how many are there of how many,
    on which nodes, how many are missing, and the joins it refused.

    `nodes_wanted` (min, max) counts nodes instead of workers (a torchrun agent's view)."""
    if d.state == pb.JobDescription.FORMING and not d.not_ready:
        nodes = ", ".join(f"{n.node_key}×{n.workers}" for n in d.nodes)
        if d.num_nodes > len(d.nodes):
            nodes += f", ... ({d.num_nodes} nodes)"
        if nodes_wanted is not None:
            low, high = nodes_wanted
            what = f"{d.num_nodes} of {low if low == high else f'{low} to {high}'} nodes ({nodes or 'none'})"
            if d.num_nodes < low:
                what += f"; {low - d.num_nodes} missing"
            elif low < high:
                what += "; the minimum is here: waiting for the last call"
            return what_refused(f"waiting for job {job_id!r}: {what}", d)
        else:
            what = f"{d.joined} of {d.spec.world_size} workers (nodes: {nodes or 'none'})"
        if d.missing:
            what += f"; {d.missing} missing" + (f" for the minimum of {d.spec.elastic.min_size}" if d.spec.HasField("elastic") else "")
        elif d.spec.HasField("elastic"):
            what += "; the minimum is here: waiting for the last call"
    else:
        what = d.reason
    return what_refused(f"waiting for job {job_id!r}: {what}", d)


def what_refused(line: str, d: pb.JobDescription) -> str:
    if d.refused:
        line += f"; {d.refused} join{'s' * (d.refused != 1)} refused: {d.last_refused}"
    return line


class Progress:
    """While started, says every `every_s` seconds what the Join of `request` waits for.

    `ask(request, timeout_s)` is a DescribeJob call to the leader. Stop with
    `stop()` (idempotent); the thread is joined.
    """

    def __init__(self, ask: Callable[[pb.DescribeJobRequest, float], pb.JobDescription], job_id: str, job_secret: str,
                 every_s: float, line: Callable[[str, pb.JobDescription], str] = describe_wait) -> None:
        self._ask = ask
        self._request = pb.DescribeJobRequest(job_id=job_id, job_secret=job_secret, node_page_size=8)
        self._every_s = every_s
        self._line = line
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Progress:
        if self._every_s > 0:
            self._thread = threading.Thread(target=self._run, name="commctx-progress", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                description = self._ask(self._request, min(5.0, self._every_s))
            except grpc.RpcError:
                continue  # the join itself says when the server cannot be reached
            if not self._stop.is_set() and description.state != pb.JobDescription.FORMED:
                say("%s", self._line(self._request.job_id, description))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def __enter__(self) -> Progress:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
