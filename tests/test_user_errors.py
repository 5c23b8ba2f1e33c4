"""Errors a user can act on: each says what is wrong and names the value to fix.

- a worker that cannot reach the rendezvous server warns, naming the address,
  why, and how long it keeps trying; then the join raises ServerUnavailable;
- `commctx-server` on a port already in use prints one line naming the port;
- a `spec=` dict with an unknown key raises InvalidRequest naming the key;
- mistakes a newcomer makes in the first hour are one-line errors at the call,
  before any wait or network call: an unknown backend, a timeout that is not
  positive, a bad world size, a server address with a URL scheme or a bad
  port, a malformed token or job secret (InvalidArgument), a misspelt
  --rdzv-conf key (torch's RendezvousError), `commctx plan` of a world the
  server would refuse; COMMCTX_JOB still works, with a warning naming
  COMMCTX_JOB_ID; `commctx --version`;
- a second `commctx-server` on a state directory in use stops with one line
  naming the holder's PID, and a dead holder is replaced at once.

(`commctx plan --spec` with a bad file: tests/test_cli_plan.py; the state
directory's lock in detail: tests/test_store.py.)
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import re
import socket
import subprocess
import time

import pytest

from commctx import CommCtxError, InvalidRequest, RendezvousError, ServerUnavailable

from .conftest import join_request
from .etcd import free_port as closed_port  # a free port: nothing listens on it


def unreachable_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "commctx" and r.levelno == logging.WARNING and "cannot reach the rendezvous server" in r.getMessage()]


# -- a server that cannot be reached ----------------------------------------------------------


@pytest.mark.slow(8)  # waits for the warning: early, beside tests that keep the CPU busy, not last
def test_a_join_that_cannot_reach_the_server_warns_after_5_s_and_then_fails_unavailable(caplog):
    """Real timing, public API: the join gives up after its 8 s timeout; at
    about 5 s it has said where it is trying, why it fails and for how long it
    will go on trying."""
    from commctx import CommContext

    port = closed_port()
    caplog.set_level(logging.WARNING, logger="commctx")
    start = time.time()
    with pytest.raises(ServerUnavailable, match=rf"127\.0\.0\.1:{port}") as raised:
        CommContext.join(f"127.0.0.1:{port}", job_id="nowhere", world_size=2, timeout=8)
    elapsed = time.time() - start
    assert 7.5 <= elapsed < 20, elapsed  # the whole timeout, not a fail-fast
    assert isinstance(raised.value, CommCtxError) and raised.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")

    warnings = unreachable_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]  # the next one would be 30 s later
    message = warnings[0].getMessage()
    m = re.fullmatch(rf"cannot reach the rendezvous server at 127\.0\.0\.1:{port} for (\d+) s "
                     r"\(connection refused\); still trying for (\d+) s", message)
    assert m, message
    down_for, left = int(m.group(1)), int(m.group(2))
    assert 4 <= down_for <= 6 and 2 <= left <= 4, message
    assert 4.5 <= warnings[0].created - start <= 7, warnings[0].created - start


def test_the_warning_repeats_at_its_interval(monkeypatch, caplog):
    """The intervals are module constants; shortened here, the warnings come
    again and again, each with less time left, until the join gives up."""
    from commctx import session as session_module
    from commctx.session import Session

    monkeypatch.setattr(session_module, "UNREACHABLE_WARN_AFTER_S", 0.4)
    monkeypatch.setattr(session_module, "UNREACHABLE_WARN_EVERY_S", 0.6)
    caplog.set_level(logging.WARNING, logger="commctx")
    port = closed_port()
    session = Session(f"127.0.0.1:{port}")
    start = time.time()
    try:
        with pytest.raises(ServerUnavailable, match=f"no answer from rendezvous server 127.0.0.1:{port} within 3 s"):
            session.join(join_request("nowhere", 2), 3.0)
    finally:
        session.close(leave=False)
    warnings = unreachable_warnings(caplog)
    times = [r.created - start for r in warnings]
    assert len(warnings) >= 3, times
    assert 0.3 <= times[0] <= 1.5, times
    assert all(0.5 <= b - a <= 1.5 for a, b in zip(times, times[1:])), times
    lefts = [int(re.search(r"still trying for (\d+) s", r.getMessage()).group(1)) for r in warnings]
    assert lefts == sorted(lefts, reverse=True) and lefts[0] >= 2, lefts
    assert all(f"127.0.0.1:{port}" in r.getMessage() and "(connection refused)" in r.getMessage() for r in warnings)


async def test_a_join_waiting_on_a_live_server_does_not_warn(server, monkeypatch, caplog):
    """Waiting for the other workers is not an outage: no such warning, and the
    server's own answer (who is missing) ends the join."""
    from commctx import RendezvousTimeout
    from commctx import session as session_module
    from commctx.session import Session

    monkeypatch.setattr(session_module, "UNREACHABLE_WARN_AFTER_S", 0.2)
    monkeypatch.setattr(session_module, "UNREACHABLE_WARN_EVERY_S", 0.2)
    caplog.set_level(logging.WARNING, logger="commctx")
    session = Session(f"127.0.0.1:{server.port}")
    try:
        with pytest.raises(RendezvousTimeout, match="1 of 2 workers joined"):
            await asyncio.to_thread(session.join, join_request("waiting", 2), 1.5)
    finally:
        await asyncio.to_thread(session.close, leave=False)
    assert not unreachable_warnings(caplog)


def test_the_probe_says_why():
    from commctx.transport import why_unreachable

    assert why_unreachable(f"127.0.0.1:{closed_port()}") == "connection refused"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert "accepts TCP connections but no gRPC call gets through" in why_unreachable(f"127.0.0.1:{port}")
    assert "does not resolve" in why_unreachable("no-such-host.invalid:50051")


# -- a port already in use ---------------------------------------------------------------------


def start_server_on_busy_port(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(["commctx-server", "--host", "127.0.0.1", *flags, "--store", "memory"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("flag,what", [("--port", "port"), ("--health-port", "health port"),
                                       ("--http-port", "HTTP port")])
def test_a_port_in_use_stops_the_server_with_one_line(flag, what):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        flags = ["--port", str(port)] if flag == "--port" else ["--port", "0", flag, str(port)]
        out = start_server_on_busy_port(*flags)
    assert out.returncode != 0
    assert out.stderr.count("\n") == 1 and out.stderr.endswith("\n"), out.stderr  # exactly one line
    assert out.stderr == f"commctx-server: {what} {port} on 127.0.0.1 is already in use ({flag})\n"
    assert "Traceback" not in out.stderr and "listening" not in out.stdout


def test_a_port_a_listening_server_holds_is_in_use_too():
    """A listening socket (as another commctx-server's, whose gRPC sets
    SO_REUSEPORT) is refused just the same: two servers never share a port."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = start_server_on_busy_port("--port", str(port))
    assert out.returncode != 0 and out.stderr == f"commctx-server: port {port} on 127.0.0.1 is already in use (--port)\n"


# -- a spec with an unknown key -------------------------------------------------------------


@pytest.mark.parametrize("spec,named", [
    ({"world_sise": 4}, "unknown key 'world_sise' in spec (known keys: world_size, layout, roles,"),
    ({"layout": {"tpp": 2}}, "unknown key 'tpp' in spec.layout (known keys: tp, cp, ep, dp, pp, order, within_node)"),
    ({"roles": [{"role": "a", "count": 4}], "groups": [{"mode": "M", "role_group": {"role": ["a"]}}]},
     "unknown key 'role' in spec.groups[0].role_group (known keys: roles, scope)"),
    ({"layout": 2}, "spec.layout must be an object (a dict), not int"),
    ({"roles": {"role": "a"}}, "spec.roles must be a list, not dict"),
    ({"groups": [{"mode": "M", "weight_transfer": {"scope": "SCOPE_NOD"}}]}, "Invalid enum value SCOPE_NOD"),
    ({"world_size": 8}, "spec.world_size 8 disagrees with world_size 4"),
])
def test_a_spec_that_is_not_a_job_spec_names_the_key(spec, named):
    from commctx.arguments import job_spec_of

    with pytest.raises(InvalidRequest) as raised:
        job_spec_of(spec, 4)
    assert named in str(raised.value)
    # One family to catch: the commctx base class; and a ValueError, as before.
    assert isinstance(raised.value, RendezvousError) and isinstance(raised.value, CommCtxError)
    assert isinstance(raised.value, ValueError) and raised.value.code == "INVALID_ARGUMENT"


def test_join_refuses_such_a_spec_before_it_calls_the_server():
    from commctx import CommContext

    start = time.monotonic()
    with pytest.raises(InvalidRequest, match="unknown key 'world_sise' in spec"):
        CommContext.join(f"127.0.0.1:{closed_port()}", job_id="j", world_size=4, spec={"world_sise": 4}, timeout=30)
    assert time.monotonic() - start < 5
    assert not CommContext().is_initialized()


def test_an_advertise_address_that_is_not_an_ip_is_an_invalid_request():
    from commctx import CommContext

    with pytest.raises(InvalidRequest, match="advertise address 'worker-7' is not an IP address"):
        CommContext.join(f"127.0.0.1:{closed_port()}", job_id="j", world_size=1, advertise_addr="worker-7", timeout=30)
    assert not CommContext().is_initialized()


# -- mistakes caught at the call: one line, before any wait or network call ------------------
#
# Each join below names a closed port: a join that got as far as the network
# would retry there until its 30 s timeout, so returning within a second shows
# the mistake was caught first.


def refused_at_once(error: type[Exception], **kwargs) -> Exception:
    """The error CommContext.join(**kwargs) raises, within a second, with nothing initialised."""
    from commctx import CommContext

    kwargs.setdefault("server_addr", f"127.0.0.1:{closed_port()}")
    kwargs.setdefault("job_id", "j")
    kwargs.setdefault("timeout", 30)
    start = time.monotonic()
    with pytest.raises(error) as raised:
        CommContext.join(**kwargs)
    assert time.monotonic() - start < 1.0
    assert not CommContext().is_initialized() and CommContext()._membership is None  # noqa: SLF001
    message = str(raised.value)
    assert "\n" not in message and len(message) < 1024, message
    assert isinstance(raised.value, CommCtxError)
    return raised.value


def test_an_unknown_backend_is_named_at_the_call_with_torch_s_backends_and_a_suggestion():
    import torch.distributed as dist

    from commctx.errors import InvalidArgument

    err = refused_at_once(InvalidArgument, world_size=2, backend="ncll")
    assert str(err).startswith("backend 'ncll' is not a torch.distributed backend (did you mean 'nccl'?): give 'auto' "
                               "or one of gloo, nccl, "), err
    assert "mpi" in str(err) and "ucc" in str(err) and isinstance(err, ValueError)
    assert "did you mean 'gloo'?" in str(refused_at_once(InvalidArgument, world_size=2, backend="glo"))
    assert "did you mean" not in str(refused_at_once(InvalidArgument, world_size=2, backend="tcp"))
    if not dist.is_mpi_available():  # known to torch, but not in this build
        assert "backend 'mpi' is not built into this torch" in str(refused_at_once(InvalidArgument, world_size=2, backend="mpi"))

    # The seed API too: before torch.distributed is touched.
    from commctx import CommContext

    with pytest.raises(InvalidArgument, match="backend 'ncll' is not a torch.distributed backend"):
        CommContext().init_distributed_env(world_size=1, rank=0, backend="ncll", dist_url=f"tcp://127.0.0.1:{closed_port()}")
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs,said", [
    ({"timeout": -1}, "timeout must be a positive number of seconds (how long to wait for the world to form), not -1"),
    ({"timeout": 0}, "timeout must be a positive number of seconds (how long to wait for the world to form), not 0"),
    ({"timeout": float("inf")}, "timeout must be a positive number of seconds"),
    ({"timeout": "600"}, "timeout must be a positive number of seconds (how long to wait for the world to form), not '600'"),
    ({"collective_timeout": 0}, "collective_timeout must be a positive number of seconds (torch.distributed's timeout), not 0"),
    ({"collective_timeout": -5}, "collective_timeout must be a positive number of seconds (torch.distributed's timeout), not -5"),
])
def test_a_timeout_that_is_not_positive_is_refused_at_the_call_not_blamed_on_the_server(kwargs, said):
    from commctx.errors import InvalidArgument

    err = refused_at_once(InvalidArgument, world_size=2, **kwargs)
    assert str(err) == said or (said.endswith("seconds") and str(err).startswith(said)), err
    assert "rendezvous server" not in str(err)


@pytest.mark.parametrize("world_size,shown", [(0, "not 0"), (-1, "not -1"), ("4", "not '4'"), (True, "not True"),
                                              (2.0, "not 2.0"), (None, "not given")])
def test_a_bad_world_size_is_a_commctx_error_and_still_a_value_error(world_size, shown):
    from commctx.errors import InvalidArgument

    err = refused_at_once(InvalidArgument, world_size=world_size)
    assert str(err) == f"world_size must be a positive integer (the number of workers in the job), {shown}"
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("addr,said", [
    ("http://127.0.0.1:50051", "server address 'http://127.0.0.1:50051' has a URL scheme: drop 'http://' and give host:port"),
    ("grpc://rdzv:50051", "server address 'grpc://rdzv:50051' has a URL scheme: drop 'grpc://' and give host:port"),
    ("https://rdzv.example.com", "server address 'https://rdzv.example.com' has a URL scheme: drop 'https://' and give host:port"),
    ("127.0.0.1:0", "server address '127.0.0.1:0': port 0 is out of range; give host:port with a port in 1..65535"),
    ("127.0.0.1:99999", "server address '127.0.0.1:99999': port 99999 is out of range; give host:port with a port in 1..65535"),
    ("127.0.0.1:http", "server address '127.0.0.1:http': port 'http' is not a number; give host:port with a port in 1..65535"),
    ("a:1,", "server address 'a:1,' has an empty entry: give host:port, or the replicas' host:port separated by commas"),
])
def test_a_server_address_that_is_not_host_port_is_refused_at_the_call(addr, said):
    from commctx.errors import InvalidArgument

    err = refused_at_once(InvalidArgument, server_addr=addr, world_size=2)
    assert str(err) == said and isinstance(err, ValueError)
    assert "Name or service not known" not in str(err)


def test_a_url_in_commctx_server_is_named_as_that_variable(monkeypatch):
    from commctx.errors import InvalidArgument

    monkeypatch.setenv("COMMCTX_SERVER", "http://127.0.0.1:50051")
    err = refused_at_once(InvalidArgument, server_addr=None, world_size=2)
    assert str(err) == ("COMMCTX_SERVER: server address 'http://127.0.0.1:50051' has a URL scheme: "
                        "drop 'http://' and give host:port")


@pytest.mark.parametrize("command", ["status", "health"])
def test_the_cli_refuses_a_url_in_addr_with_one_line(command):
    out = subprocess.run(["commctx", command, "--addr", "http://127.0.0.1:50051"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr == (f"commctx {command}: --addr: server address 'http://127.0.0.1:50051' has a URL scheme: "
                          f"drop 'http://' and give host:port\n")


TOKEN_RULE = "a token is printable ASCII without spaces, at most 4096 characters"
SECRET_RULE = "a job secret is 16-256 printable ASCII characters without spaces"


@pytest.mark.parametrize("kwargs,env,said", [
    ({"token": ""}, {}, "token= is empty: give the server's bearer token, or leave it out"),
    ({"token": "two words"}, {}, f"token= is not a usable token (9 characters; it has a space): {TOKEN_RULE}"),
    ({"token": "t\u00f6ken-\u00e9"}, {}, f"token= is not a usable token (7 characters; it has a non-ASCII character): {TOKEN_RULE}"),
    ({}, {"COMMCTX_TOKEN": "tab\there"}, f"COMMCTX_TOKEN is not a usable token (8 characters; it has a space): {TOKEN_RULE}"),
    ({"job_secret": ""}, {}, f"job_secret= is empty: {SECRET_RULE}, or leave it out for an open job"),
    ({"job_secret": "short-secret"}, {}, f"job_secret= is not a usable job secret (12 characters; it is too short): {SECRET_RULE}"),
    ({"job_secret": "a secret with spaces"}, {}, f"job_secret= is not a usable job secret (20 characters; it has a space): {SECRET_RULE}"),
    ({"job_secret": "s\u00e9cret-" + "x" * 16}, {}, f"job_secret= is not a usable job secret (23 characters; it has a non-ASCII character): {SECRET_RULE}"),
    ({"job_secret": "x" * 257}, {}, f"job_secret= is not a usable job secret (257 characters; it is too long): {SECRET_RULE}"),
    ({}, {"COMMCTX_JOB_SECRET": "tiny"}, f"COMMCTX_JOB_SECRET is not a usable job secret (4 characters; it is too short): {SECRET_RULE}"),
])
def test_a_malformed_token_or_job_secret_names_its_source_but_never_its_value(monkeypatch, kwargs, env, said):
    from commctx.errors import InvalidArgument

    for name in ("COMMCTX_TOKEN", "COMMCTX_JOB_SECRET"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    err = refused_at_once(InvalidArgument, world_size=2, **kwargs)
    assert str(err) == said
    for value in [*kwargs.values(), *env.values()]:
        if value:
            assert value not in str(err)


def test_a_good_job_secret_from_the_environment_passes_the_check(monkeypatch):
    """16 characters is the shortest accepted: the join goes on to the (closed) server."""
    from commctx import CommContext

    monkeypatch.setenv("COMMCTX_JOB_SECRET", "s" * 16)
    with pytest.raises(ServerUnavailable):
        CommContext.join(f"127.0.0.1:{closed_port()}", job_id="j", world_size=1, timeout=1)


def test_the_cli_names_a_malformed_token_without_echoing_it():
    out = subprocess.run(["commctx", "status", "--addr", f"127.0.0.1:{closed_port()}", "--token", "my secret"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "my secret" not in out.stderr
    assert out.stderr == f"commctx status: --token is not a usable token (9 characters; it has a space): {TOKEN_RULE}\n"


# -- torchrun --rdzv-conf -----------------------------------------------------------------------


def commctx_handler(**conf):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    return get_rendezvous_handler(RendezvousParameters(
        backend="commctx", endpoint=f"127.0.0.1:{closed_port()}", run_id="conf", min_nodes=1, max_nodes=1,
        nproc_per_node=1, **conf))


@pytest.mark.parametrize("key,suggested", [("join_timout", "join_timeout"), ("last_call_timout", "last_call_timeout"),
                                           ("node-key", "node_key"), ("spce", "spec"), ("keep_alive_intervall", "keep_alive_interval")])
def test_a_misspelt_rdzv_conf_key_is_an_error_naming_the_closest_key(key, suggested):
    from torch.distributed.elastic.rendezvous import RendezvousError

    with pytest.raises(RendezvousError) as raised:
        commctx_handler(**{key: "15"})
    message = str(raised.value)
    assert message.startswith(f"commctx: unknown --rdzv-conf key {key!r}: did you mean {suggested}? (commctx reads "
                              f"join_timeout, last_call_timeout, close_timeout, spec, node_key, role, nproc_per_node, "
                              f"progress_interval; it ignores "), message
    assert "\n" not in message
    with pytest.raises(RendezvousError, match=r"unknown --rdzv-conf key 'colour' \(commctx reads"):
        commctx_handler(colour="blue")  # nothing close: no suggestion


def test_torch_s_own_and_c10d_s_rdzv_conf_keys_are_accepted():
    from commctx.torchrun import CONF_KEYS, IGNORED_CONF_KEYS

    assert {"timeout", "rank", "is_host", "store_type", "use_libuv", "read_timeout",
            "keep_alive_interval", "keep_alive_max_attempt", "heartbeat"} <= set(IGNORED_CONF_KEYS)
    assert {"join_timeout", "last_call_timeout", "close_timeout"} <= set(CONF_KEYS)  # read, under torch's names
    handler = commctx_handler(**{key: "1" for key in IGNORED_CONF_KEYS}, join_timeout=5, role="trainer")
    handler.shutdown()


@pytest.mark.slow
def test_torchrun_stops_on_a_misspelt_rdzv_conf_key_and_accepts_its_own_keys(tmp_path):
    """Real torchrun: its launcher adds keys of its own ('timeout'); a misspelt
    key of the user's stops it with the handler's one line."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('not reached')\n")

    def torchrun(conf: str) -> subprocess.CompletedProcess:
        """`python -m torch.distributed.run ...`, forked by the tests' zygote (torch imported)."""
        from .cluster import clean_env, forked_run

        return forked_run(["-m", "torch.distributed.run", "--rdzv-backend=commctx", f"--rdzv-endpoint=127.0.0.1:{closed_port()}",
                           "--rdzv-id=conf", "--nnodes=1", "--nproc-per-node=1", f"--rdzv-conf={conf}", str(script)],
                          clean_env(), timeout=120)

    bad = torchrun("join_timout=15")
    assert bad.returncode != 0
    assert "commctx: unknown --rdzv-conf key 'join_timout': did you mean join_timeout?" in bad.stderr, bad.stderr
    good = torchrun("join_timeout=1,read_timeout=5,is_host=1")  # goes on to the (closed) server
    assert good.returncode != 0 and "unknown --rdzv-conf key" not in good.stderr, good.stderr
    assert "cannot reach" in good.stderr or "UNAVAILABLE" in good.stderr or "no answer" in good.stderr, good.stderr


# -- commctx plan refuses what the server would refuse -------------------------------------------


ROOT = pathlib.Path(__file__).resolve().parents[1]


def plan(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["commctx", "plan", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def assert_one_line_error(out: subprocess.CompletedProcess, expected: str) -> None:
    assert out.returncode != 0 and out.stdout == "", out.stdout
    assert out.stderr == expected + "\n"


def test_plan_of_a_spec_with_roles_needs_node_roles():
    """The README's RL example without --node-roles: the server would refuse every
    worker (they join with no role), so plan refuses too, saying what to give."""
    out = plan("--nodes", "2", "--per-node", "3", "--spec", "examples/rl.json")
    assert_one_line_error(out, "commctx plan: the spec declares roles trainer:2, rollout:4, so every worker needs one: "
                               "give --node-roles, the roles of each node's workers by local rank "
                               "(e.g. --node-roles trainer,rollout,rollout)")
    out = plan("--nodes", "3", "--per-node", "2", "--spec", "examples/rl.json")  # no even split: no example
    assert out.returncode != 0 and out.stderr.endswith("the roles of each node's workers by local rank\n")
    assert plan("--nodes", "2", "--per-node", "3", "--spec", "examples/rl.json", "--node-roles", "trainer,rollout,rollout").returncode == 0


def test_plan_refuses_roles_the_spec_does_not_declare_or_has_too_many_of():
    out = plan("--nodes", "2", "--per-node", "3", "--spec", "examples/rl.json", "--node-roles", "trainer,rollout,learner")
    assert_one_line_error(out, "commctx plan: this world cannot form: the spec declares roles trainer:2, rollout:4 but "
                               "--node-roles gives local rank 2 role 'learner'; the server refuses such a worker's join")
    out = plan("--nodes", "2", "--per-node", "3", "--spec", "examples/rl.json", "--node-roles", "trainer,trainer,rollout")
    assert_one_line_error(out, "commctx plan: this world cannot form: the spec declares roles trainer:2, rollout:4 but "
                               "--node-roles makes trainer:4, rollout:2; the server refuses the workers of role 'trainer' "
                               "beyond its 2")
    out = plan("--nodes", "1", "--per-node", "2", "--node-roles", "a b,c")
    assert_one_line_error(out, "commctx plan: this world cannot form: role 'a b' is malformed: 1-64 characters of "
                               "[A-Za-z0-9._-], starting with a letter or digit")


def test_plan_of_groups_by_role_without_roles_says_they_would_be_empty(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text('{"groups": [{"mode": "TRAIN", "role_group": {"roles": ["trainer"]}}]}')
    out = plan("--nodes", "1", "--per-node", "2", "--spec", str(spec))
    assert_one_line_error(out, "commctx plan: the spec's groups name roles trainer but no worker has a role, so those "
                               "groups would be empty: give --node-roles, the roles of each node's workers by local rank")
    assert plan("--nodes", "1", "--per-node", "2", "--spec", str(spec), "--node-roles", "trainer,x").returncode == 0


# -- names, version ------------------------------------------------------------------------------


def test_commctx_version():
    import importlib.metadata

    out = subprocess.run(["commctx", "--version"], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"commctx {importlib.metadata.version('commctx')}\n", "")


def test_commctx_job_still_names_the_job_with_a_warning_naming_commctx_job_id(monkeypatch, caplog):
    from commctx import launcher as lifecycle
    from commctx.launcher import LauncherEnv

    monkeypatch.setattr(lifecycle, "_warned_renamed", set())
    caplog.set_level(logging.WARNING, logger="commctx")
    with pytest.warns(DeprecationWarning, match="COMMCTX_JOB is deprecated: set COMMCTX_JOB_ID instead"):
        assert LauncherEnv.from_env({"COMMCTX_JOB": "legacy"}).job_id == "legacy"
        assert LauncherEnv.from_env({"COMMCTX_JOB": "legacy"}).job_id == "legacy"
    said = [r.getMessage() for r in caplog.records if "COMMCTX_JOB" in r.getMessage()]
    assert said == ["COMMCTX_JOB is deprecated: set COMMCTX_JOB_ID instead (COMMCTX_JOB is read only while "
                    "COMMCTX_JOB_ID is unset)"]  # once per process
    assert LauncherEnv.from_env({"COMMCTX_JOB": "legacy", "COMMCTX_JOB_ID": "new"}).job_id == "new"


@pytest.mark.slow
def test_the_example_and_compose_use_commctx_job_id_and_the_old_name_still_joins(monkeypatch):
    """The compose worker's variables are the ones the example reads, which are
    the library's; a worker with only the old COMMCTX_JOB still joins its job."""
    from .cluster import Server, clean_env, forked_run

    compose = (ROOT / "docker-compose.yml").read_text()
    assert 'COMMCTX_JOB_ID: "demo"' in compose and "COMMCTX_JOB:" not in compose
    assert '"COMMCTX_JOB"' not in (ROOT / "examples" / "allreduce.py").read_text()
    server = Server("127.0.0.1")
    try:
        env = {k: v for k, v in clean_env().items() if not k.startswith("COMMCTX_")}
        for name, job in (("COMMCTX_JOB_ID", "compose-demo"), ("COMMCTX_JOB", "old-name")):
            out = forked_run([str(ROOT / "examples" / "allreduce.py"), "--server", server.address, "--world-size", "1"],
                             {**env, name: job}, timeout=120)
            assert out.returncode == 0, out.stderr
            assert "rank 0: all_reduce over GLOBAL [0] = 1 (expected 1)" in out.stdout
            assert f"join job={job} " in server.log()
        assert "COMMCTX_JOB is deprecated: set COMMCTX_JOB_ID instead" in out.stderr
    finally:
        server.stop()


# -- one state directory, one server ---------------------------------------------------------------


def test_a_second_server_on_a_state_directory_is_refused_and_a_dead_one_is_replaced_at_once(tmp_path):
    from .cluster import Server

    first = Server("127.0.0.1", "--state-dir", str(tmp_path))
    try:
        second = subprocess.run(["commctx-server", "--host", "127.0.0.1", "--port", "0", "--state-dir", str(tmp_path)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "listening" not in second.stdout
        assert second.stderr == (f"commctx-server: state directory {tmp_path} is in use by commctx-server pid "
                                 f"{first.popen.pid} (another server); give another --state-dir, or stop that one\n")
        assert first.popen.poll() is None  # the first one serves on, its store untouched
        first.kill()  # kill -9: no clean close; the kernel releases its lock
        start = time.monotonic()
        replacement = Server("127.0.0.1", "--state-dir", str(tmp_path))
        try:
            assert time.monotonic() - start < 15
        finally:
            replacement.stop()
    finally:
        first.stop()
