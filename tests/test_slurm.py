"""Slurm: what CommContext.join() reads in a task of an srun step (unit tests
of LauncherEnv.from_env and of the check of the server's assignment; which
value wins, in forked one-task "steps"), then real steps on a real one-host
Slurm cluster (tests/slurm.py: munged, slurmctld and two slurmds, node0 and
node1): `srun` tasks that join a real commctx server on 127.0.0.1 with its
address only and all-reduce their ranks over gloo (one node, two nodes,
cyclic, torchrun under srun), and docs/guides/slurm.md's two batch scripts
submitted with sbatch as written (their server on a port the OS gave).

Debian's Slurm (22.05.8) is built with --enable-multiple-slurmd: two
`slurmd -N NAME` on one host, on ports of their own, are two nodes, and the
two-node steps run here. The tasks' `python` is tests/python_exec.py, so
their interpreters are forked with torch imported (see task_env). The
cluster's tests skip, saying why, without the packages (`apt-get install
slurmctld slurmd slurm-client munge`) or root, or when the daemons cannot
start.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import sys

import pytest

from commctx.assignment import Assignment
from commctx.errors import UsageError
from commctx.launcher import LauncherEnv
from commctx.slurm import SlurmStep

from .cluster import PYTHON_EXEC, Server, clean_env, forked_run, forked_workers, running
from .slurm import SlurmCluster, free_port, unavailable

TRAIN = str(pathlib.Path(__file__).with_name("slurm_train.py"))

# A task of `srun -N2 -n4`, as srun sets its variables (Slurm 22.05): the second task of node 1.
TASK = {
    "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURMD_NODENAME": "gpu-b", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NUM_TASKS": "4", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
}


# -- reading the variables ------------------------------------------------------------------


def test_an_srun_task_reads_its_place_in_the_step():
    step = LauncherEnv.from_env(TASK).slurm
    assert step == SlurmStep(job_id="77", step_id=0, ntasks=4, procid=3, localid=1, nodeid=1, node_name="gpu-b",
                             tasks_per_node=(2, 2), distribution=None)
    assert (step.job, step.local_world_size, step.block_rank) == ("slurm-77.0", 2, 3)
    # the second srun of the allocation is another job
    assert LauncherEnv.from_env({**TASK, "SLURM_STEP_ID": "1"}).slurm.job == "slurm-77.1"
    cyclic = LauncherEnv.from_env({**TASK, "SLURM_PROCID": "1", "SLURM_DISTRIBUTION": "cyclic"}).slurm
    assert (cyclic.procid, cyclic.block_rank, cyclic.distribution) == (1, 3, "cyclic")


def test_tasks_per_node_are_expanded_and_the_step_counts_win_over_the_jobs():
    env = {**TASK, "SLURM_NTASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_TASKS_PER_NODE": "8(x2)",
           "SLURM_NODEID": "3", "SLURM_LOCALID": "0", "SLURM_PROCID": "6"}
    step = LauncherEnv.from_env(env).slurm
    assert (step.tasks_per_node, step.local_world_size, step.block_rank) == ((2, 2, 2, 1), 1, 6)
    # without the step's variables, the job's
    del env["SLURM_NTASKS"], env["SLURM_STEP_TASKS_PER_NODE"]
    env.update({"SLURM_STEP_NUM_TASKS": "16", "SLURM_NODEID": "1", "SLURM_PROCID": "8"})
    step = LauncherEnv.from_env(env).slurm
    assert (step.ntasks, step.tasks_per_node, step.block_rank) == (16, (8, 8), 8)


@pytest.mark.parametrize("env, why", [
    ({}, "no Slurm at all"),
    ({k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"}, "a batch script: no step id"),
    ({k: v for k, v in TASK.items() if k != "SLURM_PROCID"}, "no task id"),
    ({**TASK, "SLURM_STEP_ID": ""}, "empty counts as unset"),
    ({**TASK, "SLURM_STEP_ID": "4294967291"}, "the batch step"),
    ({**TASK, "SLURM_STEP_ID": "4294967290"}, "salloc's interactive step"),
    ({**TASK, "TORCHELASTIC_RUN_ID": "77"}, "srun started torchrun: torchrun's variables win"),
])
def test_slurm_is_read_only_in_a_task_of_an_srun_step(env, why):
    assert LauncherEnv.from_env(env).slurm is None, why


@pytest.mark.parametrize("change, named", [
    ({"SLURM_NTASKS": "four"}, "SLURM_NTASKS='four' is not a positive integer"),
    ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' is not a positive integer"),
    ({"SLURM_NODEID": "-1"}, "SLURM_NODEID='-1' is not a non-negative integer"),
    ({"SLURM_LOCALID": "1.5"}, "SLURM_LOCALID='1.5' is not a non-negative integer"),
    ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not a non-negative integer"),
    ({"SLURM_STEP_ID": "batch"}, "SLURM_STEP_ID='batch' is not a non-negative integer"),
    ({"SLURM_JOB_ID": "77_3"}, "SLURM_JOB_ID='77_3' is not a Slurm job id"),
    ({"SLURMD_NODENAME": "gpu b"}, "SLURMD_NODENAME='gpu b' cannot be a commctx node key"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "SLURM_STEP_TASKS_PER_NODE='2(x)' is not a list of task counts"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x0)"}, "SLURM_STEP_TASKS_PER_NODE='2(x0)' is not a list of task counts"),
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2,1"}, "SLURM_STEP_TASKS_PER_NODE adds up to 3 tasks but SLURM_NTASKS=4"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 but SLURM_STEP_TASKS_PER_NODE names 2 nodes"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 but SLURM_STEP_TASKS_PER_NODE puts 2 tasks on node 1"),
])
def test_a_malformed_slurm_variable_is_a_usage_error_naming_it(change, named):
    with pytest.raises(UsageError, match=re.escape(named)) as raised:
        LauncherEnv.from_env({**TASK, **change})
    assert "\n" not in str(raised.value)


# -- checking the server's assignment against Slurm's ----------------------------------------------


def assigned(rank: int, node_rank: int, local_rank: int, world_size: int = 4, local_world_size: int = 2) -> Assignment:
    return Assignment(job_id="slurm-77.0", member_id="m", generation=1, rank=rank, world_size=world_size,
                      node_rank=node_rank, num_nodes=2, local_rank=local_rank, local_world_size=local_world_size,
                      master_addr="127.0.0.1", master_port=1, dist_url="tcp://127.0.0.1:1", groups=())


ALL = ("world_size", "node_rank", "local_rank")


def test_an_assignment_that_agrees_with_slurm_passes_silently(caplog):
    with caplog.at_level(logging.WARNING, logger="commctx"):
        LauncherEnv.from_env(TASK).slurm.check(assigned(3, 1, 1), ALL)
    assert not caplog.records


@pytest.mark.parametrize("assignment, said", [
    (assigned(3, 1, 1, world_size=8), "Slurm gives this task world size 4 (SLURM_NTASKS) but the rendezvous server assigned 8"),
    (assigned(1, 0, 1), "Slurm gives this task node rank 1 (SLURM_NODEID) but the rendezvous server assigned 0"),
    (assigned(2, 1, 0), "Slurm gives this task local rank 1 (SLURM_LOCALID) but the rendezvous server assigned 0"),
    (assigned(3, 1, 1, local_world_size=3), "Slurm gives this task node's worker count 2 (SLURM_STEP_TASKS_PER_NODE) "
                                            "but the rendezvous server assigned 3"),
])
def test_an_assignment_that_disagrees_with_slurm_names_both_values(assignment, said):
    with pytest.raises(UsageError, match=re.escape(said + " (generation 1 of job 'slurm-77.0')")):
        LauncherEnv.from_env(TASK).slurm.check(assignment, ALL)


def test_only_the_values_taken_from_slurm_are_checked():
    step = LauncherEnv.from_env(TASK).slurm
    step.check(assigned(0, 0, 0, world_size=2), ())  # the caller gave them all
    step.check(assigned(1, 0, 1), ("world_size", "local_rank"))  # and the node rank
    with pytest.raises(UsageError, match="local rank 1"):
        step.check(assigned(2, 1, 0), ("local_rank",))


def test_a_rank_other_than_slurm_procid_in_a_cyclic_step_warns(caplog):
    """srun -m cyclic numbers tasks round-robin over the nodes; the server node
    by node. Node and local ranks agree, so the job runs: a warning, naming both."""
    step = LauncherEnv.from_env({**TASK, "SLURM_PROCID": "1", "SLURM_DISTRIBUTION": "cyclic"}).slurm
    with caplog.at_level(logging.WARNING, logger="commctx"):
        step.check(assigned(3, 1, 1), ALL)
    [record] = caplog.records
    assert record.getMessage().startswith(
        "SLURM_PROCID=1 but the rendezvous server made this task rank 3 (generation 1 of job 'slurm-77.0'): "
        "srun's task layout is --distribution=cyclic, and commctx numbers ranks node by node (block)")


# -- CommContext.join in a task: which value wins ------------------------------------------------


ONE_TASK = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0", "SLURMD_NODENAME": "fake-node", "SLURM_STEP_TASKS_PER_NODE": "1"}


def join_as_task(server: Server, env: dict[str, str], *args: str) -> dict:
    """tests/slurm_train.py as one task of a one-task step (its variables made up), forked by the zygote."""
    base = {k: v for k, v in clean_env().items() if not k.startswith(("SLURM", "COMMCTX_JOB", "COMMCTX_SERVER"))}
    done = forked_run([TRAIN, server.address, *args], {**base, **env}, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow(2)
def test_arguments_win_over_commctx_variables_which_win_over_slurm():
    with running([Server("127.0.0.1")]) as (server,):
        out = join_as_task(server, ONE_TASK)
        assert (out["job"], out["world_size"], out["nodes"]) == ("slurm-42.3", 1, {"fake-node": 0})
        out = join_as_task(server, {**ONE_TASK, "COMMCTX_JOB_ID": "from-env"})
        assert (out["job"], out["nodes"]) == ("from-env", {"fake-node": 0})
        out = join_as_task(server, {**ONE_TASK, "COMMCTX_JOB_ID": "from-env"}, "--job-id", "from-arg", "--node-key", "mine")
        assert (out["job"], out["nodes"]) == ("from-arg", {"mine": 0})
        # under torchrun's variables (a worker torchrun started) Slurm's are not read: no job at all here
        done = forked_run([TRAIN, server.address], {**clean_env(), **ONE_TASK, "TORCHELASTIC_RUN_ID": "x"}, timeout=60)
        assert done.returncode != 0 and "no job: pass job_id or set COMMCTX_JOB_ID" in done.stderr


def test_a_malformed_slurm_variable_fails_the_join_naming_it(monkeypatch):
    from commctx import CommContext

    for name, value in {**ONE_TASK, "SLURM_NODEID": "zero"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=re.escape("SLURM_NODEID='zero' is not a non-negative integer")):
        CommContext.join("127.0.0.1:1")


# -- real srun steps on a one-host Slurm cluster ------------------------------------------------------


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why_not = unavailable()
    if why_not:
        pytest.skip(why_not)
    root = tmp_path_factory.mktemp("slurm")
    try:
        cluster = SlurmCluster(root, nodes=("node0", "node1"), cpus=4)
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"the Slurm daemons cannot run here: {str(exc).splitlines()[0]}")
    with cluster:
        yield cluster


def task_env(tmp_path: pathlib.Path) -> dict[str, str]:
    """What srun and sbatch pass on to the tasks: this environment without a
    commctx job or server of its own, and `python` first on PATH being
    tests/python_exec.py: the tasks' `python SCRIPT` (and torchrun's workers,
    through PYTHON_EXEC) are forked by the tests' zygote, torch imported
    already, as the other end-to-end tests' workers are. Slurm still starts,
    tracks and ends each task: python_exec.py is the task, and lives as long
    as its worker."""
    shims = tmp_path / "forked"
    shims.mkdir(exist_ok=True)
    if not (shims / "python").exists():
        (shims / "python").symlink_to(PYTHON_EXEC)
    env = {k: v for k, v in clean_env().items() if not k.startswith(("COMMCTX_JOB", "COMMCTX_SERVER", "TORCHELASTIC_"))}
    env.update(forked_workers())
    env["PATH"] = os.pathsep.join([str(shims), os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def srun(slurm: SlurmCluster, tmp_path: pathlib.Path, *argv: str, tasks: int) -> tuple[list[dict], str]:
    """Runs `srun ARGV` and returns the tasks' JSON lines, by rank, and srun's stderr."""
    done = slurm.run(["srun", "--time=2", *argv], env=task_env(tmp_path), timeout_s=90, cwd=str(tmp_path))
    assert done.returncode == 0, f"srun exited {done.returncode}\n{done.stderr[-4000:]}\n{slurm.log()}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == tasks, done.stdout + done.stderr[-3000:]
    return sorted(lines, key=lambda r: r["rank"]), done.stderr


def step_job(tasks: list[dict]) -> str:
    jobs = {(t["slurm"]["SLURM_JOB_ID"], t["slurm"]["SLURM_STEP_ID"]) for t in tasks}
    assert len(jobs) == 1, jobs
    [(job, step)] = jobs
    return f"slurm-{job}.{step}"


@pytest.mark.slow(3)
def test_srun_one_node_four_tasks_join_with_the_server_address_only(slurm, tmp_path):
    with running([Server("127.0.0.1")]) as (server,):
        tasks, _ = srun(slurm, tmp_path, "-N1", "-n4", "python", TRAIN, server.address, tasks=4)
    job = step_job(tasks)
    node = tasks[0]["slurm"]["SLURMD_NODENAME"]
    for rank, t in enumerate(tasks):
        assert (t["rank"], t["local_rank"], t["node_rank"], t["world_size"], t["local_world_size"]) == (rank, rank, 0, 4, 4)
        assert t["slurm"]["SLURM_PROCID"] == str(rank)
        assert (t["job"], t["nodes"], t["sum"]) == (job, {node: 0}, 6.0)  # 0 + 1 + 2 + 3


@pytest.mark.slow(3)
def test_srun_two_nodes_two_tasks_each(slurm, tmp_path):
    """Two slurmds of one host are two nodes: their node names, not the host's, are the node keys."""
    with running([Server("127.0.0.1")]) as (server,):
        tasks, _ = srun(slurm, tmp_path, "-N2", "-n4", "--ntasks-per-node=2", "python", TRAIN, server.address,
                        tasks=4)
    job = step_job(tasks)
    for rank, t in enumerate(tasks):
        assert (t["rank"], t["node_rank"], t["local_rank"], t["world_size"], t["local_world_size"]) == (
            rank, rank // 2, rank % 2, 4, 2)
        assert t["slurm"]["SLURM_PROCID"] == str(rank)
        assert t["slurm"]["SLURMD_NODENAME"] == f"node{rank // 2}"
        assert (t["job"], t["nodes"], t["sum"]) == (job, {"node0": 0, "node1": 1}, 6.0)


@pytest.mark.slow(3)
def test_srun_cyclic_keeps_node_and_local_ranks_and_warns_of_slurm_procid(slurm, tmp_path):
    with running([Server("127.0.0.1")]) as (server,):
        tasks, stderr = srun(slurm, tmp_path, "-N2", "-n4", "--ntasks-per-node=2", "--distribution=cyclic",
                             "python", TRAIN, server.address, tasks=4)
    for rank, t in enumerate(tasks):
        assert (t["rank"], t["node_rank"], t["local_rank"], t["sum"]) == (rank, rank // 2, rank % 2, 6.0)
        # cyclic: node0 has tasks 0 and 2, node1 tasks 1 and 3
        assert t["slurm"]["SLURM_PROCID"] == str([0, 2, 1, 3][rank])
    for procid, rank in ((2, 1), (1, 2)):
        assert f"SLURM_PROCID={procid} but the rendezvous server made this task rank {rank}" in stderr, stderr[-3000:]


@pytest.mark.slow(4)
def test_srun_starting_torchrun_on_commctx_takes_torchruns_ranks(slurm, tmp_path):
    """docs/guides/slurm.md's second recipe on one node: srun starts one
    torchrun, --rdzv-id=$SLURM_JOB_ID; its workers take torchrun's ranks, not Slurm's."""
    with running([Server("127.0.0.1")]) as (server,):
        script = (f"exec torchrun --nnodes=1 --nproc-per-node=2 --rdzv-backend=commctx "
                  f"--rdzv-endpoint={server.address} --rdzv-id=$SLURM_JOB_ID {TRAIN}")
        tasks, _ = srun(slurm, tmp_path, "-N1", "-n1", "bash", "-c", script, tasks=2)
    job_id = tasks[0]["slurm"]["SLURM_JOB_ID"]
    for rank, t in enumerate(tasks):
        assert (t["rank"], t["node_rank"], t["local_rank"], t["world_size"], t["sum"]) == (rank, 0, rank, 2, 1.0)
        assert (t["job"], t["torchrun"]) == (job_id, job_id)
        assert t["slurm"]["SLURM_PROCID"] == "0"  # the srun task is torchrun's agent; its workers share its variables


# -- docs/guides/slurm.md's batch scripts, as written ------------------------------------------------

GUIDE = pathlib.Path("docs/guides/slurm.md")
PRINTED = re.compile(r"^(\S+): rank (\d+) of (\d+), node (\d+) local rank (\d+): sum (\S+)$", re.M)


def guide_blocks() -> tuple[str, list[str]]:
    """The guide's train.py and its two batch scripts: the blocks whose
    not-run marker says that this file runs them."""
    from .test_readme import blocks

    ours = [b for b in blocks(GUIDE) if "tests/test_slurm.py" in (b.skipped_because or "")]
    train = [b.code for b in ours if b.lang == "python"]
    scripts = [b.code for b in ours if b.lang == "sh"]
    assert len(train) == 1 and len(scripts) == 2, [b.where for b in ours]
    return train[0], scripts


def sbatch(slurm: SlurmCluster, tmp_path: pathlib.Path, script: str, train: str) -> tuple[str, list[tuple]]:
    """Submits `script` (with `train` as train.py beside it) and waits for it to end:
    its job id and the lines train.py printed, by rank. Its server's port
    (COMMCTX_PORT, which the script leaves to its environment) is one the OS gave."""
    (tmp_path / "train.py").write_text(train)
    (tmp_path / "job.sh").write_text(script)
    env = {**task_env(tmp_path), "COMMCTX_PORT": str(free_port())}
    job, state, exit_code = slurm.sbatch("job.sh", env, cwd=str(tmp_path))
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert (state, exit_code) == ("COMPLETED", "0:0"), f"batch job {job}: {state} {exit_code}\n{out[-4000:]}\n{slurm.log()}"
    lines = [(j, int(r), int(w), int(n), int(lr), float(s)) for j, r, w, n, lr, s in PRINTED.findall(out)]
    return job, sorted(lines, key=lambda line: line[1])


@pytest.mark.slow(6)
def test_the_guides_srun_batch_script_runs_as_written(slurm, tmp_path):
    train, (script, _) = guide_blocks()
    job, lines = sbatch(slurm, tmp_path, script, train)
    # eight workers, four on each node, in one job named after the step
    assert lines == [(f"slurm-{job}.0", rank, 8, rank // 4, rank % 4, 36.0) for rank in range(8)]


@pytest.mark.slow(10)
def test_the_guides_torchrun_batch_script_runs_as_written(slurm, tmp_path):
    train, (_, script) = guide_blocks()
    job, lines = sbatch(slurm, tmp_path, script, train)
    # two agents of four workers: the job is --rdzv-id=$SLURM_JOB_ID, the ranks torchrun's
    assert lines == [(job, rank, 8, rank // 4, rank % 4, 36.0) for rank in range(8)]
