"""The checked-in generated code must be exactly what proto/regen.py produces."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_generated_code_matches_the_proto(tmp_path):
    spec = importlib.util.spec_from_file_location("regen", ROOT / "proto" / "regen.py")
    regen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regen)
    regen.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        checked_in = ROOT / "proto" / rel
        assert checked_in.exists(), f"{rel} is generated but not checked in; run: python proto/regen.py"
        assert checked_in.read_text() == (tmp_path / rel).read_text(), f"{rel} is stale; run: python proto/regen.py"
