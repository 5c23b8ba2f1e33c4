#!/usr/bin/env python3
"""The interpreter torchrun starts the tests' workers with (PYTHON_EXEC), and
the `python` the documentation's shell examples find first on their PATH in
tests/test_readme.py: each program is forked by the test zygote
(tests/zygote.py), torch already imported, instead of a fresh interpreter
importing it again, seconds of CPU each.

It runs as `python [-u] SCRIPT ARGS` or `python [-u] -m MODULE ARGS`; any other
command line (no zygote named, `-c`, other options, a script that is no file)
is handed to the real interpreter as it is. It hands the zygote its
arguments, environment, directory, stdin/stdout/stderr and its network and
UTS namespaces (its caller's host), passes the signals its caller sends it
(torch stops a worker with killpg) on to the worker, and exits as the worker
did. If it is killed outright, the zygote sees its connection close and kills
the worker. Only the standard library: it starts in milliseconds.
"""

import json
import os
import signal
import socket
import sys


def forkable(argv: list[str]) -> bool:
    """Whether the zygote runs this command line as the interpreter would."""
    rest = argv[1:] if argv[:1] == ["-u"] else argv
    return bool(rest) and ((rest[0] == "-m" and len(rest) > 1) or (not rest[0].startswith("-") and os.path.isfile(rest[0])))


def main() -> None:
    if "COMMCTX_TEST_ZYGOTE_SOCKET" not in os.environ or not forkable(sys.argv[1:]):
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ["COMMCTX_TEST_ZYGOTE_SOCKET"])
    namespaces = [os.open(f"/proc/self/ns/{kind}", os.O_RDONLY) for kind in ("net", "uts")]
    request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "netns": None, "hostname": None}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2, *namespaces])
    replies = conn.makefile("r")
    pid = json.loads(replies.readline())["pid"]

    def forward(sig: int, _frame) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    line = replies.readline()
    code = json.loads(line)["exit"] if line else -signal.SIGKILL  # no line: the zygote is gone, and so is the worker
    if code < 0:  # ended by a signal: so does this process, as the agent expects of its worker
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
