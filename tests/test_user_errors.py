"""Errors a user can act on: each says what is wrong and names the value to fix.

- a worker that cannot reach the rendezvous server warns, naming the address,
  why, and how long it keeps trying; then the join raises ServerUnavailable;
- `commctx-server` on a port already in use prints one line naming the port;
- a `spec=` dict with an unknown key raises InvalidRequest naming the key.

(`commctx plan --spec` with a bad file: tests/test_cli_plan.py.)
"""

from __future__ import annotations

import asyncio
import logging
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
                                       ("--metrics-port", "metrics port")])
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
    from commctx.lifecycle import job_spec_of

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
