"""`torchrun --rdzv-backend=commctx`: real torchrun agents in network
namespaces standing in for hosts, against a real server; workers that call
CommContext.join() with no arguments and all-reduce over gloo."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from commctx.v1 import rendezvous_pb2 as pb

from .cluster import WORKER, Proc, Server, forked_workers, running
from .conftest import wait_until

TRAIN = os.path.join(os.path.dirname(WORKER), "torchrun_train.py")
TTL_S = 3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # agents and workers are given up to 120 s


def torchrun(server: str, job: str, nnodes: str, ns: str, hostname: str, *script_args: str, conf: str = "") -> Proc:
    """A torchrun agent on `hostname` (a network namespace with its own UTS name) with 2 workers."""
    argv = ["-m", "torch.distributed.run", "--rdzv-backend=commctx", f"--rdzv-endpoint={server}",
            f"--rdzv-id={job}", f"--nnodes={nnodes}", "--nproc-per-node=2", "--max-restarts=3", "--monitor-interval=0.2"]
    if conf:
        argv.append(f"--rdzv-conf={conf}")
    argv += [TRAIN, *script_args]
    # Forked by the zygote (torch imported), as `ip netns exec NS unshare --uts` would start
    # it; the agent runs torch.distributed.run as `python -m` does, and starts its workers
    # as processes of their own, which the zygote forks too (cluster.forked_workers).
    return Proc(argv, f"torchrun-{hostname}", forked_workers(), fork={"netns": ns, "hostname": hostname})


def ready(agent: Proc, count: int, timeout: float = 120.0) -> list[dict]:
    """The next `count` JSON lines the agent's workers print (other output skipped)."""
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < count:
        line = agent.line(max(0.1, deadline - time.monotonic()))
        if line.startswith("{"):
            out.append(json.loads(line))
    return sorted(out, key=lambda r: r["rank"])


def test_two_hosts_run_one_world_with_torchruns_ranks(hosts):
    server = Server(hosts.server_ip, metrics=True)
    agents = [torchrun(server.address, "tr", "2", ns, host) for ns, host in zip(hosts.names, ("host-a", "host-b"))]
    with running([server, *agents]):
        results = ready(agents[0], 2) + ready(agents[1], 2)
        assert [r["rank"] for r in results] == [0, 1, 2, 3]
        for r in results:
            # the server's ranks are torchrun's (RANK, GROUP_RANK, LOCAL_RANK), host-a first by name
            assert r["env"] == {"RANK": str(r["rank"]), "GROUP_RANK": str(r["node_rank"]), "LOCAL_RANK": str(r["local_rank"]),
                                "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
            assert (r["node_rank"], r["local_rank"], r["generation"]) == divmod(r["rank"], 2) + (1,)
            node, local = r["node_rank"], r["local_rank"]
            assert r["groups"] == {"GLOBAL": [0, 1, 2, 3], "INTRA_NODE": [2 * node, 2 * node + 1], "INTER_NODE": [local, local + 2]}
            # all_reduce of rank + 1 over each group
            assert r["sums"] == {"GLOBAL": 10.0, "INTRA_NODE": 4.0 * node + 3, "INTER_NODE": 2.0 * local + 4}
        for agent in agents:
            assert agent.popen.wait(60) == 0, agent.log()
        # one membership per node: the two agents' Joins carried all four workers
        metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
        assert "commctx_joins_total 2.0" in metrics


def test_an_elastic_job_restarts_the_survivor_into_a_smaller_world(hosts):
    server = Server(hosts.server_ip, f"--lease-ttl-s={TTL_S}")
    agents = [torchrun(server.address, "el", "1:2", ns, host, "--hold", "90", conf="last_call_timeout=5")
              for ns, host in zip(hosts.names, ("host-a", "host-b"))]
    with running([server, *agents]):
        first = ready(agents[0], 2) + ready(agents[1], 2)
        assert [(r["rank"], r["world_size"], r["generation"]) for r in first] == [(0, 4, 1), (1, 4, 1), (2, 4, 1), (3, 4, 1)]
        killed = time.time()
        agents[1].kill()  # host-b's agent, then its workers (torchrun starts them in sessions of their own)
        for r in first[2:]:
            os.kill(r["pid"], signal.SIGKILL)
        survivors = ready(agents[0], 2, timeout=60)
        assert [(r["rank"], r["node_rank"], r["local_rank"], r["world_size"], r["generation"]) for r in survivors] == [
            (0, 0, 0, 2, 2), (1, 0, 1, 2, 2)]
        # Whether the agent heard of the change first (restart 0) or its workers failed
        # on the dead peers first (restart 1, a re-form that awaits renewals), the next
        # world is the one without host-b: generation 2 is never a world with the dead.
        assert all(r["sums"]["GLOBAL"] == 3.0 and r["restart"] in (0, 1) for r in survivors)
        # the agent started its new workers within the lease TTL + 2 s of the kill
        assert max(r["started"] for r in survivors) - killed < TTL_S + 2


def test_a_bad_endpoint_or_spec_is_one_clear_torchrun_error(tmp_path):
    """Without the netns: the handler's own errors, through the real torchrun CLI."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"world_size": 3}))
    argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=commctx", "--rdzv-endpoint=127.0.0.1:1",
            "--rdzv-id=bad", "--nnodes=1", "--nproc-per-node=2", f"--rdzv-conf=spec={spec}", TRAIN]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert (f"commctx: the spec {spec} gives world_size, but under torchrun the job's size is --nnodes, in nodes of "
            f"any size; leave world_size out") in done.stderr


def test_bad_rdzv_conf_values_are_one_clear_error(tmp_path):
    """--rdzv-conf values the handler cannot use: a RendezvousError naming them, before any connection."""
    from torch.distributed.elastic.rendezvous import RendezvousError

    spec = tmp_path / "spec.json"
    spec.write_text("[1]")
    for conf, said in [({"spec": str(spec)}, f"commctx: the spec {spec} is not a JSON object (a JobSpec)"),
                       ({"join_timeout": "soon"}, "commctx: join_timeout 'soon' is not a number of seconds"),
                       ({"last_call_timeout": "-1"}, "commctx: last_call_timeout '-1' is not a number of seconds")]:
        with pytest.raises(RendezvousError, match=re.escape(said)):
            handlers("127.0.0.1:1", "bad", (1, 2), keys=("a",), **conf)


def test_the_backend_registers_when_a_program_imports_commctx_torchrun_first():
    """Importing commctx.torchrun loads torch's handler registry, which loads this
    module's entry point while the module is half-imported: it must still register."""
    code = ("import commctx.torchrun\n"
            "from torch.distributed.elastic.rendezvous import RendezvousParameters\n"
            "from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler\n"
            "try:\n"
            "    get_rendezvous_handler(RendezvousParameters(backend='commctx', endpoint='127.0.0.1:1', run_id='x',\n"
            "                           min_nodes=1, max_nodes=1, nproc_per_node=1, join_timeout='soon'))\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Exception while registering" not in done.stderr, done.stderr
    assert done.stdout.strip() == "RendezvousError commctx: join_timeout 'soon' is not a number of seconds"


async def test_worker_assignments_come_with_a_node_join(stub):
    """One Join with workers=3 answers with each worker's assignment."""
    response = await stub.Join(pb.JoinRequest(job_id="nodes", spec=pb.JobSpec(world_size=3), node_key="n0",
                                             address="127.0.0.1", master_port=29500, workers=3), timeout=10)
    assert [(a.rank, a.local_rank, a.local_world_size) for a in response.worker_assignments] == [(0, 0, 3), (1, 1, 3), (2, 2, 3)]
    assert response.assignment == response.worker_assignments[0]
    inter = [[g.ranks.runs[0].start for g in a.groups if g.mode == "INTER_NODE"] for a in response.worker_assignments]
    assert inter == [[0], [1], [2]]


def handlers(server: str, job: str, nnodes: tuple[int, int], keys=("a", "b"), **conf) -> list:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    return [get_rendezvous_handler(RendezvousParameters(
        backend="commctx", endpoint=server, run_id=job, min_nodes=nnodes[0], max_nodes=nnodes[1], local_addr="127.0.0.1",
        nproc_per_node=2, node_key=key, **{"join_timeout": 30, **conf})) for key in keys]


def rendezvous_all(hs: list) -> list:
    """next_rendezvous() of every handler at once: (node rank, nodes, master port) by handler."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(hs)) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), hs))
    return [(i.rank, i.world_size, i.bootstrap_store_info.master_port) for i in infos]


def test_the_handler_through_torchs_registry_restarts_and_closes():
    """Two agents' handlers in this process (no torchrun, no netns): the world,
    a restart after a worker failure (a fresh generation for both, a new store
    port), and a node's shutdown closing the run for the other, as torch's API
    says it does."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    server = Server("127.0.0.1", f"--lease-ttl-s={TTL_S}")
    with running([server]):
        hs = handlers(server.address, "h", (1, 2), last_call_timeout=2)
        try:
            first = rendezvous_all(hs)
            assert [r[:2] for r in first] == [(0, 2), (1, 2)] and first[0][2] == first[1][2]
            world = written_world(hs[1])
            assert [(a.rank, a.local_rank, a.generation) for a in world.worker_assignments] == [(2, 0, 1), (3, 1, 1)]
            assert [h.num_nodes_waiting() for h in hs] == [0, 0]
            # b's worker failed: its agent rendezvous again; a is told (a waiting node) and follows
            restarted = []
            b = threading.Thread(target=lambda: restarted.append(hs[1].next_rendezvous()))
            b.start()
            wait_until(lambda: hs[0].num_nodes_waiting() > 0, 15, "a hears of b's restart")
            info = hs[0].next_rendezvous()
            b.join(30)
            assert (info.rank, info.world_size, restarted[0].rank) == (0, 2, 1)
            assert info.bootstrap_store_info.master_port != first[0][2]  # a fresh store
            assert [a.generation for a in written_world(hs[0]).worker_assignments] == [2, 2]
            hs[1].shutdown()  # b's agent finished: the run is closed for everyone
            wait_until(hs[0].is_closed, 15, "a sees the run closed")
            assert hs[0].num_nodes_waiting() == 0  # no restart into a world of one
            with pytest.raises(RendezvousClosedError):
                hs[0].next_rendezvous()
            (late,) = handlers(server.address, "h", (1, 2), keys=("c",), last_call_timeout=2)
            with pytest.raises(RendezvousClosedError, match="was closed"):
                late.next_rendezvous()
            late.shutdown()
        finally:
            for h in hs:
                h.shutdown()


def test_an_agent_s_world_directory_goes_with_it():
    """The directory a handler writes its workers' world into is removed at
    shutdown(), and also when the handler goes without one (an agent torch's
    launcher stops on SIGTERM skips it) or the process exits."""
    import gc

    from .test_user_errors import commctx_handler

    done = commctx_handler()
    where = done._dir
    assert os.path.isdir(where) and os.path.basename(where).startswith("commctx-conf-")
    done.shutdown()
    assert not os.path.exists(where)

    dropped = commctx_handler()
    where, at_exit = dropped._dir, dropped._remove_dir.atexit
    assert os.path.isdir(where) and at_exit
    del dropped
    gc.collect()
    assert not os.path.exists(where)


def test_a_run_id_that_is_no_job_id_is_the_server_s_one_clear_error():
    """--rdzv-id is the job id: one with a '/' is refused naming it, and
    names no path on this host meanwhile (the handler's directory keeps to TMPDIR)."""
    import tempfile

    from torch.distributed.elastic.rendezvous import RendezvousError

    server = Server("127.0.0.1")
    with running([server]):
        (h,) = handlers(server.address, "../up/x", (1, 1), keys=("a",), join_timeout=10)
        try:
            assert os.path.dirname(h._dir) == tempfile.gettempdir()
            with pytest.raises(RendezvousError, match=re.escape("INVALID_ARGUMENT: job_id '../up/x' is malformed: use letters")):
                h.next_rendezvous()
        finally:
            h.shutdown()


def written_world(handler) -> pb.JoinResponse:
    """The assignments the handler wrote for its workers (COMMCTX_TORCHRUN_WORLD)."""
    with open(handler.world_file, "rb") as f:
        return pb.JoinResponse.FromString(f.read())


def test_agents_in_one_process_are_nodes_of_their_own():
    """Two handlers made in one process with the default node key (torch's own
    elastic tests run agents in threads of one process): two nodes, as c10d's
    (host, pid, local id) makes them. Sharing the key host-pid, the second waited
    for a node already joined until its join_timeout."""
    server = Server("127.0.0.1", f"--lease-ttl-s={TTL_S}")
    with running([server]):
        hs = handlers(server.address, "in-one-process", (2, 2), keys=(None, None), join_timeout=15)
        try:
            assert sorted(r[:2] for r in rendezvous_all(hs)) == [(0, 2), (1, 2)]
        finally:
            for h in hs:
                h.shutdown()


def test_rdzv_conf_quotes_no_shell_removed_are_removed():
    """torch's own run.main tests pass "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'"
    in a list, so no shell removes the quotes and torch's parser keeps them
    ("'join_timeout", "5'"); c10d ignores the key it does not know. commctx reads
    the conf as a shell would have passed it, instead of refusing "'join_timeout"."""
    from torch.distributed.elastic.rendezvous import RendezvousError

    (h,) = handlers("127.0.0.1:1", "quoted", (1, 2), keys=("a",),
                    **{"'join_timeout": "5", "last_call_timeout": "1", "timeout": "5'"})
    h.shutdown()
    with pytest.raises(RendezvousError, match=re.escape("commctx: join_timeout 'soon' is not a number of seconds")):
        handlers("127.0.0.1:1", "quoted", (1, 2), keys=("a",), **{"'join_timeout": "soon'"})
