"""One tenant floods the server; what does another tenant's Join cost meanwhile?

A `commctx-server` (its own process, unpinned, memory store) with
--auth-tokens holding two user tokens, A and B, and small limits so that A
reaches its share quickly: --max-jobs, --max-members and --max-streams 400,
--caller-share 0.25 (A may hold 100 of each). For each flood, token A first
takes its whole share, then two load processes (one connection each) go on
hammering the server with A's calls, which are refused; meanwhile this
process times token B's jobs: a 2-worker job, two Joins on two connections,
from the first Join sent to both answered, `--samples` times in a row.

    none      no flood: B's baseline
    jobs      A holds 100 jobs (one held Join each) and keeps asking for more
    waiting   A holds 100 Joins waiting in one job and keeps adding more
    streams   A holds 100 WatchEvents streams and keeps opening more
    guessing  A keeps describing B's sealed job with wrong job secrets (throttled after 10)

Printed: B's join latency per flood, median and 95th percentile (ms), and how
many of A's calls the server answered meanwhile (all refused but the share).

    python benchmarks/tenant_flood.py [--samples 40]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

A, B = "tenant-a-token-0123456789", "tenant-b-token-0123456789"
SECRET = "tenant-b-secret-0123456789"
SHARE = 100


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


def request(job: str, world: int, node: str, port: int, **kw):
    from commctx.v1 import rendezvous_pb2 as pb

    return pb.JoinRequest(job_id=job, spec=pb.JobSpec(world_size=world), node_key=node, address="127.0.0.1",
                          master_port=port, wait_timeout_ms=600_000, **kw)


def hammer(address: str, flood: str, stop, counts) -> None:
    """One load process: A's refused calls of `flood`, as fast as they are answered, until `stop`."""
    import grpc

    from commctx.v1 import rendezvous_pb2 as pb
    from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        i = 0
        while not stop.is_set():
            i += 1
            try:
                if flood == "jobs":
                    stub.Join(request(f"a-more-{os.getpid()}-{i}", 2, "n", 9), metadata=bearer(A), timeout=5)
                elif flood == "waiting":
                    stub.Join(request("a-wait", 10_000, f"m{os.getpid()}-{i}", 9), metadata=bearer(A), timeout=5)
                elif flood == "streams":
                    next(stub.WatchEvents(pb.WatchEventsRequest(job_id="a-watched"), metadata=bearer(A), timeout=5))
                else:
                    stub.DescribeJob(pb.DescribeJobRequest(job_id="b-sealed", job_secret=f"guess-{i:012d}-xx"),
                                     metadata=bearer(A), timeout=5)
            except grpc.RpcError:
                pass
            counts.value += 1


def take_share(stub, flood: str) -> list:
    """A's whole share of what `flood` floods, held: the calls (futures or streams) to cancel after."""
    from commctx.v1 import rendezvous_pb2 as pb

    held = []
    if flood == "jobs":
        held = [stub.Join.future(request(f"a-held-{i}", 2, "n", 9), metadata=bearer(A)) for i in range(SHARE)]
    elif flood == "waiting":
        held = [stub.Join.future(request("a-wait", 10_000, f"w{i}", 9), metadata=bearer(A)) for i in range(SHARE)]
    elif flood == "streams":
        stub.Join(request("a-watched", 1, "n", 9), metadata=bearer(A))
        for _ in range(SHARE):
            stream = stub.WatchEvents(pb.WatchEventsRequest(job_id="a-watched"), metadata=bearer(A))
            next(stream)
            held.append(stream)
    time.sleep(0.5)  # the held Joins reach the server (a benchmark's settling pause, not a condition)
    return held


def b_latency(address: str, samples: int, start: int) -> list[float]:
    """Seconds from B's first Join of a 2-worker job to both answered, `samples` times."""
    import grpc

    from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

    out = []
    with grpc.insecure_channel(address) as c1, grpc.insecure_channel(address) as c2:
        s1, s2 = pb_grpc.RendezvousStub(c1), pb_grpc.RendezvousStub(c2)
        for i in range(start, start + samples):
            began = time.perf_counter()
            first = s1.Join.future(request(f"b-{i}", 2, "b1", 9), metadata=bearer(B), timeout=30)
            s2.Join(request(f"b-{i}", 2, "b2", 10), metadata=bearer(B), timeout=30)
            first.result()
            out.append(time.perf_counter() - began)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=40, help="B's jobs timed per flood (default 40)")
    args = p.parse_args()
    import grpc

    from commctx.v1 import rendezvous_pb2_grpc as pb_grpc
    from harness import commctx_server

    tokens = tempfile.NamedTemporaryFile("w", suffix=".tokens", delete=False)
    tokens.write(f"{A}\n{B}\n")
    tokens.close()
    flags = ["--store", "memory", "--auth-tokens", tokens.name, "--max-jobs", "400", "--max-members", "400",
             "--max-streams", "400", "--caller-share", "0.25", "--log-level", "warning"]
    ctx = mp.get_context("spawn")
    print("B's 2-worker job, from its first Join to both answered, while A floods (ms): median, 95th percentile; "
          "A's calls answered meanwhile")
    try:
        for n, flood in enumerate(("none", "jobs", "waiting", "streams", "guessing")):
            with commctx_server(*flags) as server:
                address = f"127.0.0.1:{server.port}"
                with grpc.insecure_channel(address) as channel:
                    stub = pb_grpc.RendezvousStub(channel)
                    held = take_share(stub, flood) if flood != "none" else []
                    if flood == "guessing":  # B's sealed job, which A guesses at
                        held.append(stub.Join.future(request("b-sealed", 2, "s", 9, job_secret=SECRET), metadata=bearer(B)))
                    stop, counts = ctx.Event(), [ctx.Value("l", 0) for _ in range(2)]
                    loads = [ctx.Process(target=hammer, args=(address, flood, stop, c), daemon=True) for c in counts] \
                        if flood != "none" else []
                    for proc in loads:
                        proc.start()
                    time.sleep(1.0 if loads else 0)  # the flood under way before the clock starts
                    times = b_latency(address, args.samples, 1000 * n)
                    stop.set()
                    for proc in loads:
                        proc.join(30)
                    for call in held:
                        call.cancel()
                ms = sorted(t * 1000 for t in times)
                print(f"  {flood:<9} {statistics.median(ms):7.1f} {ms[int(len(ms) * 0.95) - 1]:7.1f}   "
                      f"{sum(c.value for c in counts) if loads else 0:,} calls", flush=True)
    finally:
        os.unlink(tokens.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
