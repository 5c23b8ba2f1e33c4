"""What an answer leaves in the server's memory: RSS growth per call over a
long run of one kind of call, after a warm-up. An error answer must cost no
more than a successful one (a client retrying against a refusal must not
grow the server). One client connection, 4 calls in flight; the server is
`commctx-server --store memory --max-jobs 1` holding one forming job.

    python benchmarks/error_rss.py
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import commctx_server, memory_kib

CALLS, WARMUP, IN_FLIGHT = 50_000, 5_000, 4


def join(job: str, node: str, wait_ms: int) -> pb.JoinRequest:
    return pb.JoinRequest(job_id=job, spec=pb.JobSpec(world_size=2), node_key=node, address="127.0.0.1",
                          master_port=29500, wait_timeout_ms=wait_ms)


async def measure(address: str, pid: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub, health = pb_grpc.RendezvousStub(channel), health_pb2_grpc.HealthStub(channel)
        held = asyncio.ensure_future(stub.Join(join("held", "n0", 3_600_000)))  # the one job --max-jobs allows
        await asyncio.sleep(1.0)
        calls = {
            "DescribeJob, unknown job (NOT_FOUND)": lambda: stub.DescribeJob(pb.DescribeJobRequest(job_id="nope")),
            "Join of a second job (RESOURCE_EXHAUSTED)": lambda: stub.Join(join("other", "n1", 1000)),
            "DescribeJob of the held job (OK)": lambda: stub.DescribeJob(pb.DescribeJobRequest(job_id="held")),
            "health Check (OK)": lambda: health.Check(health_pb2.HealthCheckRequest()),
        }
        for name, call in calls.items():
            codes: dict[str, int] = {}

            async def worker(n: int) -> None:
                for _ in range(n):
                    try:
                        await call()
                        code = "OK"
                    except grpc.aio.AioRpcError as exc:
                        code = exc.code().name
                    codes[code] = codes.get(code, 0) + 1

            await asyncio.gather(*(worker(WARMUP // IN_FLIGHT) for _ in range(IN_FLIGHT)))
            await asyncio.sleep(2)
            codes.clear()
            before, t = memory_kib(pid)["VmRSS"], time.monotonic()
            await asyncio.gather(*(worker(CALLS // IN_FLIGHT) for _ in range(IN_FLIGHT)))
            rate = CALLS / (time.monotonic() - t)
            await asyncio.sleep(5)
            after = memory_kib(pid)["VmRSS"]
            print(f"{name:42} {(after - before) * 1024 / CALLS:6.1f} B/call  ({rate:,.0f} calls/s; {codes})", flush=True)
        held.cancel()


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"# {CALLS:,} calls of each kind after {WARMUP:,} to warm up; RSS growth over them, 5 s after the last")
    with commctx_server("--store", "memory", "--max-jobs", "1") as server:
        asyncio.run(measure(server.address, server.proc.pid))


if __name__ == "__main__":
    main()
