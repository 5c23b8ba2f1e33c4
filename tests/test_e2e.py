"""End to end: a real server process, real worker processes running
torch.distributed (gloo), and network namespaces standing in for hosts."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server, running, worker
from .conftest import holds_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def check_world(results: list[dict], layout: dict[str, int]) -> None:
    """Asserts ranks, groups and all_reduce sums for workers laid out as
    {node key: workers}, nodes in node-rank order."""
    world = sum(layout.values())
    assert sorted(r["rank"] for r in results) == list(range(world))
    first = {}
    rank = 0
    for node_rank, size in enumerate(layout.values()):
        first[node_rank] = rank
        rank += size
    for r in results:
        nr, lr = r["node_rank"], r["in_node_rank"]
        size = list(layout.values())[nr]
        intra = list(range(first[nr], first[nr] + size))
        inter = [first[n] + lr for n, s in enumerate(layout.values()) if s > lr]
        assert r["rank"] == first[nr] + lr
        assert r["groups"] == {"GLOBAL": list(range(world)), "INTRA_NODE": intra, "INTER_NODE": inter}
        assert r["group_ranks"] == {"GLOBAL": r["rank"], "INTRA_NODE": lr, "INTER_NODE": inter.index(r["rank"])}
        assert r["group_sizes"] == {"GLOBAL": world, "INTRA_NODE": size, "INTER_NODE": len(inter)}
        # all_reduce of (rank + 1) over each group
        assert r["sums"] == {m: float(sum(x + 1 for x in g)) for m, g in r["groups"].items()}
        assert (r["num_nodes"], r["local_world_size"], r["world_size"], r["generation"]) == (len(layout), size, world, 1)
        assert r["is_main"] == (r["rank"] == 0)
        assert r["same_singleton"] and r["intra_is_group"] and r["inter_is_group"]
        assert r["backend"] == "gloo"
        env = r["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(r["rank"]), str(lr), str(world))
        assert (env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == (str(size), str(nr))
        assert r["dist_url"] == f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"


def test_one_host_on_loopback():
    """Four workers on 127.0.0.1, one node; then the server dies, the job runs on,
    a peer is killed, and destroy() still returns promptly."""
    server = Server("127.0.0.1", "--lease-ttl-s", "1.0")
    address = server.address
    workers = [worker(address, "local", 4, name=f"w{i}") for i in range(4)]
    with running([server, *workers]):
        results = [w.event(120) for w in workers]
        layout = {"this-host": 4}
        check_world(results, layout)
        assert {r["env"]["GLOO_SOCKET_IFNAME"] for r in results} == {"lo"}
        assert {r["env"]["MASTER_ADDR"] for r in results} == {"127.0.0.1"}

        # Leases are renewed: after three TTLs every member is still there. The time must pass (a negative
        # check, not a wait for something): DescribeJob is asked throughout and must never see a member gone.
        def formed_with_all() -> bool:
            d = asyncio.run(_describe(address, "local"))
            return (d.state, d.joined) == (pb.JobDescription.FORMED, 4)

        holds_for(formed_with_all, 3.0, "the job formed, its four members in it", interval_s=0.2)
        description = asyncio.run(_describe(address, "local"))
        assert (description.state, description.joined) == (pb.JobDescription.FORMED, 4)

        # The server goes away: the running job is not disturbed.
        server.kill()
        for w in workers:
            w.send("reduce")
        for w, r in zip(workers, results):
            assert w.event(60)["sums"] == r["sums"]
        for w in workers:
            assert w.log().count("unreachable") <= 1, w.log()  # one warning per outage, no flood

        # A peer dies; the others still destroy in bounded time and reset the singleton.
        by_rank = {r["rank"]: w for r, w in zip(results, workers)}
        by_rank[3].kill()
        for rank in (0, 1, 2):
            by_rank[rank].send("destroy")
        for rank in (0, 1, 2):
            done = by_rank[rank].event(60)  # bounded: without it, destroy would wait on the dead peer forever
            assert done["fresh"] and not done["initialized"]
            assert by_rank[rank].popen.wait(30) == 0


@pytest.mark.parametrize("layout", [{"host-a": 2, "host-b": 2}, {"host-a": 3, "host-b": 1}], ids=["2+2", "3+1"])
def test_two_hosts_in_network_namespaces(hosts, layout):
    """Workers in two namespaces with their own addresses and hostnames (which do
    not resolve); nobody sets GLOO_SOCKET_IFNAME."""
    server = Server(hosts.server_ip)
    world = sum(layout.values())
    workers = []
    for (hostname, count), ns in zip(layout.items(), hosts.names):
        workers += [worker(server.address, "ns", world, netns=ns, hostname=hostname, name=f"{hostname}-{i}") for i in range(count)]
    with running([server, *workers]):
        results = [w.event(120) for w in workers]
        check_world(results, layout)
        ip_of = dict(zip(layout, hosts.ips))
        for (hostname, count), w_results in _by_host(layout, results):
            for r in w_results:
                assert r["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
                assert r["node_rank"] == list(layout).index(hostname)
        # rank 0 lives on host-a (node rank 0) and serves the store on its own address
        assert {r["env"]["MASTER_ADDR"] for r in results} == {ip_of["host-a"]}
        for w in workers:
            w.send("destroy")
        for w in workers:
            assert w.event(60)["event"] == "destroyed"
            assert w.popen.wait(30) == 0


def _by_host(layout: dict[str, int], results: list[dict]):
    out = []
    start = 0
    for hostname, count in layout.items():
        out.append(((hostname, count), [r for r in results if start <= r["rank"] < start + count]))
        start += count
    return out


async def _describe(address: str, job: str) -> pb.JobDescription:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.RendezvousStub(channel).DescribeJob(pb.DescribeJobRequest(job_id=job), timeout=5)


def test_tensor_and_data_parallel_across_two_hosts(hosts):
    """2 hosts × 2 workers, tp=2 inside each host, dp=2 across them; a gloo twin of DATA_PARALLEL."""
    spec = {"layout": {"tp": 2, "dp": 2, "within_node": ["tp"]}, "cpu_twins": ["DATA_PARALLEL"]}
    server = Server(hosts.server_ip)
    workers = [
        worker(server.address, "3d", 4, netns=ns, hostname=host, name=f"{host}-{i}", spec=spec)
        for host, ns in zip(("host-a", "host-b"), hosts.names)
        for i in range(2)
    ]
    with running([server, *workers]):
        results = {r["rank"]: r for r in (w.event(120) for w in workers)}
        assert sorted(results) == [0, 1, 2, 3]
        for rank, r in results.items():
            node = rank // 2
            assert r["groups"]["TENSOR_PARALLEL"] == [2 * node, 2 * node + 1] == r["groups"]["INTRA_NODE"]
            assert r["groups"]["DATA_PARALLEL"] == r["groups"]["DATA_PARALLEL_CPU"] == [rank % 2, rank % 2 + 2]
            assert r["groups"]["PIPELINE_PARALLEL"] == [rank]
            assert r["sums"] == {m: float(sum(x + 1 for x in g)) for m, g in r["groups"].items()}
            assert r["sums"]["TENSOR_PARALLEL"] == (3.0, 7.0)[node]
            assert r["sums"]["DATA_PARALLEL"] == (4.0, 6.0)[rank % 2]
        for w in workers:
            w.send("destroy")
        for w in workers:
            assert w.event(60)["event"] == "destroyed"


RL_SPEC = {
    "roles": [{"role": "trainer", "count": 2}, {"role": "rollout", "count": 4}],
    "groups": [
        {"mode": "TRAIN_DATA_PARALLEL", "role_group": {"roles": ["trainer"]}},
        {"mode": "WEIGHT_TRANSFER", "weight_transfer": {"sender_role": "trainer", "receiver_roles": ["rollout"], "scope": "SCOPE_NODE"}},
    ],
}


def test_rl_trainers_and_rollouts_across_two_hosts(hosts):
    """Each host runs 1 trainer and 2 rollout workers: all_reduce over the trainers,
    broadcast from each host's trainer to its rollouts over WEIGHT_TRANSFER."""
    server = Server(hosts.server_ip)
    workers = []
    for host, ns in zip(("host-a", "host-b"), hosts.names):
        # the trainer is started last, so it need not get local rank 0
        for role in ("rollout", "rollout", "trainer"):
            workers.append(worker(server.address, "rl", 6, netns=ns, hostname=host, name=f"{host}-{role}-{len(workers)}", role=role, spec=RL_SPEC))
    with running([server, *workers]):
        results = [w.event(120) for w in workers]
        trainers = sorted(r["rank"] for r in results if r["role"] == "trainer")
        assert len(trainers) == 2 and trainers[0] < 3 <= trainers[1]
        for r in results:
            node = r["rank"] // 3
            wt = r["groups"]["WEIGHT_TRANSFER"]
            assert wt == [3 * node, 3 * node + 1, 3 * node + 2]
            assert r["roots"]["WEIGHT_TRANSFER"] == trainers[node]
            # every worker of the node received its trainer's value
            assert r["broadcasts"]["WEIGHT_TRANSFER"] == 1000.0 + trainers[node]
            if r["role"] == "trainer":
                assert r["groups"]["TRAIN_DATA_PARALLEL"] == trainers
                assert r["sums"]["TRAIN_DATA_PARALLEL"] == float(sum(t + 1 for t in trainers))
            else:
                assert "TRAIN_DATA_PARALLEL" not in r["groups"]
            assert r["sums"] == {m: float(sum(x + 1 for x in g)) for m, g in r["groups"].items()}
        for w in workers:
            w.send("destroy")
        for w in workers:
            assert w.event(60)["event"] == "destroyed"


def test_two_jobs_whose_rank_0_share_a_host_do_not_collide():
    """Each rank 0 serves its job's store on a port it has held since it joined."""
    server = Server("127.0.0.1")
    workers = [worker(server.address, job, 1, name=job) for job in ("job-x", "job-y")]
    with running([server, *workers]):
        results = [w.event(120) for w in workers]
        assert [r["rank"] for r in results] == [0, 0]
        ports = {r["env"]["MASTER_PORT"] for r in results}
        assert len(ports) == 2
        for w in workers:
            w.send("destroy")
        for w in workers:
            assert w.event(60)["event"] == "destroyed"
