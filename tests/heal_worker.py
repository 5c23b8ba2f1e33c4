"""One rank of a gloo world for tests/test_elastic.py's heal cases.

    heal_worker.py INIT_METHOD RANK CASE_JSON

CASE_JSON is a list, one {"holds", "step", "value"} per rank: this rank's
state before the heal. It initialises torch.distributed through CommContext's
seed API (no server), heals with commctx.elastic, and prints one JSON line:
its value and step afterwards and what the heal did.
"""

from __future__ import annotations

import json
import sys

import torch

from commctx import CommContext
from commctx.elastic import Elastic


def main() -> None:
    init, rank, case = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    ctx = CommContext()
    ctx.init_distributed_env(world_size=len(case), rank=rank, backend="gloo", dist_url=init, timeout=60)
    mine = case[rank]
    state = {"weight": torch.full((1000,), mine["value"])}
    elastic = Elastic(ctx, state_dict=lambda: state, load_state_dict=lambda s: state.update(s), step=mine["step"])
    elastic._holds = mine["holds"]  # as a survivor of an earlier world holds it
    heal = elastic.heal()
    print(json.dumps({"value": state["weight"][0].item(), "same": bool((state["weight"] == state["weight"][0]).all()),
                      "step": elastic.step, "source": heal.source, "receivers": list(heal.receivers),
                      "nbytes": heal.nbytes}), flush=True)
    ctx.destroy()


if __name__ == "__main__":
    main()
