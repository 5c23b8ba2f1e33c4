"""torchrun's rendezvous, side by side: --rdzv-backend=commctx against c10d.

N simulated torchrun agents (threads spread over 4 processes) each create the
backend's handler exactly as torchrun does (torch's handler registry, with the
parameters torchrun passes) and call next_rendezvous() at the same instant.
Timed: from that instant until the last agent holds its RendezvousInfo (rank,
world size and the shared store) and has written a key to that store, as
torchrun's next step (assigning worker ranks) does. For commctx also (first
of the two numbers) until the last agent had the server's answer, before it
opened the store: c10d's agents open their store connection when the handler
is created, before the timed window, while commctx's agents can open theirs
only once the server has said where rank 0 serves it. In brackets, the
server's own time from the first node's Join to the world formed (its log),
and the CPU seconds the server used in the whole run (sessions included).
The ratio is c10d's time over commctx's first number. commctx: one node RPC per agent
carrying --nproc-per-node workers, each agent on a TCP connection of its own, against `commctx-server` with its default
SQLite store, unpinned. c10d: the agents share one TCPStore served by this
process (torchrun's own rendezvous store), unpinned.

A run that does not finish within --limit seconds is reported as such.

    python benchmarks/torchrun_rdzv.py                     # 8 ... 1,024 nodes, both
    python benchmarks/torchrun_rdzv.py --nodes 1250 --backends commctx   # 10,000 workers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from harness import cpu_s

PROCS = 4


def agents(args: argparse.Namespace) -> None:
    """One load process: `args.count` agents, node keys from `args.first`."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    if args.backend == "commctx":
        from commctx import transport

        # Each agent on a connection of its own, as agents on their own hosts have
        # (gRPC would otherwise share one among the channels of this process).
        transport.CHANNEL_OPTIONS.append(("grpc.use_local_subchannel_pool", 1))
    nodes = args.nodes[0]
    handlers = []
    for i in range(args.first, args.first + args.count):
        conf = {"join_timeout": args.limit}  # --nnodes=N (fixed): no last call
        if args.backend == "commctx":
            conf.update(nproc_per_node=args.nproc, node_key=f"node{i}")
        else:
            conf.update(is_host=False, read_timeout=args.limit)
        params = RendezvousParameters(backend=args.backend, endpoint=args.endpoint, run_id=args.run_id,
                                      min_nodes=nodes, max_nodes=nodes, local_addr="127.0.0.1", **conf)
        handler = get_rendezvous_handler(params)
        if args.backend == "commctx":  # also note when the server's answer arrived, before the store is opened
            enter = handler._enter

            def noted(response, enter=enter):
                known.append(time.time())
                return enter(response)

            handler._enter = noted
        handlers.append(handler)
    print(json.dumps({"ready": True}), flush=True)
    start_at = float(sys.stdin.readline())
    done: list[float] = []
    known: list[float] = []
    ranks: list[tuple[int, int]] = []
    errors: list[str] = []

    def run(h) -> None:
        time.sleep(max(0.0, start_at - time.time()))
        try:
            info = h.next_rendezvous()
            info.store.set(f"bench/{info.rank}", b"1")  # the store works (torchrun's next step uses it)
            ranks.append((info.rank, info.world_size))
            done.append(time.time())
        except Exception as exc:  # noqa: BLE001 - reported, the run counts as failed
            errors.append(f"{type(exc).__name__}: {exc}"[:300])

    threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.limit + 5)
    print(json.dumps({"last": max(done) if done else None, "known": max(known) if known else None, "ok": len(done), "ranks": sorted(r for r, _ in ranks),
                      "sizes": sorted({w for _, w in ranks}), "errors": errors[:3]}), flush=True)
    sys.stdin.readline()  # node rank 0's agent serves the store: stay until every agent has reported
    os._exit(0)  # handlers hold sessions and stores; the parent is done with this process


def measure(backend: str, nodes: int, nproc: int, limit: float) -> str:
    run_id = f"bench-{backend}-{nodes}"
    state = tempfile.TemporaryDirectory()
    server = store = None
    procs = []
    try:
        if backend == "commctx":
            server = subprocess.Popen([sys.executable, "-m", "commctx.server", "--host", "127.0.0.1", "--port", "0",
                                       "--state-dir", state.name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            line = server.stdout.readline()
            if "listening on" not in line:
                return f"server did not start: {line!r}"
            endpoint = f"127.0.0.1:{int(line.rsplit(':', 1)[1])}"
            formed: list[str] = []  # the server's own "formed ... seconds=" (its first Join to the world formed)

            def watch(stream=server.stderr) -> None:
                for line in stream:
                    if " formed " in line and run_id in line:
                        formed.append(line.rsplit("seconds=", 1)[1].split()[0])

            threading.Thread(target=watch, daemon=True).start()
        else:
            import torch.distributed as dist

            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
            endpoint = f"127.0.0.1:{store.port}"
        share, extra = divmod(nodes, PROCS)
        first = 0
        for k in range(PROCS):
            count = share + (k < extra)
            argv = [sys.executable, __file__, "--agents", "--backend", backend, "--endpoint", endpoint, "--run-id", run_id,
                    "--nodes", str(nodes), "--nproc", str(nproc), "--limit", str(limit), "--first", str(first),
                    "--count", str(count)]
            first += count
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        for p in procs:
            if not json.loads(p.stdout.readline() or "{}").get("ready"):
                return "load process failed to start"
        start_at = time.time() + 1.0
        cpu_before = cpu_s(server.pid) if server is not None else 0.0
        for p in procs:
            p.stdin.write(f"{start_at}\n")
            p.stdin.flush()
        results = []
        deadline = time.monotonic() + limit + 15
        for p in procs:
            report = threading.Thread(target=lambda p=p: results.append(json.loads(p.stdout.readline() or '{"ok": 0}')))
            report.start()
            report.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            with contextlib.suppress(OSError):
                p.stdin.write("exit\n")
                p.stdin.flush()
        results += [{"ok": 0, "errors": ["no report"]}] * (len(procs) - len(results))
        ok = sum(r["ok"] for r in results)
        if ok < nodes:
            errors = [e for r in results for e in r.get("errors", [])]
            return f"not done within {limit:g} s ({ok}/{nodes} agents){': ' + errors[0] if errors else ''}"
        ranks = sorted(r for res in results for r in res["ranks"])
        sizes = {s for res in results for s in res["sizes"]}
        if ranks != list(range(nodes)) or sizes != {nodes}:
            return f"wrong world: ranks {ranks[:8]}..., sizes {sorted(sizes)}"
        total = max(r["last"] for r in results) - start_at
        if backend == "commctx":
            seen_by = time.monotonic() + 2.0  # the server logs "formed" as it answers: give its log a moment
            while not formed and time.monotonic() < seen_by:
                time.sleep(0.01)
            inside = f"[{float(formed[0]):.3f}, cpu {cpu_s(server.pid) - cpu_before:.2f}] " if formed else ""
            return f"{inside}{max(r['known'] for r in results) - start_at:.3f} s / {total:.3f} s"
        return f"{total:.3f} s"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if server is not None:
            server.terminate()
            server.wait(30)
        state.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 64, 160, 512, 1024])
    parser.add_argument("--nproc", type=int, default=8, help="workers per node (--nproc-per-node)")
    parser.add_argument("--backends", nargs="+", default=["commctx", "c10d"])
    parser.add_argument("--limit", type=float, default=30.0, help="seconds a run may take")
    parser.add_argument("--agents", action="store_true", help=argparse.SUPPRESS)
    for name in ("--backend", "--endpoint", "--run-id"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--first", "--count"):
        parser.add_argument(name, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agents:
        agents(args)
        return
    print(f"# {PROCS} load processes of threads, one torchrun handler per agent, each on its own connection; server or store unpinned; "
          f"{args.nproc} workers per node; limit {args.limit:g} s")
    print(f"{'nodes':>6} {'workers':>8} " + " ".join(f"{b:>28}" for b in args.backends)
          + ("       ratio" if len(args.backends) == 2 else ""))
    for n in args.nodes:
        times = [measure(b, n, args.nproc, args.limit) for b in args.backends]
        ratio = ""
        if len(times) == 2 and all(t.endswith(" s") for t in times):
            ratio = f"{float(times[1].split()[0]) / float(times[0].split()[-5]):10.1f}x"
        print(f"{n:>6} {n * args.nproc:>8} " + " ".join(f"{t:>28}" for t in times) + f"  {ratio}", flush=True)


if __name__ == "__main__":
    main()
