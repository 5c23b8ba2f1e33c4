"""Another tenant's lease while one caller brings the biggest world it may:
does the server stay responsive (issue 37, "worlds and workers are bounded")?

A `commctx-server` (its own process, unpinned, SQLite store in a temporary
directory unless --store says otherwise, --lease-ttl-s 10). The victim, in
this process: a 2-worker job, formed, whose member renews its lease with a
KeepAlive every 20 ms from a thread with a connection of its own; every
round trip is kept with when it began. The attacker, a process of its own
(one connection, grpc.aio): --nodes node Joins at once, each workers=1024,
in a job of nodes {"nodes": {"min": NODES - 1, "max": NODES}} (torchrun's
agents); the world forms when the last arrives and each Join is answered
with its 1,024 workers' assignments. Then rank 0's node leaves and the world
re-forms without it (plan, store, the survivors' new world); then the
attacker sends --beyond more node Joins to the job (and to a second job of
as many nodes): past the bound a server refuses them (RESOURCE_EXHAUSTED),
the others wait 2 s (DEADLINE_EXCEEDED: the new rank 0 has not offered a new
spare port, as a live agent's session would); their status codes are counted.
With --hosts the Joins are host memberships of 1,024 host_workers each, in a
job of NODES x 1,024 workers elastic down to one host fewer.

Printed per phase (form: from the first Join sent to the last answered;
re-form: from the Leave to the job formed again; beyond: the refused Joins)
how long it took, and over the whole attack the victim's KeepAlive round
trips: how many, the worst, the 99th percentile and how many took over
100 ms (the target: none), when the three slowest were sent, and whether the
victim's job is still FORMED at the end. The server's own loop lag gauge is
not used: the victim's round trip is what a tenant sees.

    python benchmarks/bounds.py [--nodes 98] [--beyond 8] [--wait-s 300] [--hosts] [--store sqlite|memory] [--repeat 1] [-- SERVER FLAGS...]

With --nodes past the server's bound (the audit's 1,024 nodes: 1,048,576
workers), the Joins past it are refused at once and the others wait
--wait-s for a world that cannot form.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import pathlib
import statistics
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WORKERS = 1024
EVERY_S = 0.02


HOSTS = False  # --hosts: host memberships (JoinRequest.host_workers) instead of node memberships


def node_join(job: str, nodes: int, i: int, wait_ms: int = 300_000):
    from commctx.v1 import rendezvous_pb2 as pb

    common = dict(job_id=job, node_key=f"attacker-{i:05d}", address="127.0.0.1", master_port=20000 + i % 40000,
                  wait_timeout_ms=wait_ms)
    if HOSTS:  # a job of workers, elastic by whole hosts
        spec = pb.JobSpec(world_size=nodes * WORKERS, elastic=pb.Elastic(min_size=(nodes - 1) * WORKERS))
        return pb.JoinRequest(spec=spec, host_workers=[pb.HostWorker(index=k + 1) for k in range(WORKERS)], **common)
    spec = pb.JobSpec(nodes=pb.Nodes(min=max(1, nodes - 1), max=nodes))
    return pb.JoinRequest(spec=spec, workers=WORKERS, **common)


def attacker(address: str, nodes: int, beyond: int, wait_s: float, hosts: bool, conn) -> None:
    """The attack, phase by phase; sends (phase, seconds, details) to the parent over `conn`."""
    global HOSTS
    HOSTS = hosts
    import grpc

    from commctx.v1 import rendezvous_pb2 as pb
    from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

    async def run() -> None:
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 30)]) as channel:
            stub = pb_grpc.RendezvousStub(channel)
            conn.send(("ready", 0.0, ""))
            conn.recv()
            began = time.perf_counter()
            calls = [stub.Join(node_join("attack", nodes, i, round(wait_s * 1000)), timeout=wait_s + 30) for i in range(nodes)]
            answers = await asyncio.gather(*calls, return_exceptions=True)
            ok = [a for a in answers if not isinstance(a, BaseException)]
            codes: dict[str, int] = {}
            for a in answers:
                if isinstance(a, grpc.aio.AioRpcError):
                    codes[a.code().name] = codes.get(a.code().name, 0) + 1
            size = ok[0].assignment.world_size if ok else 0
            conn.send(("form", time.perf_counter() - began, f"{len(ok)}/{nodes} answered, world {size:,}"
                       + (f"; refused: {', '.join(f'{k} {v}' for k, v in sorted(codes.items()))}" if codes else "")))
            if ok and len(ok) == nodes and nodes > 1:
                began = time.perf_counter()
                # Rank 0 leaves (its spare port serves the TCPStore, so a world it stays in waits for its new one).
                first = next(a for a in ok if a.assignment.rank == 0)
                await stub.Leave(pb.LeaveRequest(job_id="attack", member_id=first.member_id, member_secret=first.member_secret))
                generation = first.assignment.generation
                while True:  # the survivors' view: the job at the next generation
                    d = await stub.DescribeJob(pb.DescribeJobRequest(job_id="attack", node_page_size=1))
                    if d.generation > generation and d.state == pb.JobDescription.FORMED:
                        break
                    await asyncio.sleep(0.01)
                conn.send(("re-form", time.perf_counter() - began, f"generation {d.generation}, {d.num_nodes} nodes"))
            if beyond:
                began = time.perf_counter()
                more = [stub.Join(node_join("attack", nodes, nodes + i, wait_ms=2000), timeout=30) for i in range(beyond)]
                more += [stub.Join(node_join("attack-2", nodes, i, wait_ms=2000), timeout=30) for i in range(beyond)]
                out = await asyncio.gather(*more, return_exceptions=True)
                counts: dict[str, int] = {}
                example = ""
                for a in out:
                    code = a.code().name if isinstance(a, grpc.aio.AioRpcError) else "OK"
                    counts[code] = counts.get(code, 0) + 1
                    if code == "RESOURCE_EXHAUSTED" or code == "INVALID_ARGUMENT":
                        example = example or a.details()
                conn.send(("beyond", time.perf_counter() - began,
                           ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + (f"; e.g. {example!r}" if example else "")))
            conn.send(("done", 0.0, ""))

    asyncio.run(run())


class Victim:
    """A formed 2-worker job whose member 0 renews by KeepAlive every 20 ms; keeps (start, seconds) of each."""

    def __init__(self, address: str) -> None:
        import grpc

        from commctx.v1 import rendezvous_pb2 as pb
        from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

        self.pb = pb
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.RendezvousStub(self.channel)
        spec = pb.JobSpec(world_size=2)
        join = [self.stub.Join.future(pb.JoinRequest(job_id="victim", spec=spec, node_key=f"v{i}", address="127.0.0.1",
                                                     master_port=30000 + i, wait_timeout_ms=30_000), timeout=30) for i in range(2)]
        self.members = [f.result() for f in join]
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pb = self.pb
        i = 0
        while not self._stop.is_set():
            m = self.members[i % 2]
            i += 1
            began = time.perf_counter()
            self.stub.KeepAlive(pb.KeepAliveRequest(job_id="victim", member_id=m.member_id, member_secret=m.member_secret,
                                                    generation=m.assignment.generation), timeout=60)
            took = time.perf_counter() - began
            self.samples.append((began, took))
            time.sleep(max(0.0, EVERY_S - took))

    def stop(self) -> str:
        self._stop.set()
        self._thread.join(120)
        state = self.stub.DescribeJob(self.pb.DescribeJobRequest(job_id="victim")).state
        self.channel.close()
        return self.pb.JobDescription.State.Name(state)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=98, help="node Joins of 1,024 workers each (default 98: 100,352 workers)")
    p.add_argument("--beyond", type=int, default=8, help="Joins sent past the world, to each of two jobs (default 8)")
    p.add_argument("--wait-s", type=float, default=300, help="the node Joins' wait_timeout_ms, in seconds (default 300)")
    p.add_argument("--hosts", action="store_true", help="host memberships of 1,024 host_workers each, in a job of "
                   "NODES x 1,024 workers (elastic down to one host fewer), instead of node memberships")
    p.add_argument("--store", default="sqlite", choices=("sqlite", "memory"))
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("server_flags", nargs="*", help="more flags for the server (after --)")
    args = p.parse_args()
    from harness import commctx_server

    ctx = mp.get_context("spawn")
    print(f"{args.nodes} {'host' if args.hosts else 'node'} Joins x {WORKERS} workers ({args.nodes * WORKERS:,}), then a Leave and re-form, then "
          f"{args.beyond} more to it and {args.beyond} to a second job; victim KeepAlive every {EVERY_S * 1000:g} ms; "
          f"store {args.store}; server flags {' '.join(args.server_flags) or '(none)'}", flush=True)
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as state, \
                commctx_server("--store", args.store, "--state-dir", state, "--lease-ttl-s", "10", "--log-level", "warning",
                               *args.server_flags) as server:
            address = f"127.0.0.1:{server.port}"
            victim = Victim(address)
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=attacker, args=(address, args.nodes, args.beyond, args.wait_s, args.hosts, theirs), daemon=True)
            proc.start()
            assert ours.recv()[0] == "ready"
            time.sleep(0.5)  # a baseline of round trips before the attack (a benchmark's pause, not a condition)
            began = time.perf_counter()
            ours.send("go")
            while True:
                while not ours.poll(1.0):
                    if not proc.is_alive():
                        raise SystemExit(f"the attacker process ended ({proc.exitcode})")
                phase, seconds, details = ours.recv()
                if phase == "done":
                    break
                print(f"  {phase:<8} {seconds:7.2f} s  {details} (ended at +{time.perf_counter() - began:.2f} s)", flush=True)
            ended = time.perf_counter()
            time.sleep(0.5)
            state_now = victim.stop()
            proc.join(30)
            slowest = sorted(((t, s - began) for s, t in victim.samples if began - t <= s <= ended), reverse=True)[:3]
            during = sorted(t for s, t in victim.samples if began - t <= s <= ended)
            ms = [t * 1000 for t in during]
            p99 = ms[max(0, int(len(ms) * 0.99) - 1)] if ms else 0.0
            print(f"  victim   {len(ms)} KeepAlives during the attack ({ended - began:.1f} s): worst {max(ms):.1f} ms, "
                  f"p99 {p99:.1f} ms, median {statistics.median(ms):.1f} ms, over 100 ms: {sum(t > 100 for t in ms)}; "
                  f"its job {state_now}; the slowest sent at " + ", ".join(f"+{at:.2f} s ({t * 1000:.0f} ms)" for t, at in slowest),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
