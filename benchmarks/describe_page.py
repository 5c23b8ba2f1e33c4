"""DescribeJob's node pages of a 100,000-node job, in the state machine (no
gRPC): the first page right after a change of who is in the job, the same
page again, and a page near the end. Each page is 1,000 nodes.

    python benchmarks/describe_page.py
"""

from __future__ import annotations

import argparse
import time

from commctx.common.planning import JobSpec
from commctx.server.rendezvous.machine import Rendezvous
from commctx.server.rendezvous.params import JoinParams

NODES = 100_000


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    machine = Rendezvous(lease_ttl_s=10, plan_inline_max=10**9)
    spec = JobSpec.from_json({"world_size": NODES + 10, "elastic": {"min_size": NODES, "last_call_ms": 0}})
    for i in range(NODES):
        machine.join(JoinParams.build(job_id="big", spec=spec, node_key=f"n{i}", address="10.0.0.1", port=30000))
    print(f"# a formed job of {NODES:,} single-worker nodes; then a joiner at a time (the job re-forms); pages of 1,000")
    print("first page after the change   same page again   page at 99,000")
    for k in range(5):
        machine.join(JoinParams.build(job_id="big", spec=spec, node_key=f"x{k}", address="10.0.0.1", port=30000))
        times = []
        for first in (0, 0, 99_000):
            t = time.perf_counter()
            machine.describe("big", first_node=first, max_nodes=1000)
            times.append((time.perf_counter() - t) * 1000)
        print(f"{times[0]:20.1f} ms {times[1]:15.1f} ms {times[2]:13.1f} ms")


if __name__ == "__main__":
    main()
