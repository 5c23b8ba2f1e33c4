"""A task of a Slurm step (`srun python train.py`): where Slurm put it, read
from the variables srun gives every task, and the check that the rendezvous
server's assignment agrees.

CommContext.join() takes from here what its caller did not give (see its
docstring). Slurm's own ranks are block ranks when srun lays the tasks out
node by node (its default when there are more tasks than nodes); the server
always numbers block-wise (the workers of lower node ranks first, as torchrun
does), so a step laid out otherwise (`--distribution=cyclic`, plane,
arbitrary) gets the same node and local ranks but other global ranks than
SLURM_PROCID: CommContext warns, once, and the server's rank is the rank.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Collection, Mapping

from commctx.common.planning import NODE_KEY

from .assignment import Assignment
from .errors import UsageError

log = logging.getLogger("commctx")

# Step ids from 0xfffffff0 up are Slurm's own steps, not an srun's: the batch
# script (0xfffffffb), the extern step (0xfffffffc), salloc's interactive step
# (0xfffffffa). A program started there is one process, whatever SLURM_NTASKS says.
FIRST_SPECIAL_STEP_ID = 0xFFFFFFF0

_COUNTS = re.compile(r"(\d+)(?:\(x(\d+)\))?")  # one item of SLURM_STEP_TASKS_PER_NODE: "4" or "2(x3)"


@dataclasses.dataclass(frozen=True)
class SlurmStep:
    """One task's place in its srun step.

    Attributes:
        job_id: SLURM_JOB_ID.
        step_id: SLURM_STEP_ID.
        ntasks: SLURM_NTASKS (else SLURM_STEP_NUM_TASKS): the step's tasks.
        procid: SLURM_PROCID: this task's rank in the step.
        localid: SLURM_LOCALID: this task's rank on its node.
        nodeid: SLURM_NODEID: this node's rank in the step.
        node_name: SLURMD_NODENAME: the node's name, unique in its cluster.
        tasks_per_node: SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE)
            expanded: the tasks on each node of the step, in node order.
        distribution: SLURM_DISTRIBUTION, when srun set it.
    """

    job_id: str | None
    step_id: int
    ntasks: int | None
    procid: int
    localid: int | None
    nodeid: int | None
    node_name: str | None
    tasks_per_node: tuple[int, ...] | None
    distribution: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmStep | None:
        """The task's place in its step, or None outside an srun step.

        A task of an srun step has SLURM_STEP_ID and SLURM_PROCID. Under
        torchrun (TORCHELASTIC_RUN_ID set: `srun torchrun ...`) torchrun's
        variables describe the worker and Slurm's its agent, so this is None;
        so it is in a batch script or salloc's shell (no SLURM_STEP_ID, or a
        step id of Slurm's own). A variable that is set empty counts as unset.

        Raises:
            UsageError: a variable is set but malformed (the message names it),
                or the variables contradict one another.
        """
        if env.get("TORCHELASTIC_RUN_ID") or not env.get("SLURM_STEP_ID") or not env.get("SLURM_PROCID"):
            return None
        step_id = _number(env, "SLURM_STEP_ID")
        if step_id >= FIRST_SPECIAL_STEP_ID:
            return None
        ntasks_name = "SLURM_NTASKS" if env.get("SLURM_NTASKS") else "SLURM_STEP_NUM_TASKS"
        ntasks = _number(env, ntasks_name, minimum=1)
        per_node_name = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
        step = cls(
            job_id=_job_id(env),
            step_id=step_id,
            ntasks=ntasks,
            procid=_number(env, "SLURM_PROCID"),
            localid=_number(env, "SLURM_LOCALID"),
            nodeid=_number(env, "SLURM_NODEID"),
            node_name=_node_name(env),
            tasks_per_node=_tasks_per_node(env, per_node_name),
            distribution=env.get("SLURM_DISTRIBUTION") or None,
        )
        step._check(ntasks_name, per_node_name)
        return step

    def _check(self, ntasks_name: str, per_node_name: str) -> None:
        """Raises UsageError where the variables contradict one another."""
        if self.ntasks is not None and self.procid >= self.ntasks:
            raise UsageError(f"SLURM_PROCID={self.procid} is not below {ntasks_name}={self.ntasks}: "
                             f"the Slurm variables of this process are not one srun task's")
        counts = self.tasks_per_node
        if counts is None:
            return
        if self.ntasks is not None and sum(counts) != self.ntasks:
            raise UsageError(f"{per_node_name} adds up to {sum(counts)} tasks but {ntasks_name}={self.ntasks}: "
                             f"the Slurm variables of this process are not one srun task's")
        if self.nodeid is not None and self.nodeid >= len(counts):
            raise UsageError(f"SLURM_NODEID={self.nodeid} but {per_node_name} names {len(counts)} nodes: "
                             f"the Slurm variables of this process are not one srun task's")
        if self.nodeid is not None and self.localid is not None and self.localid >= counts[self.nodeid]:
            raise UsageError(f"SLURM_LOCALID={self.localid} but {per_node_name} puts {counts[self.nodeid]} tasks "
                             f"on node {self.nodeid}: the Slurm variables of this process are not one srun task's")

    @property
    def job(self) -> str | None:
        """The commctx job id of this step: 'slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>'.

        With the step in it, two sruns of one allocation (one after the
        other, or side by side) are two jobs, as they are two sets of tasks.
        """
        return None if self.job_id is None else f"slurm-{self.job_id}.{self.step_id}"

    @property
    def local_world_size(self) -> int | None:
        """The tasks on this task's node, when Slurm said."""
        if self.tasks_per_node is None or self.nodeid is None:
            return None
        return self.tasks_per_node[self.nodeid]

    @property
    def block_rank(self) -> int | None:
        """The global rank the server gives this task: the tasks of lower
        node ranks, then its local rank (None when Slurm did not say enough)."""
        if self.tasks_per_node is None or self.nodeid is None or self.localid is None:
            return None
        return sum(self.tasks_per_node[: self.nodeid]) + self.localid

    def check(self, a: Assignment, taken: Collection[str]) -> None:
        """Checks the server's assignment against this step, where join() took
        the value from it: `taken` names them ("world_size": SLURM_NTASKS,
        "node_rank": SLURM_NODEID, "local_rank": SLURM_LOCALID); with both
        ranks Slurm's, also this node's worker count and the global rank.

        A global rank other than SLURM_PROCID where node, local rank and every
        node's size agree means Slurm laid the tasks out other than block-wise
        (srun --distribution=cyclic, plane or arbitrary): a warning on the
        `commctx` logger, since the job runs and the server's rank is the one
        torch.distributed uses.

        Raises:
            UsageError: the server assigned another value than Slurm's; the
                message names both.
        """
        where = f"(generation {a.generation} of job {a.job_id!r})"
        ranks = "node_rank" in taken and "local_rank" in taken
        expected = []
        if "world_size" in taken:
            expected.append(("world size", "SLURM_NTASKS", self.ntasks, a.world_size))
        if "node_rank" in taken:
            expected.append(("node rank", "SLURM_NODEID", self.nodeid, a.node_rank))
        if "local_rank" in taken:
            expected.append(("local rank", "SLURM_LOCALID", self.localid, a.local_rank))
        if ranks:
            expected.append(("node's worker count", "SLURM_STEP_TASKS_PER_NODE", self.local_world_size, a.local_world_size))
            expected.append(("global rank", "SLURM_STEP_TASKS_PER_NODE, SLURM_NODEID and SLURM_LOCALID",
                             self.block_rank, a.rank))
        for what, names, slurm, assigned in expected:
            if slurm is not None and slurm != assigned:
                raise UsageError(f"Slurm gives this task {what} {slurm} ({names}) but the rendezvous server assigned "
                                 f"{assigned} {where}: run one job per srun step, or pass the value to "
                                 f"CommContext.join to use your own")
        if ranks and self.procid != a.rank:
            layout = f"--distribution={self.distribution}" if self.distribution else "not block"
            log.warning("SLURM_PROCID=%d but the rendezvous server made this task rank %d %s: srun's task layout is "
                        "%s, and commctx numbers ranks node by node (block); use ctx.get_global_rank(), "
                        "not SLURM_PROCID", self.procid, a.rank, where, layout)


def _number(env: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    """The integer in variable `name` (None when unset or empty).

    Raises:
        UsageError: set, but not an integer of at least `minimum`.
    """
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        kind = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise UsageError(f"{name}={raw[:64]!r} is not {kind}: it is not the value srun sets; unset it or run under srun")
    return value


def _job_id(env: Mapping[str, str]) -> str | None:
    raw = env.get("SLURM_JOB_ID") or None
    if raw is not None and not raw.isdigit():
        raise UsageError(f"SLURM_JOB_ID={raw[:64]!r} is not a Slurm job id (a non-negative integer); "
                         f"unset it or run under srun")
    return raw


def _node_name(env: Mapping[str, str]) -> str | None:
    raw = env.get("SLURMD_NODENAME") or None
    if raw is not None and not NODE_KEY.fullmatch(raw):
        raise UsageError(f"SLURMD_NODENAME={raw[:64]!r} cannot be a commctx node key (letters, digits, '.', '_', ':' "
                         f"and '-', starting with a letter or digit, at most 253): pass node_key to CommContext.join")
    return raw


def _tasks_per_node(env: Mapping[str, str], name: str) -> tuple[int, ...] | None:
    """Slurm's compressed list of task counts, one per node: '2(x3),1' is 2, 2, 2, 1.

    Raises:
        UsageError: set, but not that form.
    """
    raw = env.get(name) or None
    if raw is None:
        return None
    counts: list[int] = []
    for item in raw.split(","):
        match = _COUNTS.fullmatch(item.strip())
        repeat = int(match[2]) if match and match[2] else 1
        if not match or repeat < 1 or repeat > 1_000_000:
            raise UsageError(f"{name}={raw[:64]!r} is not a list of task counts such as '4' or '2(x3),1': "
                             f"it is not the value srun sets; unset it or run under srun")
        counts += [int(match[1])] * repeat
    return tuple(counts)
