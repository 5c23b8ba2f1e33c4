"""A fork server for tests/worker.py, torchrun agents and the programs
tests/python_exec.py stands in for (torchrun's and Ray's workers, the
documentation's `python SCRIPT`): imports torch once,
then forks a process for each request, as torch's DataLoader forks its workers
after importing it. The argv is what follows `python`: tests/worker.py's, a
script's, or "-m MODULE ..." (a torchrun agent: `-m torch.distributed.run ...`),
each run as the interpreter would run it.

`import torch` is about 1.9 s of CPU; the end-to-end tests start dozens of
workers, on two cores. The child of a fork is what `ip netns exec NS unshare
--uts sh -c 'hostname H; exec python ARGV'` would have made: its own
session, the network namespace NS, a UTS namespace named H, the environment,
the arguments and the stdin/stdout/stderr the request brings.

Protocol, on the Unix socket given as argv[1]: a client sends one JSON line
{"argv", "env", "cwd", "netns", "hostname"} with three file descriptors (stdin,
stdout, stderr), and optionally two more, network and UTS namespaces to enter
(tests/python_exec.py sends its own); it reads {"pid": N} then, when the
worker ends, {"exit": Popen-style returncode}. A client that closes its
connection first takes its worker with it (SIGKILL); a connection that sends
nothing is ignored (a liveness check). The server ends, killing its workers,
when its stdin closes (the test process that started it is gone), or, given
a pid as argv[2], when that process ends (the pytest-xdist controller: one
zygote serves every worker of the run).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import traceback

import torch  # noqa: F401  (the point: imported once, before any fork)
import torch.distributed  # noqa: F401
import torch.distributed.elastic.rendezvous.registry  # noqa: F401  (torchrun's handlers, commctx's among them)
import torch.distributed.launcher.api  # noqa: F401  (torchrun's agent; not torch.distributed.run itself: runpy runs that)

import commctx  # noqa: F401
import commctx.context  # noqa: F401

CLONE_NEWNET, CLONE_NEWUTS = 0x40000000, 0x04000000
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def _load_worker():
    spec = importlib.util.spec_from_file_location("commctx_test_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _child(request: dict, fds: list[int], worker) -> None:
    """Becomes the worker the request asks for; never returns."""
    code = 1
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter starts: a write to a closed socket is EPIPE
        signal.set_wakeup_fd(-1)
        os.setsid()
        libc = ctypes.CDLL(None, use_errno=True)
        for fd, kind, flag in zip(fds[3:], ("net", "uts"), (CLONE_NEWNET, CLONE_NEWUTS)):
            if os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino and libc.setns(fd, flag) != 0:
                raise OSError(ctypes.get_errno(), f"setns {kind}")
        if request.get("netns"):
            ns = os.open(f"/run/netns/{request['netns']}", os.O_RDONLY)
            if libc.setns(ns, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {request['netns']}")
            os.close(ns)
        if request.get("hostname"):
            if libc.unshare(CLONE_NEWUTS) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS)")
            socket.sethostname(request["hostname"])
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        argv = list(request["argv"])
        if argv[0] == "-u":  # python -u (torchrun starts its workers so): output unbuffered
            argv.pop(0)
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(line_buffering=True, write_through=True)
        if argv[0] == "-m":  # python -m MODULE ARGS (a torchrun agent): as the interpreter runs it
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif os.path.abspath(argv[0]) == WORKER:
            sys.argv = argv
            worker.main()
        else:  # python SCRIPT ARGS
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001  (a closed pipe: nothing more to say)
                pass
        os._exit(code)


def main() -> None:
    worker = _load_worker()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    parent = os.pidfd_open(int(sys.argv[2])) if len(sys.argv) > 2 else sys.stdin
    selector.register(parent, selectors.EVENT_READ, "parent")
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "parent":  # our test process is gone: so are its workers
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                return
            if key.data == "child":
                os.read(wake_r, 4096)
                while children:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        if conn in selector.get_map():
                            selector.unregister(conn)
                        try:
                            conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                        except OSError:
                            pass
                        conn.close()
                continue
            if key.data != "accept":  # a client closed its connection before its worker ended
                selector.unregister(key.fileobj)
                try:
                    os.killpg(key.data, signal.SIGKILL)
                except OSError:
                    pass
                continue
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 5)
            if not message:  # a client checking that this zygote is up
                conn.close()
                continue
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, fds, worker)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            selector.register(conn, selectors.EVENT_READ, pid)  # readable only at its end: clients send nothing more


if __name__ == "__main__":
    main()
