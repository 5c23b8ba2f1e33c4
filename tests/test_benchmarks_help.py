"""Every benchmark answers --help with its usage and what it measures, and
starts nothing: no server, no load process, no socket.

The scripts are found by glob, so a new benchmarks/*.py is covered as soon as
it exists; a module without a `__main__` block (harness.py: what the
benchmarks import) is a library and is skipped. Each runs as a user would run
it, `python benchmarks/X.py --help`, with a sitecustomize.py put first on its
PYTHONPATH that only records, through Python's audit hooks and
multiprocessing, any process it starts or socket it binds.
"""

from __future__ import annotations

import ast
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

SITECUSTOMIZE = textwrap.dedent('''
    """Test-only: records what a --help run starts; changes nothing."""
    import os, sys

    _LOG = os.environ["BENCH_HELP_LOG"]
    _STARTS = ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
               "pty.spawn", "socket.bind", "socket.connect")

    def _record(what):
        with open(_LOG, "a") as f:
            f.write(what + "\\n")

    def _hook(event, args):
        if event in _STARTS:
            _record(f"{event} {args!r:.300}")

    sys.addaudithook(_hook)

    import multiprocessing.process as _mp  # spawn's fork_exec raises no audit event
    _start = _mp.BaseProcess.start

    def _recorded_start(self, *a, **k):
        _record(f"multiprocessing.Process.start {self!r:.300}")
        return _start(self, *a, **k)

    _mp.BaseProcess.start = _recorded_start
''')


def is_script(path: pathlib.Path) -> bool:
    """Has a module-level `if __name__ == "__main__":`."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            names = [n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)]
            values = [n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)]
            if names == ["__name__"] and values == ["__main__"]:
                return True
    return False


SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if is_script(p))


def test_discovery_finds_the_scripts_and_skips_the_library():
    names = {p.name for p in SCRIPTS}
    assert {"join_scale.py", "relay.py", "describe_page.py", "burst_heap.py"} <= names
    assert "harness.py" not in names  # imported by the others, no __main__


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage_and_starts_nothing(script, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "started.txt"
    env = {**os.environ, "BENCH_HELP_LOG": str(log),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    t = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script), "--help"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        left = session_left(proc.pid)  # anything it started and left behind
        if proc.poll() is None or left:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    elapsed = time.monotonic() - t
    assert proc.returncode == 0, f"{script.name} --help exited {proc.returncode}:\n{out}"
    assert out.startswith("usage:"), f"{script.name} printed before its usage (did it start?):\n{out[:2000]}"
    assert not log.exists(), f"{script.name} --help started:\n{log.read_text()}"
    assert not left, f"{script.name} --help left processes running: {left}"
    assert elapsed < 20, f"{script.name} --help took {elapsed:.1f} s"
    doc = ast.get_docstring(ast.parse(script.read_text()))
    assert doc, f"{script.name} has no docstring to say what it measures"
    assert doc.splitlines()[0].strip() in out, f"{script.name} --help does not say what it measures:\n{out}"


def session_left(sid: int) -> list[str]:
    """Processes still in session `sid` (the script's own, started with start_new_session)."""
    left = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == sid:
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # field 6 of /proc/PID/stat: the session id
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                left.append(f"{entry.name} {cmdline[:200]}")
        except (OSError, IndexError, ValueError):
            continue
    return left
