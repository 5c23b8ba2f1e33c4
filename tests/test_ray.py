"""Ray: examples/ray_rl.py's driver starts two fake nodes of one trainer and two
rollout actors each against a real commctx-server; they join with roles and a
spec, all_reduce over TRAIN_DATA_PARALLEL and broadcast over WEIGHT_TRANSFER."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import grpc
import psutil
import pytest

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import PYTHON_EXEC, Server, forked_workers
from .conftest import wait_until

# A guard only (the test extra installs commctx[ray]); found, not imported: every xdist worker imports this module.
pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="no ray")]

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "ray_rl.py"


def forked_actors() -> dict[str, str]:
    """The driver's environment in which Ray starts its worker processes as a job
    submitted with `--runtime-env-json '{"py_executable": ...}'` would have them
    started: through tests/python_exec.py, forked by the tests' zygote, torch
    imported already, instead of six fresh interpreters importing it."""
    job = {"runtime_env": {"py_executable": PYTHON_EXEC}}
    return {**forked_workers(), "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.slow(16)
def test_trainers_and_rollouts_as_ray_actors():
    env = {**os.environ, **forked_actors(), "RAY_DISABLE_USAGE_STATS": "1"}  # the zygote up first: it is no process of Ray's
    before = descendants()
    server = Server("127.0.0.1")
    try:
        # The driver as its own process, as docs/guides/ray.md runs it: Ray then starts its
        # processes from a clean one, not from this one's gRPC threads.
        driver = subprocess.run([sys.executable, str(EXAMPLE), "--server", server.address, "--job", "ray-rl",
                                 "--timeout", "90", "--json"], capture_output=True, text=True, timeout=170,
                                env=env)
        assert driver.returncode == 0, driver.stderr[-4000:]
        reports = json.loads(driver.stdout.strip().splitlines()[-1])

        # Who is who: returned in the driver's order, node0's three then node1's.
        assert [(r["node_key"], r["role"]) for r in reports] == [
            (n, role) for n in ("node0", "node1") for role in ("trainer", "rollout", "rollout")
        ]
        assert sorted(r["rank"] for r in reports) == list(range(6))
        assert len({r["pid"] for r in reports}) == 6  # six processes, one CommContext each
        node = {"node0": [0, 1, 2], "node1": [3, 4, 5]}  # node ranks follow the node keys
        trainer = {}
        for r in reports:
            assert r["node_rank"] == int(r["node_key"][-1])
            assert r["rank"] in node[r["node_key"]]
            assert r["local_rank"] == node[r["node_key"]].index(r["rank"])
            if r["role"] == "trainer":
                trainer[r["node_key"]] = r["rank"]
        trainers = sorted(trainer.values())

        for r in reports:
            mine = node[r["node_key"]]
            expected = {"GLOBAL": list(range(6)), "INTRA_NODE": mine,
                        "INTER_NODE": [node["node0"][r["local_rank"]], node["node1"][r["local_rank"]]],
                        "WEIGHT_TRANSFER": mine}  # the node's trainer and its two rollout workers
            if r["role"] == "trainer":
                expected["TRAIN_DATA_PARALLEL"] = trainers
            assert r["groups"] == expected, r
            # the sender, the root of the broadcast, is this node's trainer
            assert r["roots"] == {"WEIGHT_TRANSFER": trainer[r["node_key"]]}, r
            assert r["destroyed"]

        sent = {}
        for r in reports:
            if r["role"] == "trainer":
                total = float(sum(t + 1 for t in trainers))
                assert r["reduced"] == [total] * 4
                assert r["sent"] == [total + 1000.0 * (r["rank"] + 1)] * 4
                sent[r["node_key"]] = r["sent"]
        assert sent["node0"] != sent["node1"]  # so that a rollout in the wrong group would show
        for r in reports:
            if r["role"] == "rollout":
                assert r["received"] == sent[r["node_key"]], r

        # Every actor left: the run has ended, kept with who took part, and nobody is in it.
        with grpc.insecure_channel(server.address) as ch:
            ended = pb_grpc.RendezvousStub(ch).DescribeJob(pb.DescribeJobRequest(job_id="ray-rl"), timeout=5)
            assert (ended.state, ended.run, ended.ended_at > 0) == (pb.JobDescription.ENDED, 1, True), ended
            listed = pb_grpc.RendezvousStub(ch).ListJobs(pb.ListJobsRequest(), timeout=5)
            assert [j.job_id for j in listed.jobs] == []  # no run under way
    finally:
        server.stop()

    # Ray's processes (GCS, raylet, workers) and the server are gone.
    def left() -> set[int]:
        return descendants() - before

    wait_until(lambda: not left(), 20, lambda: [psutil.Process(p).cmdline() for p in left() if psutil.pid_exists(p)],
               interval_s=0.2)
