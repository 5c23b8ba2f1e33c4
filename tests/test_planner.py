"""The pure planner: hand-checked tables and properties over random worlds,
and proof that planning loads neither gRPC nor protobuf."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commctx.common.modes import GLOBAL, INTER_NODE, INTRA_NODE
from commctx.common.planning import (
    Candidate,
    JobSpec,
    PlanError,
    RankRun,
    build_plan,
    compress,
    expand,
    node_sort_key,
    plan_world,
    seat,
)


@pytest.mark.parametrize("module, allowed", [
    ("commctx.common.planning", ()),
    ("commctx.server.rendezvous.machine", ()),  # the state machine: no event loop either
    ("commctx.server.rendezvous.executor", ("asyncio",)),
])
def test_layers_import_only_what_they_need(module, allowed):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in ('grpc', 'google.protobuf', 'asyncio', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(sorted(allowed))


def members(layout: list[tuple[str, int | None, int | None]]) -> list[Candidate]:
    """(node key, local rank or None, node rank or None) per worker, in join order."""
    return [
        Candidate(f"m{i}", key, f"10.0.0.{i + 1}", 30000 + i, local_rank, node_rank)
        for i, (key, local_rank, node_rank) in enumerate(layout)
    ]


def ranks_by_member(plan) -> dict[str, tuple[int, int, int]]:
    return {p.member_id: (p.rank, p.node_rank, p.local_rank) for p in plan.all_seats()}


def groups(plan, mode: str) -> list[list[int]]:
    return [expand(g.ranks) for g in plan.all_groups()[mode]]


def test_numeric_aware_node_order():
    keys = ["node66", "node7", "node10", "node7b", "a", "node007"]
    # equal numbers ("node7", "node007") fall back to the raw string
    assert sorted(keys, key=node_sort_key) == ["a", "node007", "node7", "node7b", "node10", "node66"]


def test_two_nodes_in_join_order():
    # Workers of node66 join first; node7 still gets node rank 0.
    plan = plan_world(members([("node66", None, None), ("node7", None, None), ("node66", None, None), ("node7", None, None)]), JobSpec.build(4))
    assert ranks_by_member(plan) == {
        "m1": (0, 0, 0),
        "m3": (1, 0, 1),
        "m0": (2, 1, 0),
        "m2": (3, 1, 1),
    }
    assert [n.node_key for n in plan.nodes] == ["node7", "node66"]
    assert groups(plan, GLOBAL) == [[0, 1, 2, 3]]
    assert groups(plan, INTRA_NODE) == [[0, 1], [2, 3]]
    assert groups(plan, INTER_NODE) == [[0, 2], [1, 3]]
    # rank 0 is m1: its address and port are the master endpoint
    assert (plan.master_addr, plan.master_port) == ("10.0.0.2", 30001)
    assert plan.dist_url == "tcp://10.0.0.2:30001"


def test_heterogeneous_nodes():
    plan = plan_world(members([("b", None, None), ("a", None, None), ("a", None, None), ("a", None, None), ("c", None, None), ("c", None, None)]), JobSpec.build(6))
    assert [(n.node_key, n.first_rank, n.size) for n in plan.nodes] == [("a", 0, 3), ("b", 3, 1), ("c", 4, 2)]
    assert groups(plan, INTRA_NODE) == [[0, 1, 2], [3], [4, 5]]
    # local rank 2 exists only on node a; local rank 1 on a and c
    assert groups(plan, INTER_NODE) == [[0, 3, 4], [1, 5], [2]]
    assert plan.num_nodes == 3


def test_explicit_local_ranks_kept_and_gaps_filled_in_join_order():
    plan = plan_world(members([("n", 2, None), ("n", None, None), ("n", 0, None), ("n", None, None)]), JobSpec.build(4))
    assert {m: p[2] for m, p in ranks_by_member(plan).items()} == {"m0": 2, "m1": 1, "m2": 0, "m3": 3}


def test_explicit_node_ranks_override_key_order():
    plan = plan_world(members([("a", None, 1), ("b", None, None), ("c", None, 0)]), JobSpec.build(3))
    assert [n.node_key for n in plan.nodes] == ["c", "a", "b"]


@pytest.mark.parametrize(
    "layout, world_size, message",
    [
        ([("n", 3, None), ("n", None, None)], 2, "node 'n' has 2 workers but one asked for local_rank 3"),
        ([("a", None, 5), ("b", None, None)], 2, "node 'a' asked for node_rank 5 but the job has 2 nodes"),
        ([("a", None, 0), ("a", None, 1)], 2, "node 'a' was given node ranks [0, 1]"),
        ([("a", None, 0), ("b", None, 0)], 2, "nodes 'a' and 'b' both asked for node_rank 0"),
        ([("a", None, None)], 2, "1 workers joined but world_size is 2"),
    ],
)
def test_unsatisfiable_worlds_name_the_numbers(layout, world_size, message):
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan_world(members(layout), JobSpec.build(world_size))


@pytest.mark.parametrize(
    "ranks, runs",
    [
        ([], ()),
        ([5], (RankRun(5, 1, 1),)),
        (list(range(10)), (RankRun(0, 10, 1),)),
        ([0, 8, 16, 24], (RankRun(0, 4, 8),)),
        ([0, 3, 4, 5, 9], (RankRun(0, 2, 3), RankRun(4, 2, 1), RankRun(9, 1, 1))),
    ],
)
def test_compress_table(ranks, runs):
    assert compress(ranks) == runs
    assert expand(runs) == ranks


def test_regular_groups_cost_one_run_at_any_scale():
    n_nodes, per_node = 1250, 8
    plan = plan_world(members([(f"node{i // per_node}", None, None) for i in range(n_nodes * per_node)]), JobSpec.build(10_000))
    for mode, gs in plan.all_groups().items():
        assert all(len(g.ranks) == 1 for g in gs), mode
    assert plan.inter_groups[3].ranks == (RankRun(3, n_nodes, per_node),)


# -- properties -----------------------------------------------------------------------

worlds = st.lists(
    st.tuples(st.integers(0, 7), st.booleans()),  # (node index, give explicit local rank?)
    min_size=1,
    max_size=40,
)


def build(spec: list[tuple[int, bool]]) -> list[Candidate]:
    counts = {node: sum(1 for n, _ in spec if n == node) for node, _ in spec}
    seen: dict[int, int] = {}
    layout = []
    for node, explicit in spec:
        arrival = seen.get(node, 0)
        seen[node] = arrival + 1
        # Explicit ranks in reverse arrival order: valid, unique, and not the order
        # the implicit fill would choose.
        layout.append((f"host{node}", counts[node] - 1 - arrival if explicit else None, None))
    return members(layout)


@settings(max_examples=300, deadline=None)
@given(worlds)
def test_properties(spec):
    ms = build(spec)
    plan = plan_world(ms, JobSpec.build(len(ms)))
    w = len(ms)
    seats = plan.all_seats()
    # ranks are a permutation of 0..W-1
    assert sorted(p.rank for p in seats) == list(range(w))
    # global rank = sizes of lower nodes + local rank; local ranks contiguous per node
    for node in plan.nodes:
        locals_ = sorted(p.local_rank for p in seats if p.node_rank == node.node_rank)
        assert locals_ == list(range(node.size))
    for p in seats:
        assert p.rank == sum(n.size for n in plan.nodes[: p.node_rank]) + p.local_rank
    # INTRA groups partition the world; so do INTER groups
    for mode in (INTRA_NODE, INTER_NODE):
        flat = sorted(r for g in groups(plan, mode) for r in g)
        assert flat == list(range(w)), mode
    # INTER group i holds exactly the local-rank-i workers
    for i, g in enumerate(groups(plan, INTER_NODE)):
        assert g == sorted(p.rank for p in seats if p.local_rank == i)
    # every member's groups contain it, in the canonical order
    for p in seats:
        gs = plan.groups_of(p)
        assert [g.mode for g in gs] == [GLOBAL, INTRA_NODE, INTER_NODE]
        assert all(p.rank in expand(g.ranks) for g in gs)
        assert all(g.size == len(expand(g.ranks)) for g in gs)
    # node order is numeric-aware ascending key order
    keys = [n.node_key for n in plan.nodes]
    assert keys == sorted(keys, key=node_sort_key)
    # same input -> same output; stored seats rebuild the same plan
    again = plan_world(list(ms), JobSpec.build(len(ms)))
    assert ranks_by_member(again) == ranks_by_member(plan)
    assert again.all_groups() == plan.all_groups()
    rebuilt = build_plan(seat(ms, JobSpec.build(len(ms))), JobSpec.build(len(ms)))
    assert ranks_by_member(rebuilt) == ranks_by_member(plan) and rebuilt.all_groups() == plan.all_groups()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 200), unique=True).map(sorted))
def test_compress_roundtrip(ranks):
    runs = compress(ranks)
    assert expand(runs) == ranks
    assert len(runs) <= max(1, len(ranks))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.none() | st.integers(0, 2**32 - 1), st.text(max_size=40),
       st.integers(0, 2**32 - 1))
def test_a_workers_own_fields_written_by_hand_parse_as_protobuf_writes_them(rank, local_rank, previous, role, worker):
    from commctx.server.rpc import wire
    from commctx.v1 import rendezvous_pb2 as pb

    expected = pb.Assignment(rank=rank, local_rank=local_rank, previous_rank=previous, role=role, worker=worker)
    got = pb.Assignment.FromString(wire.own_bytes(rank, local_rank, previous, role, worker))
    assert got == expected and got.HasField("previous_rank") == (previous is not None)
    assert pb.Assignment.FromString(wire.field(0x62, b"\x0a\x03abc" * 50)).groups[0].mode == "abc"  # field 12, 250 bytes
