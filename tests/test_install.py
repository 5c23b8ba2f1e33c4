"""Installing commctx keeps the user's torch: pip, offline, resolves
`commctx[worker]` (this checkout's real metadata, built as a wheel) into fresh
environments that already hold a stub torch. A torch in the supported range
stays; one below it is upgraded. Every other dependency is a stub wheel too,
so nothing is downloaded."""

from __future__ import annotations

import base64
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip"]


def stub_wheel(directory: pathlib.Path, name: str, version: str) -> None:
    """A wheel of `name` `version` that installs one empty module and needs nothing."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{name.replace('-', '_')}_stub/__init__.py": b"",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: commctx-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
              for path, data in files.items()] + [f"{dist}.dist-info/RECORD,,"]
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as whl:
        for path, data in files.items():
            whl.writestr(path, data)
        whl.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> pathlib.Path:
    """This checkout's wheel, and a stub of each dependency at the lowest version it admits."""
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([*PIP, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)], check=True,
                   capture_output=True, timeout=300)
    (ours,) = out.glob("commctx-*.whl")
    with zipfile.ZipFile(ours) as whl:
        metadata = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in metadata.splitlines():
        m = re.match(r"Requires-Dist: ([A-Za-z0-9_.-]+)\s*\(?([^;)]*)\)?\s*(;.*)?$", line)
        if m is None or "extra ==" in (m.group(3) or "") and "worker" not in m.group(3):
            continue
        name, spec = m.group(1), m.group(2)
        if name == "torch":
            continue  # the stubs of torch are the point: made below
        low = re.search(r">=\s*([0-9][0-9.]*)", spec)
        stub_wheel(out, name, low.group(1) if low else "1.0")
    stub_wheel(out, "torch", "2.13.0")  # what an index would offer
    return out


def resolve(tmp_path: pathlib.Path, wheels: pathlib.Path, installed_torch: str) -> dict[str, str]:
    """What pip would install for commctx[worker] into an environment that holds torch `installed_torch`."""
    env = tmp_path / f"env-{installed_torch}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    local = tmp_path / f"torch-{installed_torch}"
    local.mkdir()
    stub_wheel(local, "torch", installed_torch)
    python = ["--python", str(env / "bin" / "python")]
    subprocess.run([*PIP, *python, "install", "-q", "--no-index", "--find-links", str(local), f"torch=={installed_torch}"],
                   check=True, capture_output=True, timeout=300)
    report = tmp_path / f"report-{installed_torch}.json"
    subprocess.run([*PIP, *python, "install", "-q", "--dry-run", "--report", str(report), "--no-index", "--find-links",
                    str(wheels), "commctx[worker]"], check=True, capture_output=True, timeout=300)
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


@pytest.mark.slow(16)
def test_the_worker_extra_keeps_a_torch_in_range_and_upgrades_one_below_it(tmp_path, wheels):
    kept = resolve(tmp_path, wheels, "2.9.0")
    assert "commctx" in kept and "torch" not in kept  # the user's torch 2.9 stays
    assert resolve(tmp_path, wheels, "2.3.0")["torch"] == "2.13.0"  # below the range: replaced
