"""TLS against plaintext, in one run: how long one Join takes, how long a new
connection and its first Join take (the handshake), and how long N workers
take to join one job.

The server is its own process, unpinned, with its defaults (SQLite store in a
temporary --state-dir) and a lease TTL of 600 s (nobody renews here); the TLS
server has --tls-cert/--tls-key: a certificate for 127.0.0.1 from a CA made
for the run with trustme (--key-type: ECDSA P-256, trustme's default, or RSA
2048, cert-manager's default). Clients trust that CA
(grpc.ssl_channel_credentials) and keep no TLS session cache (gRPC's
default), so every new connection is a full handshake.

Latency, from this process: --joins sequential Joins, each creating a job of
world_size 1 (a new job id each, formed at once), over one connection opened
beforehand, after --warmup unmeasured ones; then --connects times a new
channel with its own connection (grpc.use_local_subchannel_pool) timed from
its creation to the answer of its first Join, then closed.

Scale, as join_scale.py measures it: N workers join one job of world_size N,
8 per node key, every worker on its own connection, from --procs load
processes. The connections are opened and ready before the clock starts (the
time to open them all, handshakes included, is shown apart); then every
process sends all its Joins at once, and the clock runs from the first Join
sent to the last answer. Server CPU is its user + system time over each phase.

Every run starts fresh servers; plaintext and TLS alternate, --repeat times;
every run is printed, then the ratio TLS / plaintext of the medians.

    python benchmarks/tls_join.py [--workers 10000] [--procs 4] [--repeat 3] [--joins 300] [--connects 100] [--key-type ecdsa|rsa]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import tempfile
import time
from multiprocessing.connection import Connection

import grpc
import trustme

from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from harness import commctx_server, cpu_s, start_loads, tune_gc

WORKERS_PER_NODE = 8
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def open_channel(address: str, root: bytes | None, aio: bool = False) -> grpc.Channel | grpc.aio.Channel:
    """A channel on its own connection: TLS trusting `root`, or plaintext when None."""
    module = grpc.aio if aio else grpc
    if root is None:
        return module.insecure_channel(address, options=OWN_CONNECTION)
    return module.secure_channel(address, grpc.ssl_channel_credentials(root), options=OWN_CONNECTION)


def single(job: str) -> pb.JoinRequest:
    return pb.JoinRequest(job_id=job, spec=pb.JobSpec(world_size=1), node_key="n", address="127.0.0.1", master_port=29500)


def latency(address: str, root: bytes | None, warmup: int, joins: int, connects: int) -> tuple[list[float], list[float]]:
    """Seconds of each Join over an open connection, and of each new connection + first Join."""
    with open_channel(address, root) as ch:
        stub = pb_grpc.RendezvousStub(ch)
        for i in range(warmup):
            stub.Join(single(f"warm-{i}"), timeout=30)
        joined = []
        for i in range(joins):
            t0 = time.perf_counter()
            stub.Join(single(f"open-{i}"), timeout=30)
            joined.append(time.perf_counter() - t0)
    connected = []
    for i in range(connects):
        t0 = time.perf_counter()
        with open_channel(address, root) as ch:
            pb_grpc.RendezvousStub(ch).Join(single(f"new-{i}"), timeout=30)
            connected.append(time.perf_counter() - t0)
    return joined, connected


def load(first: int, count: int, address: str, root: bytes | None, total: int, conn: Connection) -> None:
    tune_gc()
    asyncio.run(_load(address, root, first, count, total, conn))


async def _load(address: str, root: bytes | None, first: int, count: int, total: int, conn: Connection) -> None:
    requests = [
        pb.JoinRequest(job_id="burst", spec=pb.JobSpec(world_size=total), node_key=f"node{(first + i) // WORKERS_PER_NODE}",
                       address="127.0.0.1", master_port=20000 + (first + i) % 40000, wait_timeout_ms=300_000)
        for i in range(count)
    ]
    conn.send("started")
    await asyncio.to_thread(conn.recv)
    begun = time.monotonic()
    channels = [open_channel(address, root, aio=True) for _ in range(count)]
    await asyncio.gather(*(asyncio.wait_for(c.channel_ready(), 300) for c in channels))
    conn.send((begun, time.monotonic()))
    stubs = [pb_grpc.RendezvousStub(c) for c in channels]
    await asyncio.to_thread(conn.recv)
    started = time.monotonic()
    responses = await asyncio.gather(*(stub.Join(r) for stub, r in zip(stubs, requests)))
    conn.send((started, time.monotonic(), [r.assignment.rank for r in responses]))
    for c in channels:
        await c.close()


def scale(address: str, root: bytes | None, pid: int, n: int, procs: int) -> dict:
    pipes, workers = start_loads(load, n, procs, address, root, n)
    for c in pipes:
        assert c.poll(120) and c.recv() == "started"
    c0 = cpu_s(pid)
    for c in pipes:
        c.send("connect")
    opened = [c.recv() for c in pipes]
    c1 = cpu_s(pid)
    for c in pipes:
        c.send("join")
    joined = [c.recv() for c in pipes]
    c2 = cpu_s(pid)
    for w in workers:
        w.join(120)
    if sorted(r for _, _, ranks in joined for r in ranks) != list(range(n)):
        raise RuntimeError("ranks are not a permutation")
    return {"connect": max(e for _, e in opened) - min(s for s, _ in opened), "connect_cpu": c1 - c0,
            "join": max(e for _, e, _ in joined) - min(s for s, _, _ in joined), "join_cpu": c2 - c1}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(tls: dict[str, str] | None, args: argparse.Namespace) -> dict:
    root = pathlib.Path(tls["ca"]).read_bytes() if tls else None
    flags = ["--tls-cert", tls["cert"], "--tls-key", tls["key"]] if tls else []
    with tempfile.TemporaryDirectory() as state, \
            commctx_server("--log-level", "warning", "--lease-ttl-s", "600", "--state-dir", state, *flags) as server:
        joined, connected = latency(server.address, root, args.warmup, args.joins, args.connects)
        row = scale(server.address, root, server.proc.pid, args.workers, args.procs)
    return {**row, "join_p50": quantile(joined, 0.5), "join_p99": quantile(joined, 0.99),
            "new_p50": quantile(connected, 0.5), "new_p99": quantile(connected, 0.99)}


def certificates(directory: str, key_type: str) -> dict[str, str]:
    """PEM files of a CA and the server's certificate for 127.0.0.1."""
    kind = trustme.KeyType[key_type.upper()]
    ca = trustme.CA(key_type=kind)
    leaf = ca.issue_cert("127.0.0.1", "localhost", key_type=kind)
    files = {"ca": ca.cert_pem.bytes(), "cert": b"".join(b.bytes() for b in leaf.cert_chain_pems), "key": leaf.private_key_pem.bytes()}
    for name, blob in files.items():
        pathlib.Path(directory, f"{name}.pem").write_bytes(blob)
    return {name: str(pathlib.Path(directory, f"{name}.pem")) for name in files}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=10_000)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--joins", type=int, default=300)
    p.add_argument("--connects", type=int, default=100)
    p.add_argument("--key-type", choices=("ecdsa", "rsa"), default="ecdsa")
    args = p.parse_args()
    print(f"# servers unpinned, SQLite store; TLS: {args.key_type.upper()} server key; latency: {args.joins} Joins on an open "
          f"connection, {args.connects} new connections + first Join; scale: {args.workers} workers, one connection each, "
          f"from {args.procs} load processes")
    print(f"{'server':<9} {'Join p50/p99':>17} {'new conn + Join p50/p99':>24}   {args.workers} workers: {'connect':>8} {'server CPU':>10}"
          f" {'first join -> last answer':>26} {'server CPU':>10}")
    runs: dict[str, list[dict]] = {"plaintext": [], "tls": []}
    with tempfile.TemporaryDirectory() as pki:
        tls = certificates(pki, args.key_type)
        for _ in range(args.repeat):
            for kind in runs:
                r = measure(tls if kind == "tls" else None, args)
                runs[kind].append(r)
                print(f"{kind:<9} {r['join_p50'] * 1000:>6.2f} /{r['join_p99'] * 1000:>6.2f} ms {r['new_p50'] * 1000:>13.2f} /"
                      f"{r['new_p99'] * 1000:>6.2f} ms   {'':>{len(str(args.workers)) + 10}}{r['connect']:>6.2f} s {r['connect_cpu']:>8.2f} s"
                      f" {r['join']:>24.3f} s {r['join_cpu']:>8.2f} s", flush=True)

    def ratio(key: str) -> str:
        return f"{statistics.median(r[key] for r in runs['tls']) / statistics.median(r[key] for r in runs['plaintext']):.2f}x"

    print(f"TLS / plaintext (medians): Join p50 {ratio('join_p50')}, p99 {ratio('join_p99')}; new connection + Join p50 "
          f"{ratio('new_p50')}, p99 {ratio('new_p99')}; {args.workers} workers: connect {ratio('connect')} "
          f"(server CPU {ratio('connect_cpu')}), first join -> last answer {ratio('join')} (server CPU {ratio('join_cpu')})")


if __name__ == "__main__":
    main()
