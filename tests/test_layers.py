"""The halves stand apart, and the code keeps its shape: the server never
imports the client nor the client the server, the shared base (common/)
imports neither, no class name is defined in both halves, and no module of
the server grows past what one head holds. Read from the source (AST)."""

from __future__ import annotations

import ast
import collections
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The import name of each folder: client/ is `commctx`, the others below it.
PACKAGES = {"client": "commctx", "common": "commctx.common", "server": "commctx.server", "proto/commctx/v1": "commctx.v1"}


def modules(folder: str) -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def imported(path: pathlib.Path, folder: str) -> set[str]:
    """The absolute names of the commctx modules `path` imports (relative imports resolved)."""
    package = PACKAGES[folder] + "." + ".".join(path.relative_to(ROOT / folder).with_suffix("").parts)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: -node.level]
                out.add(".".join([*base, node.module] if node.module else base))
            else:
                out.add(node.module or "")
    return {m for m in out if m == "commctx" or m.startswith("commctx.")}


def half(module: str) -> str:
    """Which half a commctx module belongs to: server, common, wire, or client."""
    if module.startswith("commctx.server"):
        return "server"
    if module.startswith("commctx.common"):
        return "common"
    if module.startswith("commctx.v1"):
        return "wire"
    return "client"


@pytest.mark.parametrize("folder, allowed", [
    ("server", {"server", "common", "wire"}),
    ("client", {"client", "common", "wire"}),
    ("common", {"common"}),
])
def test_each_half_imports_only_itself_and_the_shared_base(folder, allowed):
    wrong = {str(p.relative_to(ROOT)): sorted(m for m in imported(p, folder) if half(m) not in allowed)
             for p in modules(folder)}
    assert not {p: m for p, m in wrong.items() if m}


def test_no_class_name_is_defined_in_both_halves():
    where = collections.defaultdict(set)
    for folder in ("server", "client", "common"):
        for p in modules(folder):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ClassDef):
                    where[node.name].add(str(p.relative_to(ROOT)))
    assert not {name: sorted(paths) for name, paths in where.items() if len(paths) > 1}


def test_server_modules_fit_in_a_head():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules("server")}
    assert not {p: n for p, n in sizes.items() if n > 500}
    assert sizes["server/rendezvous/machine.py"] < 400
