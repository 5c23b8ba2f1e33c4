"""`commctx plan`: the dry run prints what the server would assign."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from commctx.cli import main

MEGATRON = """\
TENSOR_PARALLEL    [0, 1] [2, 3] [4, 5] [6, 7] [8, 9] [10, 11] [12, 13] [14, 15]
SEQUENCE_PARALLEL  [0] [1] [2] [3] [4] [5] [6] [7] [8] [9] [10] [11] [12] [13] [14] [15]
EXPERT             [0] [1] [2] [3] [4] [5] [6] [7] [8] [9] [10] [11] [12] [13] [14] [15]
DATA_PARALLEL      [0, 2] [1, 3] [4, 6] [5, 7] [8, 10] [9, 11] [12, 14] [13, 15]
PIPELINE_PARALLEL  [0, 4, 8, 12] [1, 5, 9, 13] [2, 6, 10, 14] [3, 7, 11, 15]"""


def test_megatron_example_is_printed_exactly(capsys):
    assert main(["plan", "--nodes", "2", "--per-node", "8", "--tp", "2", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("world: 16 workers on 2 nodes (8, 8)\nlayout: tp=2 cp=1 ep=1 dp=2 pp=4 order=tp-cp-ep-dp-pp\n")
    assert out.rstrip().endswith(MEGATRON)
    assert "   15     1 node1            7" in out


def test_rl_world_as_json_through_the_console_script(tmp_path):
    spec = tmp_path / "rl.json"
    spec.write_text(json.dumps({
        "roles": [{"role": "trainer", "count": 2}, {"role": "rollout", "count": 4}],
        "groups": [
            {"mode": "TRAIN_DATA_PARALLEL", "role_group": {"roles": ["trainer"]}},
            {"mode": "WEIGHT_TRANSFER", "weight_transfer": {"sender_role": "trainer", "receiver_roles": ["rollout"], "scope": "SCOPE_NODE"}},
        ],
    }))
    out = subprocess.run(
        ["commctx", "plan", "--nodes", "2", "--per-node", "3", "--node-roles", "rollout,trainer,rollout", "--spec", str(spec), "--json"],
        capture_output=True, text=True, check=True,
    ).stdout
    plan = json.loads(out)
    assert [r["role"] for r in plan["ranks"]] == ["rollout", "trainer", "rollout"] * 2
    assert plan["groups"]["TRAIN_DATA_PARALLEL"] == [[1, 4]]
    assert plan["groups"]["WEIGHT_TRANSFER"] == [[0, 1, 2], [3, 4, 5]]
    assert plan["roots"] == {"WEIGHT_TRANSFER": [1, 4]}


def test_roles_and_layout_from_flags(capsys):
    assert main(["plan", "--nodes", "2", "--per-node", "2", "--roles", "trainer:2,rollout:2",
                 "--node-roles", "trainer,rollout", "--tp", "2", "--within-node", "tp", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [r["role"] for r in plan["ranks"]] == ["trainer", "rollout", "trainer", "rollout"]
    assert plan["groups"]["TENSOR_PARALLEL"] == [[0, 1], [2, 3]]
    assert main(["plan", "--nodes", "1", "--per-node", "2", "--roles", "trainer:3"]) == 1
    assert "role counts add up to 3 (trainer 3) but world_size is 2" in capsys.readouterr().err


def test_a_world_that_cannot_form_says_why(capsys):
    assert main(["plan", "--local-sizes", "3,3", "--tp", "2", "--within-node", "tp"]) == 1
    err = capsys.readouterr().err
    assert "this world cannot form: TENSOR_PARALLEL group [2, 3] spans nodes 'node0' and 'node1'" in err
    assert main(["plan", "--nodes", "2", "--per-node", "3", "--tp", "4"]) == 1
    assert "world_size 6 is not divisible by tp×cp×ep×pp = 4×1×1×1 = 4" in capsys.readouterr().err


def test_bad_arguments_are_usage_errors():
    out = subprocess.run([sys.executable, "-m", "commctx.cli", "plan", "--local-sizes", "3,x"], capture_output=True, text=True)
    assert out.returncode == 2 and "'3,x' is not a comma-separated list of numbers" in out.stderr
    with pytest.raises(SystemExit, match="--node-roles names 1 roles but a node has 2 workers"):
        main(["plan", "--nodes", "1", "--per-node", "2", "--node-roles", "a"])
