"""The client library in this process: errors, modes, environment, and the
seed API around a one-worker job (real server process, real gloo group)."""

from __future__ import annotations

import os
import re
import socket

import grpc
import pytest
import torch
import torch.distributed as dist
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from commctx import (
    CommContext,
    CommMode,
    GroupNotFound,
    InvalidRequest,
    JobConflict,
    JobFull,
    LauncherEnv,
    MemberNotFound,
    ParallelMode,
    RankTaken,
    RendezvousTimeout,
    ServerUnavailable,
    StaleGeneration,
    UsageError,
)
from commctx.addresses import split_address
from commctx.backends import resolve_backend
from commctx.launched import LaunchedWorker
from commctx.transport import error_from_rpc
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server
from .conftest import wait_until


@pytest.fixture(scope="module")
def server():
    s = Server("127.0.0.1")
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def fresh_context():
    yield
    CommContext().destroy()


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, metadata=()):
        self._code, self._details, self._metadata = code, details, metadata

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._metadata


def rich_status(code: grpc.StatusCode, details: str, reason: str, domain: str = "commctx") -> tuple:
    """The trailing metadata a server sends with a google.rpc.Status holding an ErrorInfo."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=domain))
    status = status_pb2.Status(code=code.value[0], message=details, details=[info])
    return (("grpc-status-details-bin", status.SerializeToString()),)


@pytest.mark.parametrize(
    "code, reason, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", InvalidRequest),
        (grpc.StatusCode.FAILED_PRECONDITION, "JOB_CONFLICT", JobConflict),
        (grpc.StatusCode.FAILED_PRECONDITION, "STALE_GENERATION", StaleGeneration),
        (grpc.StatusCode.ALREADY_EXISTS, "RANK_TAKEN", RankTaken),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "JOB_FULL", JobFull),
        (grpc.StatusCode.NOT_FOUND, "MEMBER_NOT_FOUND", MemberNotFound),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "RENDEZVOUS_TIMEOUT", RendezvousTimeout),
        (grpc.StatusCode.UNAVAILABLE, "SERVER_UNAVAILABLE", ServerUnavailable),
    ],
)
def test_every_status_becomes_a_typed_error(code, reason, cls):
    err = error_from_rpc(FakeRpcError(code, "the details", rich_status(code, "the details", reason)))
    assert type(err) is cls
    assert (err.code, err.details, err.reason) == (code.name, "the details", reason)
    # without details (the call failed before a commctx server answered) the code decides
    bare = error_from_rpc(FakeRpcError(code, "the details"))
    assert type(bare) is (JobConflict if cls is StaleGeneration else cls) and bare.reason == ""
    foreign = error_from_rpc(FakeRpcError(code, "the details", rich_status(code, "the details", reason, domain="other")))
    assert foreign.reason == ""


@pytest.mark.parametrize(
    "addr, expected",
    [("host:123", ("host", 123)), ("host", ("host", 50051)), ("[::1]:9", ("::1", 9)), ("dns:///a.b:7", ("a.b", 7)), ("::1", ("::1", 50051))],
)
def test_split_address(addr, expected):
    assert split_address(addr) == expected


@pytest.mark.parametrize("addr", ["", "host:x", "host:0", ":80"])
def test_split_address_rejects(addr):
    with pytest.raises(ValueError):
        split_address(addr)


def test_modes_are_interchangeable_with_the_seed_strings():
    assert CommMode.GLOBAL == ParallelMode.GLOBAL == "GLOBAL"
    assert {CommMode.INTRA_NODE: 1}["INTRA_NODE"] == 1
    assert ParallelMode("TENSOR_PARALLEL") is ParallelMode.TENSOR_PARALLEL
    assert str(CommMode.INTER_NODE) == "INTER_NODE"


def test_launcher_env_is_read_in_one_place():
    env = LauncherEnv.from_env({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "GLOO_SOCKET_IFNAME": "ib0"})
    assert (env.local_rank, env.local_world_size, env.gloo_socket_ifname, env.nccl_socket_ifname) == (3, 8, "ib0", None)
    assert LauncherEnv.from_env({}) == LauncherEnv()
    with pytest.raises(UsageError, match="LOCAL_RANK='x' is not a non-negative integer"):
        LauncherEnv.from_env({"LOCAL_RANK": "x"})


def test_a_torchrun_worker_checks_its_assignment_against_torchruns_variables(tmp_path):
    """CommContext.join() under torchrun on commctx (LaunchedWorker) takes its own
    assignment from the agent's file and refuses one that disagrees with torchrun."""
    world = pb.JoinResponse()
    for local in range(2):  # node rank 1 of 2 nodes of 2 workers: ranks 2 and 3
        world.worker_assignments.add(job_id="tr", generation=3, rank=2 + local, world_size=4, node_rank=1, num_nodes=2,
                                     local_rank=local, local_world_size=2, master_addr="10.0.0.1", master_port=29500,
                                     dist_url="tcp://10.0.0.1:29500")
    path = tmp_path / "world"
    path.write_bytes(world.SerializeToString())
    torchrun = {"TORCHELASTIC_RUN_ID": "tr", "COMMCTX_TORCHRUN_WORLD": str(path), "LOCAL_RANK": "1", "RANK": "3",
                "GROUP_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}

    def launched(env, job_id=None, world_size=None):
        return LaunchedWorker.from_launcher(LauncherEnv.from_env(env), job_id=job_id, world_size=world_size,
                                            backend="gloo", collective_timeout_s=60)

    a = launched(torchrun).assignment
    assert (a.job_id, a.generation, a.rank, a.node_rank, a.local_rank, a.world_size) == ("tr", 3, 3, 1, 1, 4)
    with pytest.raises(UsageError, match=r"torchrun set RANK=2 but the rendezvous server assigned 3 \(generation 3 of job 'tr'\)"):
        launched({**torchrun, "RANK": "2"})
    with pytest.raises(UsageError, match="torchrun did not set GROUP_RANK but the rendezvous server assigned 1 "):
        launched({k: v for k, v in torchrun.items() if k != "GROUP_RANK"})
    with pytest.raises(UsageError, match="job_id 'other' disagrees with torchrun's --rdzv-id 'tr'"):
        launched(torchrun, job_id="other")
    with pytest.raises(UsageError, match="world_size 8 disagrees with torchrun's world of 4"):
        launched(torchrun, world_size=8)
    with pytest.raises(UsageError, match="cannot read this worker's assignment from COMMCTX_TORCHRUN_WORLD=.*: list index"):
        launched({**torchrun, "LOCAL_RANK": "5"})
    with pytest.raises(UsageError, match="cannot read this worker's assignment from COMMCTX_TORCHRUN_WORLD=/nonexistent"):
        launched({**torchrun, "COMMCTX_TORCHRUN_WORLD": "/nonexistent"})
    with pytest.raises(UsageError, match="RANK='x' is not a non-negative integer"):
        LauncherEnv.from_env({**torchrun, "RANK": "x"})
    assert LauncherEnv.from_env({"RANK": "x"}).rank is None  # read only under torchrun on commctx


def test_uninitialised_context_says_so(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    ctx = CommContext()
    assert CommContext() is ctx and not ctx.is_initialized()
    for call in (ctx.get_global_rank, ctx.is_main_rank, lambda: ctx.get_group(CommMode.GLOBAL), lambda: ctx.init_group([0], "X")):
        with pytest.raises(UsageError, match="not initialised"):
            call()
    with pytest.raises(UsageError, match="local rank unknown"):
        ctx.get_in_node_rank()
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert (ctx.get_in_node_rank(), ctx.get_local_world_size()) == (2, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_backend_auto_is_gloo_without_cuda_and_nccl_is_refused():
    assert resolve_backend("auto") == "gloo"
    with pytest.raises(UsageError, match="backend 'nccl' needs a CUDA device"):
        resolve_backend("nccl")


def test_init_distributed_env_alone_like_the_seed():
    with socket.socket() as s:  # only to learn a free port for tcp:// init; torch binds it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = CommContext()
    ctx.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=f"tcp://127.0.0.1:{port}", timeout=30)
    assert ctx.is_initialized() and ctx.is_main_rank()
    assert ctx.get_group(CommMode.GLOBAL) is dist.group.WORLD
    assert (ctx.get_world_size("GLOBAL"), ctx.get_ranks_in_group(CommMode.GLOBAL)) == (1, [0])
    ctx.init_group([0], mode=ParallelMode.TRAIN_DATA_PARALLEL, backend="gloo")
    x = torch.ones(2)
    dist.all_reduce(x, group=ctx.get_group("TRAIN_DATA_PARALLEL"))
    assert x.tolist() == [1.0, 1.0]
    assert ctx.get_local_rank(ParallelMode.TRAIN_DATA_PARALLEL) == 0
    with pytest.raises(ValueError, match="must lie in 0..0"):
        ctx.init_group([0, 1], mode="X", backend="gloo")
    with pytest.raises(ValueError, match="mode must be"):
        ctx.init_group([0], mode=None, backend="gloo")
    with pytest.raises(GroupNotFound, match="rank 0 has no TENSOR_PARALLEL group"):
        ctx.get_group(ParallelMode.TENSOR_PARALLEL)
    with pytest.raises(UsageError, match="already initialised"):
        ctx.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url="tcp://127.0.0.1:1")
    ctx.destroy()
    assert not dist.is_initialized()
    assert CommContext() is not ctx


def test_join_a_one_worker_job(server, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "1")  # exported values are restored by destroy()
    ctx = CommContext.join(server.address, job_id="solo", world_size=1, timeout=30)
    a = ctx.assignment
    assert (a.rank, a.world_size, a.local_rank, a.node_rank, a.generation) == (0, 1, 0, 0, 1)
    assert ctx.get_ranks_in_group(CommMode.INTRA_NODE) == [0]
    assert ctx.get_group(CommMode.INTRA_NODE) is dist.group.WORLD  # a group of the whole world is WORLD
    assert os.environ["MASTER_PORT"] == str(a.master_port) and a.dist_url.endswith(f":{a.master_port}")
    with pytest.raises(UsageError, match="already initialised"):
        CommContext.join(server.address, job_id="solo2", world_size=1)
    ctx.destroy()
    assert os.environ["MASTER_PORT"] == "1"
    assert not dist.is_initialized()


def test_join_errors_are_typed(server):
    with pytest.raises(InvalidRequest, match="job_id 'bad id' is malformed"):
        CommContext.join(server.address, job_id="bad id", world_size=1)
    with pytest.raises(RendezvousTimeout, match=r"1 of 2 workers joined .*1 missing"):
        CommContext.join(server.address, job_id="lonely", world_size=2, timeout=0.5)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        CommContext.join(server.address, job_id="x", world_size=0)

    # A first worker waits in job "mismatch" with world_size 2 ...
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.RendezvousStub(ch)
        waiting = stub.Join.future(
            pb.JoinRequest(job_id="mismatch", spec=pb.JobSpec(world_size=2), node_key="n", address="127.0.0.1", master_port=9, wait_timeout_ms=10_000)
        )
        wait_until(lambda: _joined(stub, "mismatch"), what="first worker never registered")
        # ... so one asking for 3 is refused, naming both values.
        with pytest.raises(JobConflict, match="has world_size=2 but this worker asked for world_size=3"):
            CommContext.join(server.address, job_id="mismatch", world_size=3, timeout=5)
        waiting.cancel()


def _joined(stub, job_id: str) -> bool:
    try:
        return stub.DescribeJob(pb.DescribeJobRequest(job_id=job_id), timeout=5).joined == 1
    except grpc.RpcError:
        return False


def test_unreachable_server_is_a_typed_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    with pytest.raises(ServerUnavailable, match="no answer from rendezvous server"):
        CommContext.join(f"127.0.0.1:{port}", job_id="x", world_size=1, timeout=0.2)
    with pytest.raises(ServerUnavailable, match="cannot reach rendezvous server nohost.invalid:50051: host 'nohost.invalid'"):
        CommContext.join("nohost.invalid:50051", job_id="x", world_size=1, timeout=0.2)  # not a raw socket.gaierror


def test_a_missing_torch_internal_is_a_commctx_error_naming_the_version(monkeypatch):
    import datetime

    from torch.distributed import distributed_c10d as c10d

    from commctx import _torch

    _torch._helper_keywords.cache_clear()
    monkeypatch.delattr(c10d, "_new_process_group_helper")
    with pytest.raises(UsageError, match=rf"torch {re.escape(torch.__version__)} lacks torch.distributed.distributed_c10d._new_process_group_helper, "
                                               r"which commctx uses to create member-only groups \(tested with torch 2.13\)"):
        _torch.new_member_group([0], "gloo", "g", datetime.timedelta(seconds=1))
    _torch._helper_keywords.cache_clear()
    monkeypatch.delattr(c10d, "_abort_process_group")
    assert not _torch.can_abort()
    with pytest.raises(UsageError, match="_abort_process_group"):
        _torch.abort_process_groups()

    class OldTCPStore:
        def __init__(self, *args, **kwargs):
            if "master_listen_fd" in kwargs:
                raise TypeError("__init__() got an unexpected keyword argument 'master_listen_fd'")

    monkeypatch.setattr(dist, "TCPStore", OldTCPStore)
    with socket.socket() as sock, pytest.raises(UsageError, match=r"lacks TCPStore\(master_listen_fd=...\)"):
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        _torch.store_on_socket("127.0.0.1", sock.getsockname()[1], 1, datetime.timedelta(seconds=1), sock)
        assert sock.fileno() >= 0  # still ours: nothing took it over


def test_the_seed_attributes_are_views_of_one_registry():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = CommContext()
    ctx.init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=f"tcp://127.0.0.1:{port}", timeout=30)
    ctx.init_group([0], mode="PAIRS", backend="gloo")
    assert ctx._global_ranks == {"GLOBAL": 0}
    assert ctx._ranks_in_group == {"GLOBAL": [0], "PAIRS": [0]}
    assert ctx._world_sizes == {"GLOBAL": 1, "PAIRS": 1} and ctx._local_ranks == {"GLOBAL": 0, "PAIRS": 0}
    assert ctx._groups["GLOBAL"] is dist.group.WORLD and set(ctx._groups) == {"GLOBAL", "PAIRS"}
    ctx.destroy()
    assert CommContext()._groups == {}


def test_job_spec_from_a_dict():
    from commctx.arguments import job_spec_of

    s = job_spec_of({"layout": {"tp": 2, "within_node": ["tp"]}, "roles": [{"role": "a", "count": 4}]}, 4)
    assert (s.world_size, s.layout.tp, list(s.layout.within_node), s.roles[0].role) == (4, 2, ["tp"], "a")
    assert job_spec_of(None, 3) == pb.JobSpec(world_size=3)
    with pytest.raises(ValueError, match="spec.world_size 8 disagrees with world_size 4"):
        job_spec_of({"world_size": 8}, 4)
    with pytest.raises(ValueError, match="spec is not a JobSpec"):
        job_spec_of({"layout": {"tq": 2}}, 4)


def test_a_finished_job_is_no_warning_a_failed_one_is(caplog):
    import logging

    from commctx.session import Session

    caplog.set_level(logging.INFO, logger="commctx")
    for ended, level in ((True, logging.INFO), (False, logging.WARNING)):
        session = Session("127.0.0.1:1")
        try:
            assert session._handle(pb.SessionEvent(gone="job 'j' cannot continue: ...", job_ended=ended))  # noqa: SLF001
        finally:
            session.close(leave=False)
        (record,) = [r for r in caplog.records if "is over" in r.getMessage()]
        assert record.levelno == level and session.world_change.final
        caplog.clear()
