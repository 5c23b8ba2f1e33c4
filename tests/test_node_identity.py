"""A host is who it is: the default node key is the hostname and a digest of
the machine id, so two hosts of one name stay two nodes; a default key that
arrives from two machines (a cloned image: same hostname, same machine id,
another boot) is refused naming both addresses. Each "machine" is a worker
process in mount and UTS namespaces of its own (unshare): its own hostname,
/etc/machine-id and boot id, bind-mounted; real joins, a real gloo all_reduce."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import grpc
import pytest

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server
from .conftest import wait_until

WORKER = """
import json, sys
import torch, torch.distributed as dist
from commctx import CommContext, CommCtxError
server, address = sys.argv[1], sys.argv[2]
try:
    ctx = CommContext.join(server, job_id="twins", world_size=2, advertise_addr=address, timeout=60)
except CommCtxError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
    sys.exit(3)
x = torch.tensor([float(ctx.get_global_rank() + 1)])
dist.all_reduce(x)
a = ctx.assignment
print(json.dumps({"rank": a.rank, "node_rank": a.node_rank, "local_rank": a.local_rank, "sum": x.item(),
                  "intra": ctx.get_ranks_in_group("INTRA_NODE")}), flush=True)
ctx.destroy()
"""


def machine(tmp_path, name: str, hostname: str, machine_id: str, boot_id: str, server: str, address: str) -> subprocess.Popen:
    """A worker on a "machine" of its own: its hostname, machine id and boot id, and a runtime directory of its
    own, short enough for a Unix socket's path (two machines never share the socket by which one host's workers
    share a membership; a long one would fall back to the /tmp all these "machines" share)."""
    root = tmp_path / name
    root.mkdir()
    (root / "machine-id").write_text(machine_id + "\n")
    (root / "boot_id").write_text(boot_id + "\n")
    run = tempfile.mkdtemp(prefix="cx-", dir="/tmp")
    RUNTIME_DIRS.append(run)
    script = (f"hostname {hostname} && mount --bind {root / 'machine-id'} /etc/machine-id && "
              f"mount --bind {root / 'boot_id'} /proc/sys/kernel/random/boot_id && exec \"$@\"")
    env = {**os.environ, "XDG_RUNTIME_DIR": run, "COMMCTX_PROGRESS_S": "0"}
    return subprocess.Popen(["unshare", "--mount", "--uts", "sh", "-c", script, "sh", sys.executable, "-c", WORKER, server,
                             address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=90)
    assert out.strip(), err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare (mount namespaces)")
def test_two_hosts_of_one_name_are_two_nodes_and_a_cloned_one_is_refused(tmp_path):
    server = Server("127.0.0.1")
    try:
        a = machine(tmp_path, "a", "gpu", "a" * 32, "11111111-0000-0000-0000-000000000000", server.address, "127.0.0.2")
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.RendezvousStub(ch)
            wait_until(lambda: _joined(stub) == 1, 60, "the first machine's worker waits")
            clone = machine(tmp_path, "clone", "gpu", "a" * 32, "22222222-0000-0000-0000-000000000000", server.address,
                            "127.0.0.3")
            refused = result(clone)
            assert clone.returncode == 3 and refused["error"] == "JobConflict", refused
            assert "arrives from two machines: a worker at 127.0.0.2 joined under it, and this one at 127.0.0.3" in refused[
                "message"], refused
            b = machine(tmp_path, "b", "gpu", "b" * 32, "33333333-0000-0000-0000-000000000000", server.address, "127.0.0.4")
            ra, rb = result(a), result(b)
            d = stub.DescribeJob(pb.DescribeJobRequest(job_id="twins"), timeout=5)
        assert sorted((r["node_rank"], r["local_rank"], r["intra"]) for r in (ra, rb)) == [(0, 0, [0]), (1, 0, [1])]
        assert ra["sum"] == rb["sum"] == 3.0  # ranks 0 and 1: one all_reduce across the two "machines"
        keys = sorted(n.node_key for n in d.nodes)
        assert len(keys) == 2 and all(k.startswith("gpu_") for k in keys) and keys[0] != keys[1], keys
        assert sorted(n.address for n in d.nodes) == ["127.0.0.2", "127.0.0.4"]
    finally:
        server.stop()
        while RUNTIME_DIRS:
            shutil.rmtree(RUNTIME_DIRS.pop(), ignore_errors=True)


RUNTIME_DIRS: list[str] = []


def _joined(stub) -> int:
    try:
        return stub.DescribeJob(pb.DescribeJobRequest(job_id="twins"), timeout=5).joined
    except grpc.RpcError:
        return 0
