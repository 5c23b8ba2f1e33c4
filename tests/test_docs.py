"""The documentation: the MkDocs site builds with --strict, the README stays a
short front page that keeps its promises, and the hand-written reference pages
name everything the code has (the generated ones cannot miss anything: see
docs/hooks.py). The examples on every page are run by tests/test_readme.py."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import commctx
import commctx.errors
from commctx.server.config import SETTINGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = ROOT / "docs"
TEST_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install -q -c .ci/constraints.txt -e '.[test]' "
                "&& .venv/bin/python -m pytest")


def page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's notice about its successor
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"mkdocs build --strict failed\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return out


def html(site: pathlib.Path, name: str) -> str:
    return (site / name / "index.html").read_text(encoding="utf-8")


def test_the_site_builds_strictly_with_every_page_in_its_nav(site):
    for md in DOCS.rglob("*.md"):
        rel = md.relative_to(DOCS).with_suffix("")
        built = site / ("index.html" if rel.name == "index" else rel / "index.html")
        assert built.is_file(), f"{md.relative_to(ROOT)} was not built"
    assert not list(site.rglob("*.py")), "docs/*.py (the hook, the screenshot script) are not pages"


def test_the_configuration_reference_is_every_setting(site):
    text = html(site, "reference/configuration")
    for s in SETTINGS:
        assert f"<code>{s.flag}</code>" in text and f"<code>{s.env}</code>" in text, s.name
    assert "<!-- generated" not in text


def test_the_cli_reference_is_every_commands_help(site):
    text = html(site, "reference/cli")
    for usage in ("usage: commctx-server", "usage: commctx ", "usage: commctx plan", "usage: commctx health",
                  "usage: commctx status", "usage: commctx events"):
        assert usage in text, usage
    for s in SETTINGS:
        assert s.flag in text, s.flag


def test_the_errors_reference_is_every_reason(site):
    from commctx.v1 import rendezvous_pb2 as pb

    text = html(site, "reference/errors")
    for name in pb.ErrorReason.keys():
        if name != "ERROR_REASON_UNSPECIFIED":
            assert f"<code>{name}</code>" in text, name


def test_the_errors_page_names_every_exception_and_only_real_ones():
    table = page("reference/errors.md").split("## Every exception", 1)[1]
    named = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert len(named) >= 15, named
    classes = {name for name, value in vars(commctx.errors).items()  # (an old name kept as an alias is not another class)
               if isinstance(value, type) and issubclass(value, commctx.errors.CommCtxError) and value.__name__ == name}
    assert set(named) == classes, (set(named) ^ classes)
    for name in named:
        assert getattr(commctx, name) is getattr(commctx.errors, name), name


def test_the_protocol_page_has_every_rpc():
    proto = (ROOT / "proto" / "commctx" / "v1" / "rendezvous.proto").read_text()
    text = page("reference/protocol.md")
    rpcs = re.findall(r"^\s*rpc (\w+)\(", proto, re.M)
    assert len(rpcs) >= 8
    for rpc in rpcs:
        assert f"### {rpc}\n" in text, rpc


def test_the_configuration_page_has_every_variable_the_client_reads():
    text = page("reference/configuration.md")
    read = set()
    for source in (ROOT / "client").glob("*.py"):
        read |= set(re.findall(r"\bCOMMCTX_[A-Z_]*[A-Z]\b", source.read_text()))
    assert "COMMCTX_SERVER" in read
    for name in sorted(read):
        assert f"`{name}`" in text, name


def test_the_operating_page_has_every_metric():
    source = (ROOT / "server" / "telemetry.py").read_text()
    text = page("guides/operating.md")
    names = set(re.findall(r'"(commctx_[a-z_]+)"', source))
    assert len(names) >= 15, names
    for name in sorted(names):
        assert re.search(rf"`{name}(_total)?[`{{]", text), name


def test_every_results_file_has_its_section_and_command():
    text = page("benchmarks.md")
    results = sorted((ROOT / "benchmarks" / "results").glob("*.txt"))
    assert results
    for path in results:
        rel = path.relative_to(ROOT).as_posix()
        assert f"`{rel}`" in text, f"docs/benchmarks.md has no section for {rel}"
        for line in path.read_text().splitlines()[:1]:  # the command that made it, where the file starts with one
            if line.startswith("$ "):
                assert line[2:].strip() in text, f"docs/benchmarks.md does not show {rel}'s command {line!r}"


def test_the_readme_is_a_short_front_page_that_keeps_its_promises():
    lines = README.splitlines()
    assert len(lines) <= 250, len(lines)
    assert TEST_COMMAND in README  # the line CI runs ...
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci  # ... exactly
    assert "`.ci/run`" in README
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).is_file(), link
    assert "torch>=2.4,<3" in README and '"torch>=2.4,<3"' in (ROOT / "pyproject.toml").read_text()


def test_the_worker_extra_adds_no_cuda_package_to_a_cpu_torch(tmp_path):
    """What the README's CPU-only install does after its first line: pip,
    offline, resolves `.[worker]` into this environment, whose torch is a CPU
    build (as the CPU index's would be), and adds no nvidia-* package and no
    other torch. The first line itself (PyTorch's CPU index) needs a network
    this suite does not assume."""
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu\npip install '.[worker]'" in README
    version = importlib.metadata.version("torch")
    if "+cpu" not in version:
        pytest.skip(f"this environment's torch {version} is not a CPU build")
    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    assert not sorted(n for n in names if n.startswith("nvidia-")), "a CPU torch's environment holds CUDA packages"
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--report", str(report), "--no-index",
                           "--no-build-isolation", ".[worker]"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    wanted = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert "commctx" in wanted
    assert not {n for n in wanted if n.startswith("nvidia-") or n in ("torch", "triton")}, wanted
