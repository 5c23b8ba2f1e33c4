"""`commctx plan`: the dry run prints what the server would assign."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from commctx.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]

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


# -- a spec file that cannot be used: one line naming the file and why, no traceback --------


def plan_with_spec(spec: str) -> subprocess.CompletedProcess:
    return subprocess.run(["commctx", "plan", "--nodes", "1", "--per-node", "2", "--spec", spec],
                          capture_output=True, text=True, timeout=60)


def assert_one_line(out: subprocess.CompletedProcess, *parts: str) -> None:
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.endswith("\n"), out.stderr
    assert "Traceback" not in out.stderr
    for part in parts:
        assert part in out.stderr, out.stderr


def test_a_missing_spec_file_is_one_line(tmp_path):
    missing = tmp_path / "missing.json"
    out = plan_with_spec(str(missing))
    assert_one_line(out, f"commctx plan: cannot read --spec {missing}: No such file or directory")
    assert_one_line(plan_with_spec(str(tmp_path)), f"cannot read --spec {tmp_path}: Is a directory")


def test_the_readme_s_commctx_plan_spec_missing_json_is_one_line(tmp_path):
    """Exactly `commctx plan --spec missing.json`: the file's problem first, then the missing shape."""
    out = subprocess.run(["commctx", "plan", "--spec", "missing.json"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert_one_line(out, "commctx plan: cannot read --spec missing.json: No such file or directory")
    out = subprocess.run(["commctx", "plan"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert_one_line(out, "commctx plan: give the world's shape: --nodes N [--per-node M], or --local-sizes 8,8,4")


def test_a_spec_file_that_is_not_json_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"roles": [\n')
    assert_one_line(plan_with_spec(str(bad)), f"commctx plan: --spec {bad} is not JSON: Expecting value (line 2, column 1)")
    bad.write_text("[1, 2]")
    assert_one_line(plan_with_spec(str(bad)), f"--spec {bad} is not a JobSpec: a JSON object is needed, not list")


def test_a_spec_file_with_an_unknown_key_names_it(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"world_sise": 2}))
    assert_one_line(plan_with_spec(str(spec)), f"--spec {spec} is not a JobSpec", '"world_sise"')
    spec.write_text(json.dumps({"layout": {"tpp": 2}}))
    assert_one_line(plan_with_spec(str(spec)), f"--spec {spec} is not a JobSpec", '"tpp"', "JobSpec.layout")


def test_the_shipped_rl_spec_plans(capsys):
    """examples/rl.json, the README's RL job as a file: one trainer and two
    rollout workers on each of two nodes."""
    assert main(["plan", "--nodes", "2", "--per-node", "3", "--node-roles", "trainer,rollout,rollout",
                 "--spec", str(ROOT / "examples" / "rl.json"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 6
    assert [r["role"] for r in plan["ranks"]] == ["trainer", "rollout", "rollout"] * 2
    assert plan["groups"]["TRAIN_DATA_PARALLEL"] == [[0, 3]]
    assert plan["groups"]["WEIGHT_TRANSFER"] == [[0, 1, 2], [3, 4, 5]]
    assert plan["roots"] == {"WEIGHT_TRANSFER": [0, 3]}
