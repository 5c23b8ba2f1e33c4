"""MkDocs hook: the reference pages that are generated from the code at build time.

A page asks for a generated part with a marker line:

    <!-- generated: settings -->   every server setting: flag, variable, default,
                                   meaning, from commctx.server.config.SETTINGS
    <!-- generated: cli -->        the --help of commctx-server, of commctx and of
                                   each of its subcommands (found as commctx.cli.main
                                   builds them)
    <!-- generated: error-reasons -->  every ErrorReason of the protocol: its comment in
                                   the .proto, the gRPC status the server answers it
                                   with (server/rpc/status.py) and the exception the
                                   client raises for it (commctx.transport)

So these pages cannot drift from the code: `mkdocs build` renders what the
installed code says. An unknown marker fails the build.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from collections.abc import Callable, Sequence
from unittest import mock

MARKER = re.compile(r"^<!-- generated: (?P<what>[a-z-]+) -->$", re.M)
COLUMNS = "100"  # argparse wraps --help to the terminal's width: a fixed one here


def _cell(text: str) -> str:
    """Plain text as one Markdown table cell: no markup, no raw HTML."""
    for char, escaped in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|"), ("*", "\\*"), ("\n", " ")):
        text = text.replace(char, escaped)
    return text


def settings_table() -> str:
    from commctx.server.config import SETTINGS

    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        default = f"`{s.default}`" if s.default else "*(unset)*"
        rows.append(f"| `{s.flag}` | `{s.env}` | {default} | {_cell(s.help)} |")
    return "\n".join(rows)


def _help_of(main: Callable[[Sequence[str]], object], argv: Sequence[str]) -> str:
    out = io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": COLUMNS}), contextlib.redirect_stdout(out):
        try:
            main(list(argv))
        except SystemExit:
            pass
    return out.getvalue().rstrip()


def cli_help() -> str:
    from commctx import cli
    from commctx.server.config import parser

    with mock.patch.dict(os.environ, {"COLUMNS": COLUMNS}):
        server = parser().format_help().rstrip()
    subparsers: list[argparse._SubParsersAction] = []
    real = argparse.ArgumentParser.add_subparsers

    def spy(self, *args, **kwargs):
        action = real(self, *args, **kwargs)
        subparsers.append(action)
        return action

    with mock.patch.object(argparse.ArgumentParser, "add_subparsers", spy):
        top = _help_of(cli.main, ["--help"])
    if len(subparsers) != 1:
        raise RuntimeError(f"docs/hooks.py: expected commctx.cli.main to build one set of subcommands, found {len(subparsers)}")
    parts = ["## `commctx-server`", "", "```text", server, "```", "", "## `commctx`", "", "```text", top, "```", ""]
    for name in subparsers[0].choices:
        parts += [f"### `commctx {name}`", "", "```text", _help_of(cli.main, [name, "--help"]), "```", ""]
    return "\n".join(parts).rstrip()


def error_reasons() -> str:
    import pathlib

    import grpc

    import commctx
    import commctx.v1
    from commctx import transport
    from commctx.server.rpc.status import STATUS_OF
    from commctx.v1 import rendezvous_pb2 as pb

    proto = (pathlib.Path(commctx.v1.__file__).parent / "rendezvous.proto").read_text()
    body = re.search(r"enum ErrorReason \{(.*?)\n\}", proto, re.S).group(1)
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in body.splitlines():
        line = line.strip()
        if line.startswith("//"):
            pending.append(line[2:].strip())
        elif m := re.match(r"([A-Z_]+) = \d+;", line):
            comments[m.group(1)] = " ".join(pending)
            pending = []
    status = {pb.ErrorReason.Name(reason): code.name for code, reason in STATUS_OF.values()}
    rows = ["| reason | gRPC status | exception | meaning (from the .proto) |", "|---|---|---|---|"]
    for name in pb.ErrorReason.keys():
        if name == "ERROR_REASON_UNSPECIFIED":
            continue
        if name not in status:
            raise RuntimeError(f"docs/hooks.py: ErrorReason {name} has no status in server/rpc/status.py STATUS_OF")
        code = status[name]
        cls = transport._BY_REASON.get(name) or transport._BY_CODE.get(getattr(grpc.StatusCode, code)) or commctx.RendezvousError
        meaning = re.sub(r"^[A-Z_]+: ", "", comments.get(name, ""))
        rows.append(f"| `{name}` | {code} | `commctx.{cls.__name__}` | {_cell(meaning)} |")
    return "\n".join(rows)


GENERATORS: dict[str, Callable[[], str]] = {"settings": settings_table, "cli": cli_help, "error-reasons": error_reasons}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def render(m: re.Match) -> str:
        what = m.group("what")
        if what not in GENERATORS:
            raise ValueError(f"{page.file.src_uri}: unknown marker <!-- generated: {what} --> "
                             f"(known: {', '.join(GENERATORS)})")
        return GENERATORS[what]()

    return MARKER.sub(render, markdown)
