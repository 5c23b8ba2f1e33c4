"""The halves stand apart, and the code keeps its shape: the server never
imports the client nor the client the server, the shared base (common/)
imports neither, no class name is defined in both halves, the server's layers
hold (server/__init__.py states them) with no import loop among its modules,
and no module of the server grows past what one head holds. Read from the
source (AST): an import under TYPE_CHECKING or inside a function counts."""

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


# The server's layers, bottom up, as server/__init__.py states them: a module
# imports from its own layer and those below; the two edges not from each
# other; the stores, of the rendezvous above them, only model.py (their
# records hold its events). The first entry that names a module places it.
LAYERS = [
    ("base", ("errors.py", "tokens.py")),
    ("stores", ("rendezvous/store.py", "rendezvous/sqlite.py", "rendezvous/etcd.py")),
    ("rendezvous", ("rendezvous/",)),
    ("telemetry", ("telemetry.py",)),
    ("edges", ("rpc/", "web/")),
    ("process", ("main.py", "config.py", "ha.py", "startup.py", "gc_pacer.py", "__init__.py", "__main__.py")),
]
STORES_MAY_IMPORT = {"rendezvous/model.py"}
SERVER = ROOT / "server"


def layer(module: str) -> int:
    """Where a server module (its path under server/) sits in LAYERS."""
    for rank, (_, names) in enumerate(LAYERS):
        if any(module == n or (n.endswith("/") and module.startswith(n)) for n in names):
            return rank
    raise AssertionError(f"server/{module} is in no layer of tests/test_layers.py LAYERS: give it one")


def server_module(name: str) -> str | None:
    """The path under server/ of the module `name` (commctx.server...), or None if it names none."""
    parts = name.split(".")[2:]
    for candidate in (pathlib.Path(*parts).with_suffix(".py") if parts else None, pathlib.Path(*parts, "__init__.py")):
        if candidate is not None and (SERVER / candidate).is_file():
            return candidate.as_posix()
    return None


def server_imports(path: pathlib.Path) -> set[str]:
    """The server modules `path` imports, as paths under server/: `from . import x` is module x."""
    package = "commctx.server." + ".".join(path.relative_to(SERVER).with_suffix("").parts)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package.split(".")[: -node.level], *([node.module] if node.module else [])]) if node.level \
                else node.module or ""
            names = [f"{base}.{a.name}" if server_module(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        out |= {m for n in names if n.startswith("commctx.server") and (m := server_module(n)) is not None}
    return out


def import_graph() -> dict[str, set[str]]:
    return {p.relative_to(SERVER).as_posix(): server_imports(p) for p in modules("server")}


def test_the_server_layers_hold():
    wrong = []
    for module, imports in import_graph().items():
        for target in imports:
            source, to = LAYERS[layer(module)][0], LAYERS[layer(target)][0]
            up = layer(target) > layer(module) and not (source == "stores" and target in STORES_MAY_IMPORT)
            across = {module.split("/")[0], target.split("/")[0]} == {"rpc", "web"}  # one edge importing the other
            if up or across:
                wrong.append(f"server/{module} ({source}) imports server/{target} ({to})")
    assert not wrong


def test_no_import_loops_among_server_modules():
    graph = import_graph()
    loops, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                loops.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in done:
                visit(target, [*path, target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not loops
