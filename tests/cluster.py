"""Real processes for end-to-end tests: the server, workers, and network
namespaces standing in for hosts. Everything started here is stopped here."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import pathlib
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence

WORKER = str(pathlib.Path(__file__).with_name("worker.py"))
PYTHON_EXEC = str(pathlib.Path(__file__).with_name("python_exec.py"))
# Variables a launcher or an earlier test could have left; workers start clean.
_SCRUB = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Forked:
    """A worker the zygote (tests/zygote.py) forked, behind the part of
    subprocess.Popen's interface that Proc and the tests use."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], stderr: int, netns: str | None, hostname: str | None) -> None:
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_zygote())  # (checked up, or started, just now)
        request = {"argv": list(argv), "env": env, "cwd": os.getcwd(), "netns": netns, "hostname": hostname}
        socket.send_fds(self._conn, [json.dumps(request).encode()], [stdin_r, stdout_w, stderr])
        os.close(stdin_r)
        os.close(stdout_w)
        self.stdin = open(stdin_w, "w")  # noqa: SIM115  (closed by Proc.stop)
        self.stdout = open(stdout_r)  # noqa: SIM115
        self._replies = self._conn.makefile("r")
        self.pid: int = json.loads(self._replies.readline())["pid"]
        self.returncode: int | None = None
        self._exited = threading.Event()
        threading.Thread(target=self._await_exit, daemon=True).start()

    def _await_exit(self) -> None:
        line = self._replies.readline()
        self.returncode = json.loads(line)["exit"] if line else -signal.SIGKILL  # no line: the zygote itself is gone
        self._conn.close()
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def forked_run(argv: Sequence[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run([python, *argv], env=env, capture_output=True, text=True,
    timeout=timeout), but forked by the zygote: torch is imported already."""
    with tempfile.TemporaryFile("w+") as err:
        child = Forked(argv, env, err.fileno(), None, None)
        child.stdin.close()
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(child.stdout.read()), daemon=True)
        reader.start()
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            raise
        reader.join(timeout)
        child.stdout.close()
        err.seek(0)
        return subprocess.CompletedProcess(list(argv), code, "".join(out), err.read())


def forked_workers() -> dict[str, str]:
    """The environment of a torchrun agent (or Ray, or a documentation example)
    whose workers the zygote forks (tests/python_exec.py as torchrun's
    PYTHON_EXEC) rather than each starting a fresh interpreter."""
    return {"PYTHON_EXEC": PYTHON_EXEC, "COMMCTX_TEST_ZYGOTE_SOCKET": _zygote()}


_ZYGOTE: tuple[subprocess.Popen, str] | None = None


def _zygote() -> str:
    """The socket of this test process's zygote, started at the first call; in
    a pytest-xdist run, the one zygote of all its workers (_shared_zygote)."""
    global _ZYGOTE
    shared = os.environ.get("COMMCTX_TEST_ZYGOTE")
    if shared:
        return _shared_zygote(*shared.split(":"))
    if _ZYGOTE is None or _ZYGOTE[0].poll() is not None:
        where = tempfile.mkdtemp(prefix="commctx-zygote-")
        atexit.register(shutil.rmtree, where, True)
        path = os.path.join(where, "sock")
        popen = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).with_name("zygote.py")), path],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env())
        if popen.stdout.readline().strip() != "ready":
            raise AssertionError(f"the worker zygote did not start ({popen.wait()})")
        _ZYGOTE = (popen, path)  # it ends with this process: its stdin closes
    return _ZYGOTE[1]


def _shared_zygote(where: str, controller: str) -> str:
    """The zygote every xdist worker of a run shares (conftest.py names its
    directory and the controller's pid): the first worker to need it starts
    it, under a lock; it lives until the controller ends, whichever worker
    started it (one torch import for the run instead of one per worker)."""
    path = os.path.join(where, "sock")
    with open(os.path.join(where, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(path)
            return path  # up
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        popen = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).with_name("zygote.py")), path, controller],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=clean_env(),
                                 start_new_session=True)  # not ended with the worker that started it
        if popen.stdout.readline().strip() != "ready":
            raise AssertionError(f"the shared worker zygote did not start ({popen.wait()})")
        popen.stdout.close()
        _SHARED.append(popen)  # held: it outlives this process's use of it
        return path


_SHARED: list[subprocess.Popen] = []


class Proc:
    """A child process whose stdout lines are read by a thread into a queue."""

    def __init__(self, argv: Sequence[str], name: str, env: dict[str, str] | None = None, *,
                 fork: dict | None = None) -> None:
        """`fork`: {"netns", "hostname"}: forked by the zygote; argv is the command line after the
        interpreter (tests/worker.py's, or `-m MODULE ...`)."""
        self.name = name
        self.stderr = tempfile.NamedTemporaryFile(prefix=f"commctx-{name}-", suffix=".log", delete=False)
        if fork is not None:
            self.popen = Forked(argv, {**clean_env(), **(env or {})}, self.stderr.fileno(), **fork)
        else:
            self.popen = subprocess.Popen(
                list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                text=True, env={**clean_env(), **(env or {})}, start_new_session=True,
            )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def line(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no output within {timeout} s\n{self.log()}") from None
        if line is None:
            raise AssertionError(f"{self.name} exited ({self.popen.wait()}) early\n{self.log()}")
        return line

    def event(self, timeout: float = 60.0) -> dict:
        return json.loads(self.line(timeout))

    def send(self, command: str) -> None:
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()

    def log(self) -> str:
        return pathlib.Path(self.stderr.name).read_text()[-4000:]

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def stop(self) -> None:
        """Ends the process (and anything it started in its session)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(OSError):
            self.popen.stdin.close()
        self.stderr.close()
        os.unlink(self.stderr.name)


class Server(Proc):
    """`commctx-server` on a free port; with health/HTTP (metrics, the dashboard), on free ports too."""

    def __init__(self, host: str, *args: str, health: bool = False, metrics: bool = False,
                 env: dict[str, str] | None = None, argv: Sequence[str] | None = None) -> None:
        extra = (["--health-port", "0"] if health else []) + (["--http-port", "0"] if metrics else [])
        if not any(a.startswith("--store") or a.startswith("--state-dir") for a in args):
            extra.append("--store=memory")  # tests that want durable state pass --state-dir
        argv = argv or [sys.executable, "-m", "commctx.server", "--host", host, "--port", "0", *extra, *args]
        super().__init__(argv, "server", env)
        first = self.banner = self.line(30)
        if "listening on" not in first:
            raise AssertionError(f"server did not start: {first!r}\n{self.log()}")
        self.port = int(first.rsplit(":", 1)[1])
        self.address = f"{host}:{self.port}"
        self.health_address = self.line(10).rsplit(" ", 1)[1].strip() if health else None
        self.http_url = self.line(10).split(" on ", 1)[1].split()[0] if metrics else None  # http://host:port/
        self.metrics_url = self.http_url + "metrics" if metrics else None


def worker(server: str, job: str, world_size: int, *, node_key: str | None = None, netns: str | None = None,
           hostname: str | None = None, name: str = "worker", role: str | None = None, spec: dict | None = None,
           env: dict[str, str] | None = None) -> Proc:
    argv = [sys.executable, WORKER, "--server", server, "--job", job, "--world-size", str(world_size)]
    if node_key:
        argv += ["--node-key", node_key]
    if role:
        argv += ["--role", role]
    if spec:
        argv += ["--spec", json.dumps(spec)]
    # Forked by the zygote, torch imported: as `ip netns exec NETNS unshare --uts` (a host
    # of its own, with its own hostname) would start it, without importing torch again.
    return Proc(argv[1:], name, env, fork={"netns": netns, "hostname": hostname})


@contextlib.contextmanager
def running(procs: Sequence[Proc]) -> Iterator[Sequence[Proc]]:
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def netns_available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    probe = f"ccprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "ip netns add failed (no CAP_SYS_ADMIN?)"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Hosts:
    """A bridge in this namespace and one network namespace per host on it.

    The bridge gets .1 (the server listens there); host k gets .(10 + k).
    """

    def __init__(self, count: int) -> None:
        # One maker at a time on this machine: tests run in parallel (pytest -n) would
        # otherwise pick the same free subnet between reading the routes and using it.
        with open("/tmp/commctx-hosts.lock", "w") as lock:  # not TMPDIR: every run on this machine
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._make(count)

    def _make(self, count: int) -> None:
        tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        self.bridge = f"ccbr{tag}"
        self.names = [f"cc{tag}h{k}" for k in range(count)]
        used = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        octet = next(o for o in random.sample(range(1, 255), 254) if f"10.213.{o}." not in used)
        self.prefix = f"10.213.{octet}"
        self.server_ip = f"{self.prefix}.1"
        self.ips = [f"{self.prefix}.{10 + k}" for k in range(count)]
        self._created: list[list[str]] = []
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _ip(self, *args: str, undo: Sequence[str] | None = None) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode != 0:  # say why (a name taken, say), not only the exit status
            raise RuntimeError(f"ip {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
        if undo:
            self._created.append(list(undo))

    def _setup(self) -> None:
        self._ip("link", "add", self.bridge, "type", "bridge", undo=["link", "del", self.bridge])
        self._ip("addr", "add", f"{self.server_ip}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for k, (ns, ip) in enumerate(zip(self.names, self.ips)):
            veth = f"{self.bridge}v{k}"
            self._ip("netns", "add", ns, undo=["netns", "del", ns])
            self._ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("link", "set", veth, "master", self.bridge, "up")
            self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        for undo in reversed(self._created):
            subprocess.run(["ip", *undo], capture_output=True)
        self._created.clear()
