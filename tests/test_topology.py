"""Layout, role, weight-transfer and named groups: tables, Megatron's own
example, properties against a reference enumeration, and the spec's errors."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commctx.common.modes import LAYOUT_MODES as DIM_MODES
from commctx.common.planning import DIMS, Candidate, JobSpec, PlanError, expand, layout_groups, plan_world
from commctx.server.errors import BadRequest, Conflict


def spec(world_size: int, **kw) -> dict:
    return dict(world_size=world_size, **kw)


def world(layout: list[tuple[str, str]], s: dict):
    """Plan a world of (node key, role) workers joined in this order."""
    members = [Candidate(f"m{i}", node, f"10.0.0.{i + 1}", 30000 + i, None, None, role) for i, (node, role) in enumerate(layout)]
    return plan_world(members, JobSpec.from_json(s))


def groups_by_mode(plan) -> dict[str, list[list[int]]]:
    return {mode: [expand(g.ranks) for g in gs] for mode, gs in plan.all_groups().items()}


def test_megatron_example_16_ranks_tp2_pp4():
    s = JobSpec.from_json(spec(16, layout=dict(tp=2, pp=4)))
    assert s.layout.sizes == (("tp", 2), ("cp", 1), ("ep", 1), ("dp", 2), ("pp", 4))
    tp = [expand(g.ranks) for g in layout_groups(s.layout, "tp")]
    pp = [expand(g.ranks) for g in layout_groups(s.layout, "pp")]
    dp = [expand(g.ranks) for g in layout_groups(s.layout, "dp")]
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert pp == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert dp == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]


def test_other_orders_follow_megatron():
    # "tp-pp-dp": pipeline varies second fastest
    s = JobSpec.from_json(spec(8, layout=dict(tp=2, pp=2, dp=2, order="tp-pp-dp")))
    assert s.layout.order == "tp-pp-dp-cp-ep"
    assert [expand(g.ranks) for g in layout_groups(s.layout, "pp")] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [expand(g.ranks) for g in layout_groups(s.layout, "dp")] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def reference_groups(sizes: list[int], k: int) -> list[list[int]]:
    """Megatron's generate_masked_orthogonal_rank_groups with only dimension k
    unmasked, written out independently as the oracle."""
    world = math.prod(sizes)
    stride = [math.prod(sizes[:i]) for i in range(len(sizes))]
    other = [i for i in range(len(sizes)) if i != k]
    groups = []
    for g in range(world // sizes[k]):
        coords, rest = {}, g
        for i in other:
            coords[i] = rest % sizes[i]
            rest //= sizes[i]
        base = sum(coords[i] * stride[i] for i in other)
        groups.append([base + j * stride[k] for j in range(sizes[k])])
    return groups


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=5, max_size=5), st.permutations(DIMS))
def test_layout_properties(sizes, order):
    layout_pb = dict(order="-".join(order), **dict(zip(order, sizes)))
    w = math.prod(sizes)
    s = JobSpec.from_json(spec(w, layout=layout_pb))
    for k, d in enumerate(order):
        ours = [expand(g.ranks) for g in layout_groups(s.layout, d)]
        assert ours == reference_groups(sizes, k)
        # every dimension partitions the world
        assert sorted(itertools.chain.from_iterable(ours)) == list(range(w))
    # groups of two different dimensions through a rank meet in that rank only
    plan = plan_world([Candidate(f"m{i}", "n", "10.0.0.1", 1) for i in range(w)], s)
    reference = {DIM_MODES[d]: reference_groups(sizes, k) for k, d in enumerate(order)}
    for p in plan.all_seats():
        mine = {g.mode: set(expand(g.ranks)) for g in plan.groups_of(p)}
        for a, b in itertools.combinations([DIM_MODES[d] for d in DIMS], 2):
            assert mine[a] & mine[b] == {p.rank}
        # a rank's group of each dimension (found by formula, made when asked for) is the oracle's, by index too
        for g in plan.groups_of(p):
            if g.mode in reference:
                assert reference[g.mode][g.index] == expand(g.ranks)


def test_tensor_parallel_inside_nodes():
    s = spec(4, layout=dict(tp=2, dp=2, within_node=["tp"]))
    plan = world([("a", ""), ("a", ""), ("b", ""), ("b", "")], s)
    g = groups_by_mode(plan)
    assert g["TENSOR_PARALLEL"] == [[0, 1], [2, 3]] == g["INTRA_NODE"]
    assert g["DATA_PARALLEL"] == [[0, 2], [1, 3]]
    # every worker holds one group of each of the eight modes, in canonical order
    p = plan.seat_of("m2")
    assert [x.mode for x in plan.groups_of(p)] == [
        "GLOBAL", "INTRA_NODE", "INTER_NODE", "TENSOR_PARALLEL", "SEQUENCE_PARALLEL", "EXPERT", "DATA_PARALLEL", "PIPELINE_PARALLEL",
    ]


def test_a_tensor_group_that_would_span_nodes_fails_with_the_numbers():
    s = spec(6, layout=dict(tp=2, within_node=["tp"]))
    with pytest.raises(PlanError, match=r"TENSOR_PARALLEL group \[2, 3\] spans nodes 'a' and 'b': tp=2 must stay within a node, but the nodes have 3, 3 workers"):
        world([("a", "")] * 3 + [("b", "")] * 3, s)


RL = spec(
    6,
    roles=[dict(role="trainer", count=2), dict(role="rollout", count=4)],
    groups=[
        dict(mode="TRAIN_DATA_PARALLEL", role_group=dict(roles=["trainer"])),
        dict(mode="WEIGHT_TRANSFER", weight_transfer=dict(sender_role="trainer", receiver_roles=["rollout"], scope="SCOPE_NODE")),
        dict(mode="ROLLOUT_NODE", role_group=dict(roles=["rollout"], scope="SCOPE_NODE")),
        dict(mode="PAIRS", named=dict(groups=[dict(ranks=[4, 1]), dict(ranks=[5])])),
    ],
    cpu_twins=["TRAIN_DATA_PARALLEL"],
)


def test_rl_roles_weight_transfer_and_named_groups():
    # Joined out of order; roles decide groups, not ranks.
    plan = world([("n1", "rollout"), ("n0", "rollout"), ("n0", "trainer"), ("n1", "trainer"), ("n0", "rollout"), ("n1", "rollout")], RL)
    assert plan.roles == ("rollout", "trainer", "rollout", "rollout", "trainer", "rollout")
    g = groups_by_mode(plan)
    assert g["TRAIN_DATA_PARALLEL"] == [[1, 4]]
    assert g["WEIGHT_TRANSFER"] == [[0, 1, 2], [3, 4, 5]]
    assert g["ROLLOUT_NODE"] == [[0, 2], [3, 5]]
    assert g["PAIRS"] == [[1, 4], [5]]
    assert all(x.cpu_twin == (x.mode == "TRAIN_DATA_PARALLEL") for gs in plan.all_groups().values() for x in gs)
    # a rollout worker is in no TRAIN_DATA_PARALLEL group; only listed ranks are in PAIRS
    modes_of = {p.rank: [x.mode for x in plan.groups_of(p)] for p in plan.all_seats()}
    assert modes_of[0] == ["GLOBAL", "INTRA_NODE", "INTER_NODE", "WEIGHT_TRANSFER", "ROLLOUT_NODE"]
    assert modes_of[4] == ["GLOBAL", "INTRA_NODE", "INTER_NODE", "TRAIN_DATA_PARALLEL", "WEIGHT_TRANSFER", "PAIRS"]


def test_weight_transfer_without_a_sender_on_a_node():
    with pytest.raises(PlanError, match=r"node 'n1' has 2 rollout workers but no trainer to send weights to them \(WEIGHT_TRANSFER\)"):
        world([("n0", "trainer"), ("n0", "trainer"), ("n0", "rollout"), ("n0", "rollout"), ("n1", "rollout"), ("n1", "rollout")], RL)


@pytest.mark.parametrize(
    "s, error, message",
    [
        (spec(12, layout=dict(tp=2, dp=2, pp=4)), Conflict, "tp×cp×ep×dp×pp = 2×1×1×2×4 = 16 but world_size is 12"),
        (spec(12, layout=dict(tp=8)), Conflict, "world_size 12 is not divisible by tp×cp×ep×pp = 8×1×1×1 = 8"),
        (spec(4, layout=dict(tp=2, order="tp-xx")), BadRequest, "'xx' is not one of tp, cp, ep, dp, pp"),
        (spec(4, layout=dict(tp=2, order="tp-tp")), BadRequest, "names a dimension twice"),
        (spec(4, layout=dict(tp=2, order="tp-pp")), BadRequest, "leaves out dp, whose size is 2"),
        (spec(4, layout=dict(within_node=["zz"])), BadRequest, "within_node 'zz'"),
        (spec(8, roles=[dict(role="trainer", count=2), dict(role="rollout", count=4)]), Conflict,
         "role counts add up to 6 (trainer 2 + rollout 4) but world_size is 8"),
        (spec(2, roles=[dict(role="a", count=0)]), BadRequest, "role 'a' has count 0"),
        (spec(2, groups=[dict(mode="GLOBAL", role_group=dict(roles=["a"]))]), BadRequest, "mode 'GLOBAL' is defined twice"),
        (spec(2, layout=dict(), groups=[dict(mode="EXPERT", role_group=dict(roles=["a"]))]), BadRequest, "'EXPERT' is defined twice"),
        (spec(2, groups=[dict(mode="9bad", role_group=dict(roles=["a"]))]), BadRequest, "groups.mode '9bad' is malformed"),
        (spec(2, groups=[dict(mode="X")]), BadRequest, "group 'X' has no kind"),
        (spec(2, roles=[dict(role="a", count=2)], groups=[dict(mode="X", role_group=dict(roles=["b"]))]), BadRequest,
         "names role 'b', which spec.roles does not declare"),
        (spec(4, groups=[dict(mode="X", named=dict(groups=[dict(ranks=[0, 9])]))]), BadRequest, "names rank 9, not below world_size 4"),
        (spec(4, groups=[dict(mode="X", named=dict(groups=[dict(ranks=[0, 1]), dict(ranks=[1, 2])]))]), BadRequest,
         "puts rank 1 in two groups"),
        (spec(4, cpu_twins=["NOPE"]), BadRequest, "cpu_twins names mode 'NOPE'"),
    ],
)
def test_spec_errors_name_the_numbers(s, error, message):
    with pytest.raises(error) as info:
        JobSpec.from_json(s)
    assert message in str(info.value)


def test_spec_difference_names_the_field():
    a = JobSpec.from_json(spec(16, layout=dict(tp=2, pp=4)))
    b = JobSpec.from_json(spec(16, layout=dict(tp=4, pp=4)))
    assert a.difference(b) == (
        "layout=tp=2 cp=1 ep=1 dp=2 pp=4 order=tp-cp-ep-dp-pp but this worker asked for layout=tp=4 cp=1 ep=1 dp=1 pp=4 order=tp-cp-ep-dp-pp"
    )
