"""Partitions on real network namespaces (benchmarks/chaos.py's cluster: etcd
members and replicas each on a host of their own), one scenario per bug the
chaos runs found.

A leader replica whose etcd member loses its quorum: etcd's leader keeps
granting lease renewals until it notices (its election timeout, 1 s), so a
replica that trusted a renewal alone went on answering as leader for up to
that long past its own bound (last renewal confirmed + E - margin). The
replica now trusts a renewal only once a linearizable read, which needs the
quorum, has come back after it."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest

from benchmarks import chaos
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import netns_available
from .etcd import etcd_binary
from .waiting import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[1]
WHY_NOT = netns_available() or (None if etcd_binary() else "no etcd binary")
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""), pytest.mark.timeout(120)]


def etcd_leader(cluster: chaos.Cluster) -> str:
    """The etcd member (e0-e2) that leads etcd's raft now."""
    ctl = os.path.join(os.path.dirname(etcd_binary()), "etcdctl")
    out = subprocess.run([ctl, "--endpoints", cluster.endpoints, "endpoint", "status", "-w", "json"],
                         capture_output=True, text=True, timeout=20, check=True).stdout
    status = json.loads(out)
    leader = status[0]["Status"]["leader"]
    return next(chaos.ETCDS[i] for i, s in enumerate(status) if s["Status"]["header"]["member_id"] == leader)


def test_a_leader_whose_etcd_member_lost_its_quorum_stops_answering_within_its_bound(tmp_path: pathlib.Path):
    cluster = chaos.Cluster(tmp_path)
    try:
        for host in (*chaos.ETCDS, "r0"):
            cluster.start(host)
        address = f"{cluster.ip['r0']}:{chaos.PORT}"
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.RendezvousStub(channel)

            def answered() -> bool:  # NOT_FOUND is the leader's answer; a replica that does not lead says UNAVAILABLE
                try:
                    stub.DescribeJob(pb.DescribeJobRequest(job_id="none"), timeout=1)
                except grpc.RpcError as err:
                    return err.code() is grpc.StatusCode.NOT_FOUND
                return True

            wait_until(answered, 60, "r0 leads")
            wait_until(lambda: etcd_leader(cluster), 30, "etcd has a leader")
            leader = etcd_leader(cluster)
            near, far = [e for e in chaos.ETCDS if e != leader]
            time.sleep(1.5)  # the scenario: a steady leader, renewing every E/3, before the cut
            # etcd's leader loses its quorum without knowing: `far` is gone, and `near` hears nothing from
            # it but still reaches it (its pre-votes keep the leader's quorum check content); r0 reaches
            # only the leader.
            cut = time.monotonic()
            subprocess.run(["ip", "link", "set", cluster.veth[far], "down"], check=True)
            cluster.sh(near, "iptables", "-w", "-A", "INPUT", "-s", cluster.ip[leader], "-j", "DROP")
            cluster.sh("r0", "iptables", "-w", "-A", "OUTPUT", "-d", cluster.ip[near], "-j", "DROP")
            last = cut
            while time.monotonic() < cut + chaos.ELECTION_TTL_S + 4:
                if answered():
                    last = time.monotonic()
            subprocess.run(["ip", "link", "set", cluster.veth[far], "up"], check=True)
            cluster.sh(near, "iptables", "-w", "-D", "INPUT", "-s", cluster.ip[leader], "-j", "DROP")
            cluster.sh("r0", "iptables", "-w", "-D", "OUTPUT", "-d", cluster.ip[near], "-j", "DROP")
            margin = min(1.0, chaos.ELECTION_TTL_S / 5)
            # Its last renewal confirmed with the quorum came before the cut: it stops by cut + E - margin
            # (and the calls' own time); trusting the stale etcd leader's renewals, it went on up to 1 s longer.
            assert last - cut < chaos.ELECTION_TTL_S - margin + 0.3, f"answered as leader {last - cut:.2f} s after the cut"
            wait_until(answered, 60, "r0 leads again once etcd has its quorum back")
    finally:
        cluster.close()


def test_an_interrupted_chaos_run_leaves_nothing_behind(tmp_path: pathlib.Path):
    """benchmarks/chaos.py stopped by SIGINT mid-run removes its namespaces, bridge and processes."""
    keep = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--seed", "3", "--duration-s", "60",
                             "--keep", str(keep)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: (keep / "plan.json").exists() or proc.poll() is not None, 90, "the run's workload starts")
        assert proc.poll() is None, proc.stdout.read()
        made = json.loads((keep / "hosts.json").read_text())
        time.sleep(3)  # the scenario: a few faults in, then the interrupt
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "interrupted (SIGINT)" in out, out[-2000:]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for ns in made["namespaces"] if ns in namespaces.split()]
    assert subprocess.run(["ip", "link", "show", made["bridge"]], capture_output=True).returncode != 0
    left = subprocess.run(["pgrep", "-f", f"{keep}|{made['prefix']}\\."], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the run still alive: {left}"
