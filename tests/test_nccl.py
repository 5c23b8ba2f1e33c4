"""The NCCL path, on a machine with a CUDA GPU; skipped without one (CI has none).

Two workers, each a node of its own with one GPU, the way two single-GPU hosts
would run a job, on this machine's one GPU: NCCL refuses two ranks of one host
on one device, so each worker has a host identity of its own (NCCL_HOSTID), and
NCCL joins them through its network transport, as it joins two hosts. The rest
is the real path: backend 'auto' is NCCL, each worker's device comes from its
local rank, NCCL's interface follows the advertised address, every group reduces
CUDA tensors and its gloo twin CPU ones, and a dead peer hangs neither the
survivor's world-change event nor its destroy (NCCL is aborted, not waited on).
"""

from __future__ import annotations

import pytest
import torch

from .cluster import Server, running, worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")

TTL = 4.0
SINGLE = ("TENSOR_PARALLEL", "PIPELINE_PARALLEL", "SEQUENCE_PARALLEL", "EXPERT")  # tp = pp = sp = ep = 1


def test_two_single_gpu_nodes_run_nccl_and_survive_a_dead_peer():
    spec = {"layout": {"tp": 1}, "cpu_twins": ["DATA_PARALLEL"], "elastic": {"min_size": 2, "last_call_ms": 10_000}}
    server = Server("127.0.0.1", "--lease-ttl-s", str(TTL))
    workers = [worker(server.address, "gpu", 2, node_key=f"gpu-node-{i}", name=f"gpu{i}", spec=spec,
                      env={"NCCL_HOSTID": f"commctx-gpu-node-{i}", "CUDA_VISIBLE_DEVICES": "0"}) for i in range(2)]
    with running([server, *workers]):
        results = sorted((w.event(180) for w in workers), key=lambda r: r["rank"])
        for rank, r in enumerate(results):
            assert (r["rank"], r["node_rank"], r["num_nodes"], r["in_node_rank"], r["local_world_size"]) == (rank, rank, 2, 0, 1)
            assert r["backend"] == "nccl"
            assert r["env"]["NCCL_SOCKET_IFNAME"] == "lo" and r["env"]["LOCAL_RANK"] == "0"
            assert r["groups"] == {"GLOBAL": [0, 1], "INTRA_NODE": [rank], "INTER_NODE": [0, 1], "DATA_PARALLEL": [0, 1],
                                   "DATA_PARALLEL_CPU": [0, 1], **{m: [rank] for m in SINGLE}}
            assert r["group_backends"] == {**{m: "nccl" for m in r["groups"]}, "DATA_PARALLEL_CPU": "gloo"}
            assert r["sums"] == {"GLOBAL": 3.0, "INTRA_NODE": rank + 1.0, "INTER_NODE": 3.0, "DATA_PARALLEL": 3.0,
                                 "DATA_PARALLEL_CPU": 3.0, **{m: rank + 1.0 for m in SINGLE}}
        survivor, dead = workers
        dead.kill()
        survivor.send("ended")
        ended = survivor.event(TTL + 30)
        assert ended["final"] and "session closed without leave" in ended["reason"], ended
        survivor.send("destroy")
        done = survivor.event(60)  # NCCL is aborted: without it, destroy could wait on the dead peer
        assert done["event"] == "destroyed" and done["fresh"] and not done["initialized"], done
        assert survivor.popen.wait(30) == 0
