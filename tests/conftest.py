"""Shared fixtures: a real rendezvous server on 127.0.0.1 port 0, and helpers."""

from __future__ import annotations

import gc
import os
import sys

import grpc
import pytest

from commctx.server import start_server
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .waiting import consistently, eventually, holds_for, wait_until  # noqa: F401 - the tests' pollers, imported from here

# The console scripts this suite runs (commctx, commctx-server, grpcurl,
# hadolint, check-jsonschema) live beside the interpreter running it, e.g.
# .venv/bin, which is not on PATH when pytest is started as .venv/bin/python.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# The suite starts hundreds of Python processes (xdist workers, servers, workers, CLIs):
# they keep the bytecode they compile, which an environment's PYTHONDONTWRITEBYTECODE=1
# forbids, or each one compiles the package (and pytest rewrites every test module) again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Servers the tests start serve no HTTP unless a test asks for it (--http-port 0): the
# default port, 50080, would be shared by every server a test runs at once.
os.environ["COMMCTX_HTTP_PORT"] = "off"


def pytest_configure(config: pytest.Config) -> None:
    """The run's first process gives every process it starts a temporary
    directory of the run's own (TMPDIR), removed when the run ends: torch's
    agents leave a log directory and error files behind in each run, about a
    hundred a run. pytest's own directories stay where they were. The
    pytest-xdist controller also names a directory and itself for the one
    worker zygote (tests/zygote.py) its workers share (tests/cluster.py)."""
    if hasattr(config, "workerinput"):
        return
    import atexit
    import shutil
    import tempfile

    tempfile.gettempdir()  # this process's own (pytest's base temp among them) stay in the usual place
    run_tmp = tempfile.mkdtemp(prefix="commctx-run-")
    atexit.register(shutil.rmtree, run_tmp, True)
    os.environ["TMPDIR"] = run_tmp
    if getattr(config.option, "numprocesses", None):
        where = tempfile.mkdtemp(prefix="commctx-zygote-")
        atexit.register(shutil.rmtree, where, True)
        os.environ["COMMCTX_TEST_ZYGOTE"] = f"{where}:{os.getpid()}"


def pytest_collection_finish(session: pytest.Session) -> None:
    """What importing torch, grpc and the test modules made lives as long as the
    process: frozen, the collector's full passes (a few dozen a run) skip its
    quarter of a million objects."""
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest tests first, spread over the pytest-xdist workers.

    worksteal gives worker k the k-th of n contiguous slices of this list (an
    idle worker later takes half of a busy one's queue, from its end). Slow
    tests (marked `slow`, or `slow(S)`: about S seconds here, default 10) are
    dealt out longest first, each to the slice with the fewest seconds so far,
    and head their slices: every worker starts on long tests at once and the
    short ones fill in. Sorted slow-first in one piece, one worker would start
    them all, one after another, and the longest would end the run late."""
    def seconds(item: pytest.Item) -> float:
        mark = item.get_closest_marker("slow")
        return 0.0 if mark is None else float(mark.args[0]) if mark.args else 10.0

    n = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    sizes, left = [], len(items)
    for k in range(n):  # as worksteal cuts the list: len(pending) // nodes_remaining
        sizes.append(left // (n - k))
        left -= sizes[-1]
    slices: list[list[pytest.Item]] = [[] for _ in range(n)]
    load = [0.0] * n
    for item in sorted((i for i in items if seconds(i)), key=lambda i: -seconds(i)):  # stable
        k = min((k for k in range(n) if len(slices[k]) < sizes[k]), key=lambda k: load[k])
        slices[k].append(item)
        load[k] += seconds(item)
    fast = iter([i for i in items if not seconds(i)])
    for k in range(n):
        slices[k] += [next(fast) for _ in range(sizes[k] - len(slices[k]))]
    items[:] = [item for s in slices for item in s]


@pytest.fixture(autouse=True)
def _environment():
    """Each test starts with the environment the last one found: what a test or an
    in-process torchrun handler sets (COMMCTX_SERVER, GLOO_SOCKET_IFNAME, ...) goes with it."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def hosts():
    """Two hosts: network namespaces on a bridge of their own (tests/cluster.py); skipped without root."""
    from .cluster import Hosts, netns_available

    why_not = netns_available()
    if why_not:
        pytest.skip(why_not)
    h = Hosts(2)
    yield h
    h.close()


@pytest.fixture
async def server():
    # A reconnect grace as long as the lease: protocol tests that end a session on
    # purpose see the member go at its lease (tests/test_detect.py tests the grace).
    s = await start_server("127.0.0.1", 0, lease_ttl_s=5.0, reconnect_grace_s=5.0)
    yield s
    await s.stop(0)


@pytest.fixture
async def channel(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


@pytest.fixture
def stub(channel):
    return pb_grpc.RendezvousStub(channel)


def join_request(job_id: str, world_size: int, node_key: str = "node0", i: int = 0, **kw) -> pb.JoinRequest:
    kw.setdefault("address", "127.0.0.1")
    kw.setdefault("master_port", 20000 + i)
    kw.setdefault("wait_timeout_ms", 20_000)
    return pb.JoinRequest(job_id=job_id, spec=pb.JobSpec(world_size=world_size), node_key=node_key, **kw)


@pytest.fixture
def cluster():
    """A real etcd and three HA replicas over it (tests/etcd.py); stopped after the test."""
    from .etcd import Etcd, Replicas

    etcd = Etcd()
    try:
        replicas = Replicas(etcd)
        try:
            yield replicas
        finally:
            replicas.close()
    finally:
        etcd.close()


@pytest.fixture(scope="module")  # test_tls.py, test_fail_fast.py
def pki(tmp_path_factory):
    """PEM files: a CA, the server's certificate (127.0.0.1, localhost), one
    for another name, a client certificate from the same CA, and a stranger CA
    with its own client."""
    import trustme  # here: every xdist worker imports each test module, few run this

    d = tmp_path_factory.mktemp("pki")
    ca, stranger = trustme.CA(), trustme.CA()
    files = {}

    def write(name: str, blobs) -> None:
        files[name] = str(d / f"{name}.pem")
        with open(files[name], "wb") as f:
            f.write(b"".join(b.bytes() for b in blobs))

    write("ca", [ca.cert_pem])
    write("stranger_ca", [stranger.cert_pem])
    for name, issuer, identities in (("server", ca, ("127.0.0.1", "localhost")), ("other_name", ca, ("example.com",)),
                                     ("client", ca, ("worker-1",)), ("stranger", stranger, ("worker-x",))):
        cert = issuer.issue_cert(*identities)
        write(f"{name}_cert", cert.cert_chain_pems)
        write(f"{name}_key", [cert.private_key_pem])
    return files
