"""The documentation's examples run as written: README.md and every page under docs/.

Conventions, in every one of those Markdown files:

- The runnable fences are ```python, ```sh and ```console. Each is run, unless
  the line right before its fence is `<!-- not run: REASON -->` (REASON says
  why). Other fences (text, yaml, json, ...) are not programs, and indented
  code blocks are not allowed, so that no command escapes this rule.
- ```python: run verbatim, as many times at once as the text right after it
  says ("Start N of these"; else once), each a fresh `python -c` process in an
  empty directory with COMMCTX_SERVER pointing at a real server this test
  starts on 127.0.0.1 (one server for all of them); each must exit 0.
- `<!-- file: NAME -->` right before a ```python block: the program is saved as
  NAME for the file's shell blocks, which must run it; it does not run alone.
- ```sh: the run sh blocks of one file, in order, are one bash script (`set
  -euo pipefail`), run in a network namespace of its own (so that the
  documented default ports, 50051 and 50080, are free, and nothing else is
  reached), in a directory holding the file's saved programs and links to the
  repository's examples/ and deploy/, with this environment's bin first on
  PATH. Its `python SCRIPT` (and torchrun's workers) are forked by the tests'
  zygote, torch imported already (tests/python_exec.py: the same program, run
  as the interpreter runs it, without seconds of `import torch` each); the
  torchrun agent and the ```python blocks above are fresh interpreters. It
  must exit 0 within its deadline; whatever it left running is
  killed. This needs root (`ip netns`), as the two-host tests do; a script
  that uses a tool this machine lacks (curl, openssl, kubectl) is skipped,
  naming it.
- ```console: each `$ ` line is a command, run from the repository root, that
  must print every line shown under it ("..." stands for lines left out).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys

import pytest

from .cluster import PYTHON_EXEC, Server, clean_env, forked_workers, netns_available

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted(p.relative_to(ROOT) for p in (ROOT / "docs").rglob("*.md"))
FILES = [pathlib.Path("README.md"), *DOCS]
RUNNABLE = ("python", "sh", "console")
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>.*\S.*?) -->")
SAVED_AS = re.compile(r"<!-- file: (?P<name>[A-Za-z0-9_.-]+) -->")
FENCE = re.compile(r"^```(?P<lang>[A-Za-z0-9_-]*)(?:\s+\{[^}]*\})?\s*$")
OPTIONAL_TOOLS = ("curl", "openssl", "kubectl")
# Examples run in an environment without the suite's own settings (tests/conftest.py turns the
# servers' HTTP port off, for one) or a launcher's: as a reader's shell would be.
CLEARED = re.compile(r"COMMCTX_.*|TORCHELASTIC_.*")


def lines_of(path: pathlib.Path) -> list[str]:
    return (ROOT / path).read_text(encoding="utf-8").splitlines()


@dataclasses.dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    before: str  # the line right before the fence
    after: str  # the paragraph right after the closing fence

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE

    @property
    def skipped_because(self) -> str | None:
        m = NOT_RUN.fullmatch(self.before.strip())
        return m.group("reason") if m else None

    @property
    def saved_as(self) -> str | None:
        m = SAVED_AS.fullmatch(self.before.strip())
        return m.group("name") if m else None

    @property
    def runs(self) -> bool:
        """Run by this test (by itself, or as part of its file's script)."""
        return self.runnable and self.skipped_because is None

    @property
    def copies(self) -> int:
        m = re.match(r"Start (\d+) of these", self.after)
        return int(m.group(1)) if m else 1


def blocks(path: pathlib.Path) -> list[Block]:
    text, out, i = lines_of(path), [], 0
    while i < len(text):
        m = FENCE.match(text[i])
        if m is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(text)) if text[j].strip() == "```"), None)
        assert end is not None, f"{path}:{i + 1}: a fence that is never closed"
        after = []
        for line in text[end + 2:]:
            if not line.strip():
                break
            after.append(line)
        out.append(Block(path, i + 1, m.group("lang"), "\n".join(text[i + 1:end]) + "\n", text[i - 1] if i else "",
                         " ".join(after)))
        i = end + 1
    return out


ALL = [b for path in FILES for b in blocks(path)]


def indented_code(path: pathlib.Path) -> list[int]:
    """Lines that start an indented code block (outside fences, lists and admonitions)."""
    text, found, fenced = lines_of(path), [], False
    for n, line in enumerate(text):
        if fenced:
            fenced = line.strip() != "```"
            continue
        if FENCE.match(line):
            fenced = True
            continue
        if not line.startswith(("    ", "\t")) or n == 0 or text[n - 1].strip():
            continue
        previous = next((p for p in reversed(text[:n]) if p.strip()), "")
        if not (previous.startswith((" ", "\t", "!!!")) or re.match(r"\s*([-*+]|\d+\.)\s", previous)):
            found.append(n + 1)
    return found


def test_every_example_is_run_or_says_why_not():
    assert {b.lang for b in ALL if b.runs} >= {"python", "sh", "console"}
    for path in FILES:
        text = lines_of(path)
        fences = {b.line - 1: b for b in blocks(path)}
        for n, line in enumerate(text, 1):
            if line.strip().startswith(("<!-- not run", "<!-- file:")):
                block = fences.get(n)
                assert block is not None, f"{path}:{n}: a marker that is not right before a fence"
                assert block.runnable, f"{path}:{n}: a marker before a ```{block.lang} block, which is never run anyway"
                assert block.skipped_because is not None or block.saved_as is not None, f"{path}:{n}: malformed {line!r}"
                assert block.saved_as is None or block.lang == "python", f"{path}:{n}: only python programs are saved"
        for b in blocks(path):
            if b.runnable and b.skipped_because is None and b.saved_as is None:
                assert "<!--" not in b.before, f"{b.where}: malformed marker {b.before!r}"
        assert not indented_code(path), f"{path}: indented code blocks at lines {indented_code(path)}: fence them"


def test_every_saved_program_is_run_by_its_files_script():
    for path in FILES:
        script = shell_script(path)
        for b in blocks(path):
            if b.saved_as is not None:
                assert re.search(rf"\b{re.escape(b.saved_as)}\b", script), f"{b.where}: {b.saved_as} is saved but never run"


# -- python blocks --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    s = Server("127.0.0.1")
    yield s
    s.stop()


def example_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in clean_env().items() if not CLEARED.fullmatch(k)}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["NO_MKDOCS_2_WARNING"] = "1"
    return {**env, **extra}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("block", [b for b in ALL if b.runs and b.lang == "python" and b.saved_as is None],
                         ids=lambda b: b.where)
def test_a_python_block_runs_verbatim(block, server, tmp_path):
    env = example_env(COMMCTX_SERVER=server.address)
    procs = [subprocess.Popen([sys.executable, "-c", block.code], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(block.copies)]
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, f"{block.where} exited {p.returncode}\n{out}\n{err[-3000:]}"


# -- sh blocks: one script per file, in a network namespace of its own --------------------------


def shell_script(path: pathlib.Path) -> str:
    return "".join(b.code for b in blocks(path) if b.runs and b.lang == "sh")


def run_in_namespace(script: str, cwd: pathlib.Path, timeout: float) -> subprocess.CompletedProcess:
    """Runs `script` with bash in a fresh network namespace (loopback up), then kills what it left there."""
    ns = f"ccdoc{os.getpid() % 10000}{random.randrange(1000)}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, capture_output=True)
        # Files, not pipes: a server the script left running must not hold its output open.
        with open(cwd / ".stdout", "w+") as out, open(cwd / ".stderr", "w+") as err:
            shims = cwd / ".forked"  # `python` there is tests/python_exec.py (see the module docstring)
            shims.mkdir()
            (shims / "python").symlink_to(PYTHON_EXEC)
            env = example_env(**forked_workers())
            env["PATH"] = os.pathsep.join([str(shims), env["PATH"]])
            proc = subprocess.Popen(["ip", "netns", "exec", ns, "bash", "-c", "set -euo pipefail\n" + script], cwd=cwd,
                                    env=env, text=True, stdout=out, stderr=err, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                err.write(f"\n(killed after {timeout} s)")
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
    finally:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:  # only what the script started: nothing else lives in this namespace
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def check_readme_walkthrough(out: str) -> None:
    """Four workers, then four under torchrun: each rank 0..3 says sum 10 twice, all on one node."""
    rows = re.findall(r"rank (\d) of 4: sum 10, my node's ranks \[0, 1, 2, 3\]", out)  # lines of processes may interleave
    assert sorted(rows) == sorted(["0", "1", "2", "3"] * 2), out


CHECKS = {pathlib.Path("README.md"): check_readme_walkthrough}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("path", [p for p in FILES if shell_script(p)], ids=str)
@pytest.mark.slow(14)
def test_a_files_shell_blocks_run_as_one_script(path, tmp_path):
    why = netns_available()
    if why:
        pytest.skip(why)
    script = shell_script(path)
    missing = [tool for tool in OPTIONAL_TOOLS if re.search(rf"\b{tool}\b", script) and not shutil.which(tool, path=example_env()["PATH"])]
    if missing:
        pytest.skip(f"{path}'s examples need {', '.join(missing)}")
    for b in blocks(path):
        if b.saved_as is not None:
            (tmp_path / b.saved_as).write_text(b.code)
    for name in ("examples", "deploy"):
        (tmp_path / name).symlink_to(ROOT / name)
    done = run_in_namespace(script, tmp_path, timeout=300)
    assert done.returncode == 0, f"{path}: its shell blocks exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    if path in CHECKS:
        CHECKS[path](done.stdout)


# -- console transcripts ----------------------------------------------------------------------


def transcripts() -> list[tuple[str, str, list[str]]]:
    """(where, command, the output lines shown under it) of each `$ ` line of a run console block."""
    out = []
    for b in ALL:
        if not (b.runs and b.lang == "console"):
            continue
        lines = b.code.splitlines()
        for n, line in enumerate(lines):
            if line.startswith("$ "):
                shown = []
                for more in lines[n + 1:]:
                    if more.startswith("$ "):
                        break
                    shown.append(more)
                out.append((f"{b.path}:{b.line + 1 + n}", line[2:], shown))
    return out


def test_the_console_transcripts_run_and_print_what_is_shown():
    commands = transcripts()
    assert any("--spec examples/rl.json" in c for _, c, _ in commands)
    for where, command, shown in commands:
        out = subprocess.run(shlex.split(command), capture_output=True, text=True, cwd=ROOT, timeout=60, env=example_env())
        assert out.returncode == 0, f"{where}: {command}\n{out.stderr}"
        printed = [l.rstrip() for l in out.stdout.splitlines()]
        for expected in shown:
            if expected.strip() != "...":
                assert expected.rstrip() in printed, f"{where}: {command} did not print {expected!r}\n{out.stdout}"
