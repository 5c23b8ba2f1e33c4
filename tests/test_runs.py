"""Runs of a job id: a run that ended (finished, failed, closed) is kept,
with who took part and its events, for --retain-ended-s and among the last
--retain-ended-jobs; its id takes a new run once its members are gone, and
nothing of the old run serves in the new one. And a node key is one machine."""

from __future__ import annotations

import pytest

from commctx.common.planning import JobSpec
from commctx.server.errors import Conflict, NotFound
from commctx.server.rendezvous.machine import Rendezvous
from commctx.server.rendezvous.model import JobState, Limits
from commctx.server.rendezvous.params import JoinParams
from commctx.server.rendezvous.store import DeleteJob, PutEvent, PutJob

from .stores import DictStore as MemoryStore  # the contract tests' reference store, keeping records
from .test_machine import TTL, FakeClock, join, params, sessions


def finish(rdzv: Rendezvous, job: str = "job", nodes=("n0", "n1")) -> list[str]:
    """A world of two forms and both leave: a run that finished."""
    spec = JobSpec.build(len(nodes))
    members = [join(rdzv, params(spec, n, job=job))[0] for n in nodes]
    for m in members:
        rdzv.leave(job, m)
    return members


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def rdzv(clock):
    return Rendezvous(lease_ttl_s=TTL, clock=clock, wall=clock)


def test_a_finished_run_is_kept_with_who_took_part_and_its_events(rdzv, clock):
    members = finish(rdzv)
    view = rdzv.describe("job")
    assert (view.state, view.run, view.generation, view.joined) == (JobState.ENDED, 1, 1, 2)  # joined: took part
    assert [(n.node_key, n.node_rank, n.workers) for n in view.nodes] == [("n0", 0, 1), ("n1", 1, 1)]
    assert view.started_at == 1000.0 and view.ended_at == clock.now
    assert "left" in view.reason
    kinds = [e.kind for e in rdzv.events("job")]
    assert kinds[0] == "joined" and "formed" in kinds and kinds[-1] in ("left", "ended")
    assert rdzv.job_page("", 10)[0] == [] and [v.job_id for v in rdzv.job_page("", 10, ended=True)[0]] == ["job"]
    with pytest.raises(NotFound):  # nothing of the old run serves: its members are gone
        rdzv.keep_alive("job", members[0], 1)


def test_the_id_takes_a_new_run_and_the_old_one_stays_listed(rdzv, clock):
    finish(rdzv)
    clock.now += 5
    spec = JobSpec.build(2)
    a, _ = join(rdzv, params(spec, "n0"))
    live = rdzv.describe("job")
    assert (live.state, live.run, live.other_runs, live.generation) == (JobState.FORMING, 2, (1,), 0)
    assert rdzv.describe("job", run=1).state is JobState.ENDED
    assert [e.kind for e in rdzv.events("job")] == ["joined"]  # the new run's history starts afresh
    assert "formed" in [e.kind for e in rdzv.events("job", run=1)]
    with pytest.raises(NotFound, match=r"job 'job' has no run 7 kept on this server \(runs: 2, 1\)"):
        rdzv.describe("job", run=7)
    views, more = rdzv.job_page("", 10, ended=True)  # the live run first, then the kept ones, newest first
    assert [(v.job_id, v.run) for v in views] == [("job", 2), ("job", 1)] and not more
    first, more = rdzv.job_page("", 1, ended=True)
    assert more and [v.run for v in rdzv.job_page(f"job#{first[0].run}", 1, ended=True)[0]] == [1]
    join(rdzv, params(spec, "n1"))
    assert rdzv.describe("job").generation == 1 and rdzv.describe("job").run == 2


def test_a_run_that_never_formed_and_nobody_failed_is_not_kept(rdzv):
    spec = JobSpec.build(2)
    a, _ = join(rdzv, params(spec, "n0"))
    rdzv.withdraw("job", a)  # its Join call ended: nothing ran
    assert rdzv.job_ids() == []
    with pytest.raises(NotFound, match="no job 'job'"):
        rdzv.describe("job")


def test_kept_runs_are_bounded_in_time_and_in_count(clock):
    rdzv = Rendezvous(lease_ttl_s=TTL, clock=clock, wall=clock, limits=Limits(retain_ended_jobs=2, retain_ended_s=60))
    for job in ("a", "a", "b"):
        finish(rdzv, job)
    assert [(v.job_id, v.run) for v in rdzv.job_page("", 10, ended=True)[0]] == [("a", 2), ("b", 1)]  # a's run 1 went first
    clock.now += 61
    actions, _ = rdzv.expire_due()
    assert rdzv.job_ids() == [] and {DeleteJob("a#2"), DeleteJob("b#1")} <= set(actions.writes)


def test_an_ended_run_moves_to_its_own_store_key_with_its_events_and_survives_a_restart(rdzv, clock):
    store = MemoryStore()
    epoch = store.take_over()
    spec = JobSpec.build(2)
    members = []
    for n in ("n0", "n1"):
        m, actions = join(rdzv, params(spec, n))
        store.commit(actions.writes, epoch)
        members.append(m)
    sessions(rdzv, members)
    store.commit(rdzv.leave("job", members[0]).writes, epoch)
    actions = rdzv.leave("job", members[1])
    store.commit(actions.writes, epoch)
    assert DeleteJob("job") in actions.writes
    assert [w.record.job_id for w in actions.writes if isinstance(w, PutJob)] == ["job#1"]
    after = actions.writes[actions.writes.index(DeleteJob("job")):]
    assert {w.job_id for w in after if isinstance(w, PutEvent)} == {"job#1"}
    (record,) = store.load()
    assert (record.job_id, record.run, record.ended, record.state) == ("job#1", 1, clock.now, "ended")
    again = Rendezvous(lease_ttl_s=TTL, clock=FakeClock(), wall=clock)
    again.restore(store.load(), grace_s=TTL)
    assert [(e.kind, e.seq) for e in again.events("job")] == [(e.kind, e.seq) for e in rdzv.events("job")]
    assert again.describe("job").run == 1
    join(again, params(spec, "n0"))
    assert again.describe("job").run == 2  # numbering goes on from the kept run


# -- a node key is one machine ------------------------------------------------------------------


def hosted(spec: JobSpec, node: str, host: str, address: str) -> JoinParams:
    return JoinParams.build(job_id="job", spec=spec, node_key=node, address=address, port=30000, host_id=host)


def test_one_default_node_key_from_two_machines_is_refused_naming_both_addresses(rdzv):
    spec = JobSpec.build(4)
    join(rdzv, hosted(spec, "gpu_3f2a9c1e", "aaaaaaaaaaaaaaaa", "10.0.0.1"))
    join(rdzv, hosted(spec, "gpu_3f2a9c1e", "aaaaaaaaaaaaaaaa", "10.0.0.9"))  # one machine, two NICs: one node
    with pytest.raises(Conflict, match=r"node key 'gpu_3f2a9c1e' of job 'job' arrives from two machines: a worker at "
                                       r"10\.0\.0\.1 joined under it, and this one at 10\.0\.0\.2 is on another machine"):
        rdzv.join(hosted(spec, "gpu_3f2a9c1e", "bbbbbbbbbbbbbbbb", "10.0.0.2"))
    join(rdzv, hosted(spec, "gpu_3f2a9c1e", "", "10.0.0.2"))  # a key pinned on purpose is trusted
    (node,) = rdzv.describe("job").nodes
    assert (node.workers, node.addresses) == (3, ("10.0.0.1", "10.0.0.9", "10.0.0.2"))


def test_a_malformed_host_id_is_refused_by_name():
    from commctx.server.errors import BadRequest

    with pytest.raises(BadRequest, match="host_id 'not-hex' is malformed"):
        hosted(JobSpec.build(2), "n", "not-hex", "10.0.0.1")


# -- through a real server and the commctx tool ------------------------------------------------


def test_a_torchrun_style_run_is_kept_listed_and_its_id_reused_through_the_server():
    """Nodes of a job of nodes (as torchrun's agents join) form, one closes
    the run, both leave: `commctx status --all` lists the closed run, its
    detail names who took part and where, and the same id starts run 2 at
    once (torchrun users rerun one --rdzv-id all day)."""
    import re

    import grpc

    from commctx.v1 import rendezvous_pb2 as pb
    from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

    from .cluster import Server
    from .test_operate import commctx

    def node(key: str, address: str) -> pb.JoinRequest:
        return pb.JoinRequest(job_id="ppo-t1", spec=pb.JobSpec(nodes=pb.Nodes(min=2, max=2)), node_key=key, address=address,
                              master_port=9, workers=2, wait_timeout_ms=30_000)

    server = Server("127.0.0.1")
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.RendezvousStub(ch)
            first = stub.Join.future(node("a", "127.0.0.1"))
            second = stub.Join(node("b", "127.0.0.2"))
            first = first.result(30)
            table = commctx("status", "--addr", server.address).stdout.splitlines()
            assert table[0].split() == ["JOB", "RUN", "STATE", "GEN", "JOINED", "MISSING", "NODES", "AGE", "ENDED", "REASON"]
            assert re.match(r"ppo-t1\s+1\s+formed\s+1\s+4 on 2/2 nodes\s+0\s+2\s+\d+s", table[1]), table
            detail = commctx("status", "--addr", server.address, "--job", "ppo-t1").stdout
            assert "job ppo-t1 (run 1): formed, generation 1, 4 workers on 2/2 nodes joined, 0 missing" in detail, detail
            stub.Leave(pb.LeaveRequest(job_id="ppo-t1", member_id=first.member_id, member_secret=first.member_secret, close=True))
            late = commctx("status", "--addr", server.address, "--job", "ppo-t1").stdout
            assert "closed" in late and "(run 1)" in late
            stub.Leave(pb.LeaveRequest(job_id="ppo-t1", member_id=second.member_id, member_secret=second.member_secret))
            gone = commctx("status", "--addr", server.address, "--all").stdout.splitlines()
            assert re.match(r"ppo-t1\s+1\s+closed\s+1\s+4 on 2/2 nodes\s+0\s+2\s+\d+s ago\s+node 'a' closed it \(its launcher",
                            gone[1]), gone
            kept = commctx("status", "--addr", server.address, "--job", "ppo-t1").stdout
            assert "job ppo-t1 (run 1): closed, generation 1, ended" in kept and "these nodes took part" in kept, kept
            assert re.search(r"^0\s+a\s+127\.0\.0\.1\s+2", kept, re.M) and re.search(r"^1\s+b\s+127\.0\.0\.2\s+2", kept, re.M), kept
            again = [stub.Join.future(node("a", "127.0.0.1")), stub.Join.future(node("b", "127.0.0.2"))]
            assert {f.result(30).assignment.generation for f in again} == {1}  # a new run forms under the same id
            runs = commctx("status", "--addr", server.address, "--all").stdout.splitlines()
            assert [line.split()[:3] for line in runs[1:]] == [["ppo-t1", "2", "formed"], ["ppo-t1", "1", "closed"]], runs
            old = commctx("events", "--addr", server.address, "--job", "ppo-t1", "--run", "1").stdout
            assert "closed it" in old and " formed " in old
            new = commctx("events", "--addr", server.address, "--job", "ppo-t1").stdout
            assert "closed it" not in new and " formed " in new
            with pytest.raises(grpc.RpcError) as stale:  # the old run's member is nobody in the new one
                stub.KeepAlive(pb.KeepAliveRequest(job_id="ppo-t1", member_id=second.member_id,
                                                   member_secret=second.member_secret, generation=1))
            assert stale.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop()


def test_the_json_api_lists_runs_that_ended_and_describes_each():
    """GET /api/v1/jobs?ended=1 lists the live run and the kept ones; ?run=N
    describes one, with who took part, its events, and a stream that ends."""
    import json
    import urllib.error
    import urllib.request

    import grpc

    from commctx.v1 import rendezvous_pb2 as pb
    from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

    from .cluster import Server
    from .conftest import wait_until
    from .test_operate import join_request

    def get(path: str):
        try:
            with urllib.request.urlopen(server.http_url + path.lstrip("/"), timeout=10) as r:
                body = r.read().decode()
                return r.status, json.loads(body) if r.headers["Content-Type"].startswith("application/json") else body
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    server = Server("127.0.0.1", metrics=True)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.RendezvousStub(ch)
            for run in (1, 2):  # two runs of one id, each a world of one that finishes
                joined = stub.Join(join_request("m11", 1))
                assert (joined.assignment.run, joined.assignment.generation) == (run, 1)  # a world is (job, run, generation)
                stub.Leave(pb.LeaveRequest(job_id="m11", member_id=joined.member_id, member_secret=joined.member_secret))
            waiting = stub.Join.future(join_request("m11", 2))  # run 3, forming (held: a dropped future cancels its call)
            wait_until(lambda: stub.DescribeJob(pb.DescribeJobRequest(job_id="m11")).run == 3, 10, "run 3 begins")
            _, live = get("/api/v1/jobs")
            assert [(j["job_id"], j["run"], j["state"]) for j in live["jobs"]] == [("m11", 3, "forming")]
            _, every = get("/api/v1/jobs?ended=1")
            assert [(j["job_id"], j["run"], j["state"], j["ended_at"] is not None) for j in every["jobs"]] == [
                ("m11", 3, "forming", False), ("m11", 2, "ended", True), ("m11", 1, "ended", True)]
            _, page = get("/api/v1/jobs?ended=1&page_size=1")
            _, rest = get(f"/api/v1/jobs?ended=1&page_size=5&page_token={page['next_page_token'].replace('#', '%23')}")
            assert [j["run"] for j in rest["jobs"]] == [2, 1]
            status, one = get("/api/v1/jobs/m11?run=1")
            assert status == 200 and (one["run"], one["state"], one["other_runs"], one["joined"]) == (1, "ended", [3, 2], 1)
            assert [(n["node_key"], n["took_part"], n["workers"]) for n in one["nodes"]] == [("n", 1, [])]
            assert [e["kind"] for e in one["events"]][:2] == ["joined", "formed"] and "left, the last to go" in one["reason"]
            status, stream = get("/api/v1/jobs/m11/events/stream?run=1")
            assert status == 200 and stream.rstrip().endswith("event: end\ndata: {}") and stream.count("event: job-event") >= 3
            status, missing = get("/api/v1/jobs/m11?run=9")
            assert status == 404 and "has no run 9 kept" in missing["error"]
            waiting.cancel()
    finally:
        server.stop()


def test_a_member_of_a_run_that_ended_cannot_enter_the_next_one(rdzv, clock):
    """A worker of run 1 that retries its Join with its member id (a partition,
    a restart) is refused (STALE), also across a restart of the server; a
    Join without the id is a newcomer of run 2."""
    from commctx.server.errors import Stale

    spec = JobSpec.build(1)
    old = "ab" * 8
    join(rdzv, params(spec, "n0", member_id=old))
    store = MemoryStore()
    epoch = store.take_over()
    store.commit(rdzv.leave("job", old).writes, epoch)
    for machine in (rdzv, Rendezvous(lease_ttl_s=TTL, clock=FakeClock(), wall=clock)):
        if machine is not rdzv:
            machine.restore(store.load(), grace_s=TTL)
        with pytest.raises(Stale, match=f"member {old} belongs to run 1 of job 'job', which ended: a worker of a run that "
                                        "ended cannot enter a later one"):
            machine.join(params(spec, "n0", member_id=old))
        joined, _, _ = machine.join(params(spec, "n0"))
        assert machine.describe("job").run == 2 and joined.member_id != old
