"""The README's examples run as written.

Convention: every ```python block of README.md is run, verbatim, unless the
line right before its fence is `<!-- not run: REASON -->` (REASON says why).
A run block is started as many times at once as the text right after it says
("Start N of these"; else once), each a fresh `python -c` process with
COMMCTX_SERVER pointing at a real server this test starts on 127.0.0.1, and
each must exit 0.

The `$ commctx plan ...` commands the README shows are run from the
repository root (so `--spec examples/rl.json` is the shipped file) and must
print the lines shown under them ("..." stands for lines left out).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import commctx

from .cluster import Server, clean_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>.*\S.*?) -->")


@dataclasses.dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    before: str  # the line right before the fence
    after: str  # the paragraph right after the closing fence

    @property
    def skipped_because(self) -> str | None:
        m = NOT_RUN.fullmatch(self.before.strip())
        return m.group("reason") if m else None

    @property
    def copies(self) -> int:
        m = re.match(r"Start (\d+) of these", self.after)
        return int(m.group(1)) if m else 1


def python_blocks() -> list[Block]:
    blocks, i = [], 0
    while i < len(README):
        if README[i] == "```python":
            end = README.index("```", i + 1)
            after = []
            for line in README[end + 2:]:
                if not line.strip():
                    break
                after.append(line)
            blocks.append(Block(i + 1, "\n".join(README[i + 1:end]) + "\n", README[i - 1] if i else "", " ".join(after)))
            i = end
        i += 1
    return blocks


def test_every_python_block_is_run_or_says_why_not():
    blocks = python_blocks()
    assert blocks and [b for b in blocks if b.skipped_because is None], "no runnable python block"
    for b in blocks:
        assert b.skipped_because is not None or "<!--" not in b.before, f"README.md:{b.line}: malformed marker {b.before!r}"
    # Every marker sits right before a python block (none left behind by an edit).
    markers = [n + 1 for n, line in enumerate(README) if "<!-- not run" in line]
    assert markers == [b.line - 1 for b in blocks if b.skipped_because is not None]


def test_the_worker_snippet_is_what_the_text_around_it_says():
    (worker,) = [b for b in python_blocks() if b.skipped_because is None and "CommContext.join(" in b.code]
    world_size = int(re.search(r"world_size=(\d+)", worker.code).group(1))
    assert worker.copies == world_size == 4, (worker.copies, world_size)  # "Start 4 of these"
    lead_in = "\n".join(README[max(0, worker.line - 8):worker.line - 1])
    assert "export COMMCTX_SERVER=" in lead_in  # where the snippet's join finds the server
    assert "rendezvous-host" not in worker.code  # no placeholder to edit in the code itself


@pytest.mark.timeout(400)
@pytest.mark.parametrize("block", [b for b in python_blocks() if b.skipped_because is None],
                         ids=lambda b: f"README.md:{b.line}")
def test_a_python_block_runs_verbatim(block, tmp_path):
    server = Server("127.0.0.1")
    procs = []
    try:
        env = {**clean_env(), "COMMCTX_SERVER": server.address}
        for k in ("COMMCTX_JOB_ID", "COMMCTX_TOKEN", "COMMCTX_TLS_CA", "COMMCTX_JOB_SECRET", "TORCHELASTIC_RUN_ID"):
            env.pop(k, None)
        procs = [subprocess.Popen([sys.executable, "-c", block.code], cwd=tmp_path, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(block.copies)]
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.stop()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, f"README.md:{block.line} exited {p.returncode}\n{out}\n{err[-3000:]}"
    if "CommContext.join(" in block.code:  # the worker: one line each, `rank in-node-rank [inter-node group]`
        rows = []
        for out, _ in results:
            m = re.fullmatch(r"(\d+) (\d+) \[(\d+)\]\n", out)
            assert m, out
            rows.append(tuple(int(x) for x in m.groups()))
        n = block.copies
        assert sorted(r[0] for r in rows) == list(range(n))  # every global rank once
        assert sorted(r[1] for r in rows) == list(range(n))  # all on this host: one node of n
        assert all(inter == rank for rank, _, inter in rows)  # one node: each INTER_NODE group is the rank alone


def plan_commands() -> list[tuple[int, str, list[str]]]:
    """(line, command, the output lines shown under it) of each `$ commctx plan` in the README."""
    out, i = [], 0
    while i < len(README):
        m = re.match(r"^(\s*)\$ (commctx plan .*)$", README[i])
        if not m:
            i += 1
            continue
        indent, command, start = m.group(1), m.group(2), i + 1
        while command.endswith("\\"):
            i += 1
            command = command[:-1] + " " + README[i].strip()
        shown = []
        i += 1
        while i < len(README) and README[i].strip() and not README[i].lstrip().startswith("$ "):
            shown.append(README[i][len(indent):])
            i += 1
        out.append((start, command, shown))
    return out


def test_the_plan_commands_shown_run_and_print_what_is_shown():
    commands = plan_commands()
    assert any("--spec examples/rl.json" in c for _, c, _ in commands)
    for line, command, shown in commands:
        out = subprocess.run(shlex.split(command), capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 0, f"README.md:{line}: {command}\n{out.stderr}"
        printed = [l.rstrip() for l in out.stdout.splitlines()]
        for expected in shown:
            if expected.strip() != "...":
                assert expected.rstrip() in printed, f"README.md:{line}: {command} did not print {expected!r}\n{out.stdout}"


def test_the_errors_table_names_real_exceptions():
    start = README.index("### Errors")
    rows = []
    for line in README[start:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[2].startswith("`"):
            rows.append(cells[2].strip("`"))
    assert len(rows) >= 10, rows
    assert "all under `commctx.CommCtxError`" in "\n".join(README[start:start + 5]).replace("\n", " ")
    for name in rows + ["CommContextError", "InvalidRequest"]:
        assert issubclass(getattr(commctx, name), commctx.CommCtxError), name
