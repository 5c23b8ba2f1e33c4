"""What the `commctx` commands print: a plan's ranks and groups, the job
table, a job's detail and its event lines, as text (or JSON where asked)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from google.protobuf import json_format

from commctx.common.planning import WorldPlan, expand
from commctx.v1 import rendezvous_pb2 as pb


def plan_json(plan: WorldPlan) -> dict:
    return {
        "world_size": plan.world_size,
        "nodes": [{"node_rank": n.node_rank, "node_key": n.node_key, "first_rank": n.first_rank, "size": n.size} for n in plan.nodes],
        "ranks": [
            {"rank": p.rank, "node_rank": p.node_rank, "node_key": plan.nodes[p.node_rank].node_key,
             "local_rank": p.local_rank, "role": plan.roles[p.rank] if plan.roles else ""}
            for p in sorted(plan.all_seats(), key=lambda p: p.rank)
        ],
        "groups": {mode: [expand(g.ranks) for g in groups] for mode, groups in plan.all_groups().items()},
        "roots": {mode: [g.root for g in groups] for mode, groups in plan.all_groups().items() if any(g.root is not None for g in groups)},
    }


def plan_text(plan: WorldPlan) -> str:
    data = plan_json(plan)
    sizes = ", ".join(str(n["size"]) for n in data["nodes"])
    lines = [f"world: {plan.world_size} workers on {plan.num_nodes} nodes ({sizes})"]
    if plan.spec.layout is not None:
        lines.append(f"layout: {plan.spec.layout}")
    lines += ["", f"{'rank':>5} {'node':>5} {'node_key':<12} {'local':>5}  role"]
    for r in data["ranks"]:
        lines.append(f"{r['rank']:>5} {r['node_rank']:>5} {r['node_key']:<12} {r['local_rank']:>5}  {r['role']}".rstrip())
    lines.append("")
    width = max(len(m) for m in data["groups"])
    for mode, groups in data["groups"].items():
        roots = data["roots"].get(mode, [None] * len(groups))
        shown = (str(g) if root is None else f"{g} (root {root})" for g, root in zip(groups, roots))
        lines.append(f"{mode:<{width}}  {' '.join(shown)}")
    return "\n".join(lines)


_STATE = {pb.JobDescription.FORMING: "forming", pb.JobDescription.FORMED: "formed", pb.JobDescription.FAILED: "failed",
          pb.JobDescription.ENDED: "ended", pb.JobDescription.CLOSED: "closed"}


def _size(d: pb.JobDescription) -> str:
    """'3/4' workers, or for a job of nodes (torchrun's) '4 on 2/2 nodes': its size counts nodes."""
    if d.spec.HasField("nodes"):
        n = d.spec.nodes
        wanted = f"{n.min}..{n.max}" if n.min != n.max else str(n.max)
        return f"{d.joined} on {d.num_nodes}/{wanted} nodes"
    return f"{d.joined}/{d.spec.world_size}"


def _ended(d: pb.JobDescription) -> str:
    """How long ago the run ended ('' while it runs)."""
    return f"{max(0.0, time.time() - d.ended_at):.0f}s ago" if d.ended_at else ""


def _role_counts(n: pb.NodeDescription) -> str:
    return ",".join(f"{r.role or '-'}:{r.count}" for r in n.roles)


def job_table(jobs: Sequence[pb.JobDescription]) -> str:
    rows = [("JOB", "RUN", "STATE", "GEN", "JOINED", "MISSING", "NODES", "AGE", "ENDED", "REASON")]
    for d in jobs:
        rows.append((d.job_id, str(d.run or ""), _STATE.get(d.state, "?"), str(d.generation), _size(d), str(d.missing),
                     str(d.num_nodes), f"{d.forming_for_s:.0f}s" if not d.ended_at else "", _ended(d), d.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    if len(rows) == 1:
        return "no jobs"
    return "\n".join(("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]).rstrip() for r in rows)


def job_detail(d: pb.JobDescription) -> str:
    joined = (f"{d.joined} workers on {_size(d).split(' on ')[1]} joined" if d.spec.HasField("nodes")
              else f"{d.joined} of {d.spec.world_size} workers joined")
    head = f"job {d.job_id} (run {d.run}): {_STATE.get(d.state, '?')}, generation {d.generation}, "
    if d.ended_at:
        began = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.started_at)) if d.started_at else "?"
        lines = [head + f"ended {_ended(d)} (began {began}, ran {d.ended_at - d.started_at:.1f} s); these nodes took part:"
                 if d.started_at else head + f"ended {_ended(d)}; these nodes took part:"]
    else:
        lines = [head + f"{joined}, {d.missing} missing, "
                 f"{'forming' if d.state == pb.JobDescription.FORMING else 'since first join'} for {d.forming_for_s:.1f} s"]
    if d.other_runs:
        lines.append(f"other runs of this id kept: {', '.join(map(str, d.other_runs))} (--run N describes one)")
    if d.reason:
        lines.append(f"why: {d.reason}")
    if d.waiting:
        lines.append(f"waiting for the next generation: {d.waiting} workers")
    if d.not_ready:
        lines.append(f"survivors that have not re-armed: {d.not_ready}")
    if d.missing_nodes:
        lines.append(f"node keys that have not shown up: {', '.join(d.missing_nodes)}")
    formed = d.state == pb.JobDescription.FORMED
    rows = [("NODE_RANK" if formed or d.ended_at else "", "NODE_KEY", "ADDRESS", "WORKERS", "ROLES")]
    rows += [(str(n.node_rank) if formed or d.ended_at else "", n.node_key, ",".join(n.addresses) or n.address, str(n.workers),
              _role_counts(n)) for n in d.nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).strip() for r in rows]
    if d.num_nodes > len(d.nodes):
        lines.append(f"... {d.num_nodes - len(d.nodes)} more nodes (--nodes 0 lists them all)")
    return "\n".join(lines)


def event_line(e: pb.JobEvent, as_json: bool) -> str:
    if as_json:
        return json.dumps({"seq": e.seq, "time": e.time, "kind": e.kind, "generation": e.generation, "message": e.message,
                           "fields": json_format.MessageToDict(e.fields)}, separators=(",", ":"))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time)) + f".{int(e.time % 1 * 1000):03d}"
    return f"{when}  #{e.seq:<4} gen {e.generation:<3} {e.kind:<9}  {e.message}"
