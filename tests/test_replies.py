"""Replies stay bounded however big a job is: DescribeJob pages a job's nodes,
ListJobs leaves them out, and `commctx status` reads a 100,000-member job.

The big job is entered through the server's own state machine (100,000 gRPC
Joins would take this test a minute); everything read back goes over gRPC."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import time

import grpc
import pytest

from commctx.server.rendezvous.params import JoinParams
from commctx.common.planning import JobSpec
from commctx.v1 import rendezvous_pb2 as pb

from .conftest import eventually, join_request

BIG = 100_000


def fill(server, job_id: str, members: int, key: str = "host{}") -> None:
    """`members` workers, one per node, joined as a Join would (without waiting in one).
    Automatic collection is off from here to the end of the test (`_collecting`), as
    the server's GC pacer keeps it under load (a loop without an await gives the
    pacer no turn, and this test runs no pacer): each full collection would scan
    every object of this test process, seconds over 100,000 joins and what reads them."""
    spec = JobSpec.build(world_size=members)
    gc.disable()
    for i in range(members):
        _, actions, _ = server.machine.join(JoinParams.build(
            job_id=job_id, spec=spec, node_key=key.format(i), address=f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", port=29500))
        server.executor.submit(actions)


@pytest.fixture(autouse=True)
def _collecting():
    """Automatic collection is back on after each test (fill() turns it off)."""
    yield
    gc.enable()


async def test_describe_job_pages_nodes_in_node_rank_order(server, stub):
    fill(server, "wide", 25)
    await eventually(lambda: server.machine.describe("wide").state.name == "FORMED", what="the world forms")
    seen, token, pages = [], "", 0
    while True:
        d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="wide", node_page_size=10, node_page_token=token))
        assert (d.num_nodes, d.joined, d.generation) == (25, 25, 1) and len(d.nodes) <= 10
        seen += [(n.node_rank, n.node_key, n.workers) for n in d.nodes]
        pages, token = pages + 1, d.next_node_page_token
        if not token:
            break
    assert pages == 3 and [r for r, _, _ in seen] == list(range(25))  # every node once, in node-rank order
    assert sorted(k for _, k, _ in seen) == sorted(f"host{i}" for i in range(25)) and {w for _, _, w in seen} == {1}

    listed = (await stub.ListJobs(pb.ListJobsRequest())).jobs
    assert [(j.job_id, j.num_nodes, len(j.nodes)) for j in listed] == [("wide", 25, 0)]

    for bad, what in ((pb.DescribeJobRequest(job_id="wide", node_page_size=10_001), "node_page_size 10001"),
                      (pb.DescribeJobRequest(job_id="wide", node_page_token="-1"), "node_page_token '-1'"),
                      (pb.DescribeJobRequest(job_id="wide", node_page_token="x" * 5000), "node_page_token 'xxx")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.DescribeJob(bad)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and what in err.value.details()
        assert len(err.value.details()) < 300


async def test_a_page_of_long_node_keys_is_cut_to_a_mebibyte(server, stub):
    fill(server, "long", 5000, "n{:0>250}")  # 5,000 nodes of ~270 bytes: 1.3 MB in one page of 10,000
    await eventually(lambda: server.machine.describe("long").state.name == "FORMED", what="the world forms")
    ranks, token, sizes = [], "", []
    while True:
        d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="long", node_page_size=10_000, node_page_token=token))
        sizes.append(d.ByteSize())
        ranks += [n.node_rank for n in d.nodes]
        token = d.next_node_page_token
        if not token:
            break
    assert len(sizes) == 2 and max(sizes) <= 1 << 20 and ranks == list(range(5000))


@pytest.mark.slow(23)
async def test_status_reads_a_job_of_100k_members(server, stub):
    started = time.monotonic()
    fill(server, "huge", BIG)
    await eventually(lambda: server.machine.describe("huge", max_nodes=0).state.name == "FORMED", timeout_s=120, what="100k world")
    filled = time.monotonic() - started

    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="huge"))
    assert (d.joined, d.num_nodes, len(d.nodes), d.next_node_page_token) == (BIG, BIG, 1000, "1000")
    assert d.ByteSize() < 100_000  # a page of 1,000 nodes; gRPC refuses replies over 4 MiB

    args = ["commctx", "status", "--addr", f"127.0.0.1:{server.port}", "--job", "huge"]
    shown = await asyncio.to_thread(subprocess.run, args, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"job huge (run 1): formed, generation 1, {BIG} of {BIG} workers joined")
    assert lines[-1] == f"... {BIG - 1000} more nodes (--nodes 0 lists them all)"
    every = await asyncio.to_thread(subprocess.run, [*args, "--nodes", "0"], capture_output=True, text=True, timeout=60)
    assert every.returncode == 0, every.stderr
    rows = [line.split() for line in every.stdout.splitlines()[2:]]
    assert len(rows) == BIG and [int(r[0]) for r in rows] == list(range(BIG))
    table = await asyncio.to_thread(subprocess.run, args[:4], capture_output=True, text=True, timeout=60)
    assert table.stdout.splitlines()[1].split()[:7] == ["huge", "1", "formed", "1", f"{BIG}/{BIG}", "0", str(BIG)]

    # A healthy small job beside it is served as usual.
    small = await stub.Join(join_request("small", 1))
    assert small.assignment.world_size == 1
    print(f"100k members entered and formed in {filled:.1f} s")
