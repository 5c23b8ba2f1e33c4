"""What a Join costs the server's CPU for the two things this release added to
every Join: recording the job's history (events) and counting the caller's
share (fair shares per token, certificate or peer), against the whole Join.

In process, on the state machine itself (no gRPC, no other process): N Joins
into one job of world_size N (the world forms with the last one), timed with
time.process_time (this process's CPU only, so other load on the machine
counts less), three ways in turn, `--repeat` times each, median and range:

    as built       Rendezvous.join, events recorded (coalesced joins, a PutEvent write each)
    no events      the same with Rendezvous._event a no-op
    shares         Shares.take + give of a Join waiting (and of the job it creates) per Join, alone

The whole Join over gRPC costs about 0.8 ms of the server's CPU
(benchmarks/results/join_scale.txt); the two added costs are printed as a share of it.

    python benchmarks/join_cost.py [--joins 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

GRPC_JOIN_MS = 0.80  # the server's CPU per Join over gRPC, benchmarks/results/join_scale.txt


def joins(n: int, events: bool) -> float:
    """CPU seconds for n Joins of one job."""
    from commctx.common.planning import JobSpec
    from commctx.server.rendezvous.machine import Rendezvous
    from commctx.server.rendezvous.params import JoinParams

    machine = Rendezvous(lease_ttl_s=10.0)
    if not events:
        machine._event = lambda *args, **kw: None  # noqa: SLF001 - the cost being measured
    spec = JobSpec.build(n)
    params = [JoinParams.build(job_id="job", spec=spec, node_key=f"n{i // 8}", address="10.0.0.1", port=20000 + i % 40000)
              for i in range(n)]
    started = time.process_time()
    for p in params:
        machine.join(p)
    return time.process_time() - started


def shares(n: int) -> float:
    """CPU seconds for n Joins' share accounting (a waiting Join, a created job)."""
    from commctx.server.rendezvous.model import Limits
    from commctx.server.rendezvous.shares import JOBS, WAITING, Caller, Shares

    held = Shares(Limits(max_members=4 * n, max_jobs=4 * n))
    callers = [Caller(f"peer:10.0.{i // 250}.{i % 250}", "peer") for i in range(64)]
    started = time.process_time()
    for i in range(n):
        caller = callers[i % 64]
        held.take(WAITING, caller)
        held.take(JOBS, caller)
        held.give(WAITING, caller)
        held.give(JOBS, caller)
    return time.process_time() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--joins", type=int, default=10_000, help="Joins per run (default 10,000)")
    p.add_argument("--repeat", type=int, default=5, help="runs of each (default 5)")
    args = p.parse_args()
    runs: dict[str, list[float]] = {"as built": [], "no events": [], "shares": []}
    for _ in range(args.repeat):  # interleaved: drift in the machine's speed hits each alike
        runs["as built"].append(joins(args.joins, True))
        runs["no events"].append(joins(args.joins, False))
        runs["shares"].append(shares(args.joins))
    print(f"{args.joins:,} Joins into one job, CPU of this process (time.process_time), {args.repeat} runs each; "
          f"median (range), µs per Join")
    per = {k: [v / args.joins * 1e6 for v in vs] for k, vs in runs.items()}
    for name, vs in per.items():
        print(f"  {name:<10} {statistics.median(vs):7.2f}  ({min(vs):.2f}-{max(vs):.2f})")
    events_us = statistics.median(per["as built"]) - statistics.median(per["no events"])
    shares_us = statistics.median(per["shares"])
    print(f"events add {events_us:.2f} µs per Join: {events_us / (GRPC_JOIN_MS * 10):.2f} % of a Join over gRPC "
          f"({GRPC_JOIN_MS} ms of the server's CPU, join_scale.txt)")
    print(f"shares add {shares_us:.2f} µs per Join: {shares_us / (GRPC_JOIN_MS * 10):.2f} % of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
