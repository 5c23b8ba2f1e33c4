"""The CommContext workers of one job on one host share one membership (client/host.py):
real worker processes, a real server, the host link's Unix socket and lock."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import pytest

from commctx import CommContext
from commctx.errors import JobConflict, PermissionDenied
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Proc, Server, running, worker
from .conftest import wait_until
from .test_faults import describe, sums_of
from .worker import reduce_all


@pytest.fixture
def runtime():
    """A runtime directory short enough for the link's socket path (a long one falls back to /tmp/commctx-<uid>)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="cx-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)

TTL = 2.0


def scrape(url: str) -> dict[str, float]:
    lines = urllib.request.urlopen(url, timeout=5).read().decode().splitlines()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines if line and not line.startswith("#"))}


def hub_pid(runtime: pathlib.Path) -> set[int]:
    """The pids holding a host link's lock under `runtime` (from /proc/locks): the hubs."""
    inodes = {p.stat().st_ino for p in (runtime / "commctx").glob("*.lock")}
    pids = set()
    for line in pathlib.Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "FLOCK" in fields and int(fields[-3].rsplit(":", 1)[1]) in inodes:
            pids.add(int(fields[4]))
    return pids


def host_workers(server: Server, job: str, world: int, hosts: dict[str, int], runtime: pathlib.Path,
                 spec: dict | None = None, env: dict[str, str] | None = None) -> list[Proc]:
    env = {"XDG_RUNTIME_DIR": str(runtime), **(env or {})}
    return [worker(server.address, job, world, node_key=host, spec=spec, name=f"{host}-{i}", env=env)
            for host, n in hosts.items() for i in range(n)]


def by_host(workers: list[Proc], results: list[dict], host: str, runtime: pathlib.Path) -> tuple[Proc, Proc]:
    """The hub process of `host` and another worker of it."""
    hubs = hub_pid(runtime)
    mine = [w for w in workers if w.name.startswith(f"{host}-")]
    hub = next(w for w in mine if w.popen.pid in hubs)
    return hub, next(w for w in mine if w is not hub)


def test_eight_workers_on_two_hosts_are_two_memberships_and_two_sessions(runtime):
    server = Server("127.0.0.1", metrics=True)
    workers = host_workers(server, "shared", 8, {"host-a": 4, "host-b": 4}, runtime)
    with running([server, *workers]):
        results = [w.event(120) for w in workers]
        assert sorted(r["rank"] for r in results) == list(range(8))
        for r in results:
            assert r["sums"] == sums_of(r) and r["sums"]["GLOBAL"] == 36.0
            assert len(r["groups"]["INTRA_NODE"]) == 4 and r["local_world_size"] == 4
        assert sorted(r["in_node_rank"] for r in results) == [0, 0, 1, 1, 2, 2, 3, 3]
        metrics = scrape(server.metrics_url)
        assert (metrics["commctx_active_members"], metrics["commctx_open_sessions"]) == (8, 2)
        d = describe(server.address, "shared")
        assert (d.state, d.joined, d.num_nodes) == (pb.JobDescription.FORMED, 8, 2)
        assert len(hub_pid(runtime)) == 2  # one process of each host holds its membership
        for w in workers:
            w.send("destroy")
        for w in workers:
            assert w.event(60)["event"] == "destroyed"
        # Every worker left: the last of each host took the membership with it, and the run has ended.
        ended = describe(server.address, "shared")
        assert (ended.state, ended.joined, ended.num_nodes, ended.ended_at > 0) == (pb.JobDescription.ENDED, 8, 2, True)
        assert " left, the first of its 8 workers to go" in ended.reason, ended.reason


def test_opting_out_is_a_membership_a_worker(runtime):
    server = Server("127.0.0.1", metrics=True)
    workers = host_workers(server, "apart", 2, {"host-a": 2}, runtime, env={"COMMCTX_SHARE_HOST": "0"})
    with running([server, *workers]):
        assert sorted(w.event(120)["rank"] for w in workers) == [0, 1]
        metrics = scrape(server.metrics_url)
        assert (metrics["commctx_active_members"], metrics["commctx_open_sessions"]) == (2, 2)
        assert hub_pid(runtime) == set()


@pytest.mark.parametrize("victim", ["worker", "hub"])
def test_a_killed_worker_of_a_host_is_gone_at_once_and_its_host_keeps_its_seat(runtime, victim):
    """The lease is 60 s: only the host link can tell the survivors this fast. Killing the hub's
    process, another worker of the host takes the membership over (its session, within the grace)."""
    spec = {"elastic": {"min_size": 3, "last_call_ms": 10_000}}
    server = Server("127.0.0.1", "--lease-ttl-s", "60", metrics=True)
    workers = host_workers(server, "kill", 4, {"host-a": 2, "host-b": 2}, runtime, spec=spec)
    with running([server, *workers]):
        first = [w.event(120) for w in workers]
        members = {n.node_key: n for n in describe(server.address, "kill").nodes}
        hub, other = by_host(workers, first, "host-a", runtime)
        dead, survivor = (other, hub) if victim == "worker" else (hub, other)
        dead_rank = first[workers.index(dead)]["rank"]
        survivors = [w for w in workers if w is not dead]
        killed_at = time.time()
        dead.kill()
        for w in survivors:
            w.send("rejoin")
        after = {w.name: w.event(30) for w in survivors}
        for w in survivors:
            r, before = after[w.name], first[workers.index(w)]
            assert r["changed_at"] - killed_at < 5, r  # not the lease (60 s)
            assert f"(node 'host-a', rank {dead_rank}) disconnected: its process ended without a leave" in r["reason"], r
            assert (r["generation"], r["world_size"], r["previous_rank"]) == (2, 3, before["rank"])
            assert r["sums"] == sums_of(r) and r["sums"]["GLOBAL"] == 6.0
            assert r["node_rank"] == before["node_rank"]  # the host kept its seat
        assert hub_pid(runtime) == {hub.popen.pid if victim == "worker" else survivor.popen.pid,
                                     by_host(workers, first, "host-b", runtime)[0].popen.pid}
        d = describe(server.address, "kill")
        assert {n.node_key: n.workers for n in d.nodes} == {"host-a": 1, "host-b": 2}
        assert {n.node_key for n in d.nodes} == set(members)
        assert scrape(server.metrics_url)["commctx_open_sessions"] == 2
        for w in survivors:
            w.send("destroy")
        for w in survivors:
            assert w.event(60)["event"] == "destroyed"


def test_a_paused_worker_is_expired_by_its_host_and_told_so_when_it_wakes(runtime):
    spec = {"elastic": {"min_size": 2, "last_call_ms": 10_000}}
    server = Server("127.0.0.1", "--lease-ttl-s", str(TTL))
    workers = host_workers(server, "pause", 3, {"host-a": 3}, runtime, spec=spec)
    with running([server, *workers]):
        first = [w.event(120) for w in workers]
        hub, paused = by_host(workers, first, "host-a", runtime)
        survivors = [w for w in workers if w is not paused]
        os.kill(paused.popen.pid, signal.SIGSTOP)
        try:
            for w in survivors:
                w.send("rejoin")
            after = [w.event(TTL + 30) for w in survivors]
            for r in after:
                assert r["world_size"] == 2 and r["sums"] == sums_of(r) and r["sums"]["GLOBAL"] == 3.0, r
                assert "expired: its process went silent" in r["reason"], r
        finally:
            os.kill(paused.popen.pid, signal.SIGCONT)
        paused.send("ended")
        ended = paused.event(30)
        assert ended["final"] and "expired: its process went silent" in ended["reason"], ended
        assert ended["rejoin_error"].startswith("MemberNotFound: NOT_FOUND: "), ended


def test_a_worker_that_disagrees_with_its_host_gets_the_servers_errors(runtime, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    server = Server("127.0.0.1")
    waiting = host_workers(server, "agree", 2, {"host-a": 1}, runtime, env={"COMMCTX_JOB_SECRET": "s" * 16})
    with running([server, *waiting]):
        wait_until(lambda: hub_pid(runtime) and describe_joined(server.address) >= 1, 60, waiting[0].log)
        kw = dict(job_id="agree", node_key="host-a", timeout=5, share_host=True)
        with pytest.raises(JobConflict, match="job 'agree' has world_size=2 but this worker asked for world_size=3"):
            CommContext.join(server.address, world_size=3, job_secret="s" * 16, **kw)
        with pytest.raises(PermissionDenied, match="job 'agree' is sealed: this join's job_secret is missing or wrong"):
            CommContext.join(server.address, world_size=2, job_secret="t" * 16, **kw)
        # The host's first worker still waits for its peer, and the right one completes the world.
        ctx = CommContext.join(server.address, world_size=2, job_secret="s" * 16, **kw)
        try:
            assert ctx.assignment.world_size == 2
            assert reduce_all(ctx)["GLOBAL"] == 3.0  # the worker's report all_reduces on every group: so does this one
            assert waiting[0].event(60)["world_size"] == 2
        finally:
            ctx.destroy()


def describe_joined(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        try:
            return pb_grpc.RendezvousStub(ch).DescribeJob(
                pb.DescribeJobRequest(job_id="agree", job_secret="s" * 16), timeout=5).joined
        except grpc.RpcError:
            return 0


def test_a_runtime_directory_too_long_for_a_socket_falls_back_to_tmp(monkeypatch, tmp_path, runtime):
    from commctx.host_wire import link_paths

    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    sock, lock = link_paths("127.0.0.1:1", "job", "host-a")
    assert sock.startswith(f"/tmp/commctx-{os.getuid()}/") and len(sock) <= 107
    assert os.stat(os.path.dirname(sock)).st_mode & 0o777 == 0o700
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert link_paths("127.0.0.1:1", "job", "host-a")[0].startswith(f"{runtime}/commctx/")


def test_a_link_that_speaks_garbage_is_dropped_and_the_host_serves_on(runtime):
    """A process of the same user writing junk to the host's socket: its link ends, the members stay."""
    server = Server("127.0.0.1")
    workers = host_workers(server, "junk", 2, {"host-a": 2}, runtime)
    with running([server, *workers]):
        assert sorted(w.event(120)["rank"] for w in workers) == [0, 1]
        (sock_path,) = (runtime / "commctx").glob("*.sock")
        for junk, answer in ((b"\x00\x00\x00\x05hello", b""), (b"\xff\xff\xff\xff", b""), (b"\x00\x00\x00\x02[]", b""),
                             (b"\x00\x00\x00\x02{}", b'"refused"')):  # a hello naming no job is refused, as another job
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(sock_path))
                s.sendall(junk)
                s.settimeout(5)
                said = b"".join(iter(lambda: s.recv(4096), b""))  # until the hub closes the link
                assert (answer in said) if answer else said == b"", said
        for w in workers:
            w.send("reduce")
        assert [w.event(30)["sums"]["GLOBAL"] for w in workers] == [3.0, 3.0]
        assert describe(server.address, "junk").joined == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_reach_a_hosts_link(runtime):
    """The link's directory is its user's alone (0700), and the hub checks the caller's uid besides."""
    server = Server("127.0.0.1")
    workers = host_workers(server, "mine", 2, {"host-a": 2}, runtime)
    with running([server, *workers]):
        assert sorted(w.event(120)["rank"] for w in workers) == [0, 1]
        (sock_path,) = (runtime / "commctx").glob("*.sock")
        assert (runtime / "commctx").stat().st_mode & 0o777 == 0o700
        code = subprocess.run([sys.executable, "-c", f"""
import os, socket
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect({str(sock_path)!r})
except PermissionError:
    raise SystemExit(13)
raise SystemExit(0)
"""], timeout=30).returncode
        assert code == 13
        # Even with the directory opened up, the hub hangs up on another uid before reading a byte.
        os.chmod(runtime, 0o755)
        os.chmod(runtime / "commctx", 0o755)
        os.chmod(sock_path, 0o777)
        said = subprocess.run([sys.executable, "-c", f"""
import os, socket
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX)
s.connect({str(sock_path)!r})
s.settimeout(5)
try:
    s.sendall(b'\\x00\\x00\\x00\\x02{{}}')
    print(len(s.recv(100)))
except (ConnectionResetError, BrokenPipeError):  # closed before, or with, the hello unread
    print(0)
"""], capture_output=True, text=True, timeout=30)
        assert said.stdout.strip() == "0", said  # closed, nothing said (a uid of its own gets a refusal)
        for w in workers:
            w.send("reduce")
        assert [w.event(30)["sums"]["GLOBAL"] for w in workers] == [3.0, 3.0]
