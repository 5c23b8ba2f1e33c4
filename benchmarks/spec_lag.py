"""How long the largest spec the default limits admit holds the server's event
loop: three bursts of Joins of 20 jobs, each with its own spec of 1,024 named-group rules
(just under --max-spec-rules and --max-spec-bytes, so none is in the spec
cache), sent at once over one connection; each Join's wait ends after 1 ms
(DEADLINE_EXCEEDED: who is missing). Reported: the server's own worst
event-loop lag (commctx_event_loop_lag_max_seconds: the lateness of a 50 ms
timer) over the burst, and the Joins' latencies. Server unpinned.

    python benchmarks/spec_lag.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import commctx_server, scrape

JOBS = 20
RULES = 1024


def spec(job: int) -> pb.JobSpec:
    s = pb.JobSpec(world_size=RULES)
    s.groups.extend(pb.GroupRule(mode=f"J{job}G{i}", named=pb.NamedGroups(groups=[pb.RankList(ranks=[i])])) for i in range(RULES))
    return s


async def burst(address: str, first: int) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        requests = [pb.JoinRequest(job_id=f"big{j}", spec=spec(j), node_key="n0", address="127.0.0.1", master_port=29500,
                                   wait_timeout_ms=1) for j in range(first, first + JOBS)]
        assert all(r.spec.ByteSize() < 64 * 1024 for r in requests), requests[0].spec.ByteSize()

        async def one(r: pb.JoinRequest) -> float:
            t = time.perf_counter()
            try:
                await stub.Join(r, timeout=30)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, exc
            return time.perf_counter() - t

        return await asyncio.gather(*(one(r) for r in requests))


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    size = spec(0).ByteSize()
    print(f"# {JOBS} Joins at once, each with its own spec of {RULES} rules ({size:,} bytes); commctx-server --store memory;")
    print("# 3 bursts, 12 s apart (the lag gauge covers the last 10 s); 'idle' is the gauge just before each burst")
    with commctx_server("--store", "memory", metrics=True) as server:
        for n in range(3):
            time.sleep(12)
            before = scrape(server.metrics_url)["commctx_event_loop_lag_max_seconds"]
            latencies = asyncio.run(burst(server.address, n * JOBS))  # specs never seen before
            worst = scrape(server.metrics_url)["commctx_event_loop_lag_max_seconds"]
            print(f"worst event-loop lag {worst * 1000:5.1f} ms (idle {before * 1000:4.1f} ms); "
                  f"Join latency median {statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
