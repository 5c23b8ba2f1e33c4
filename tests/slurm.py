"""A real Slurm cluster on this one host, for tests/test_slurm.py: munged with a
key and socket of its own, slurmctld, and one slurmd per node name, all in
the foreground under a directory of the test's, on ports the OS gave out.
Everything started here is stopped here, by pid.

Debian's packages (`slurmctld slurmd slurm-client munge`, Slurm 22.05.8 on
bookworm) are built with --enable-multiple-slurmd (`scontrol show config`:
MULTIPLE_SLURMD = Yes), so `slurmd -N NAME` runs a daemon for that node
name: two slurmds on one host, each on a port of its own (`NodeName=...
NodeAddr=127.0.0.1 Port=`), are two nodes to slurmctld, srun and the tasks
(SLURMD_NODENAME, SLURM_NODEID).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence

import pytest

from .waiting import wait_until

# The states a job ends in (scontrol's JobState); COMPLETING is not one yet.
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol", "scancel")


def unavailable() -> str | None:
    """None when a Slurm cluster can be started here, else why not."""
    missing = [b for b in DAEMONS if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): "
                "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        return "a test Slurm cluster runs its daemons as root (SlurmUser=root); this process is not root"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def free_port() -> int:
    """A port the OS says is free now (the daemons bind it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """munged, slurmctld and a slurmd per name in `nodes`, each node with `cpus` CPUs.

    `env` is the environment for Slurm's commands (SLURM_CONF names this
    cluster's slurm.conf). Use as a context manager, or call close().
    """

    def __init__(self, root: pathlib.Path, nodes: Sequence[str] = ("node0",), cpus: int = 4,
                 timeout_s: float = 30.0) -> None:
        self.root = root
        self.nodes = list(nodes)
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._logs: dict[str, pathlib.Path] = {}
        try:
            self._start(cpus, timeout_s)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.root / f"{name}.out"
        self._logs[name] = log
        with open(log, "w") as out:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        self._procs.append((name, popen))
        return popen

    def _start(self, cpus: int, timeout_s: float) -> None:
        root = self.root
        munge = root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = munge / "munge.socket"
        self.conf = root / "slurm.conf"
        self.env = self.environment(os.environ)
        # --force: pytest's temporary directories are 0700, and munged wants its socket's
        # directories open to all; only root talks to it here.
        self._spawn("munged", [_binary("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
                               f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), timeout_s, "munged's socket")
        (root / "state").mkdir()
        (root / "spool").mkdir()
        host = socket.gethostname().split(".")[0]
        node_lines = [f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus} "
                      f"State=UNKNOWN" for n in self.nodes]
        conf = f"""\
ClusterName=commctx-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}/%n
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd-%n.pid'}
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
MailProg=/bin/true
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
{chr(10).join(node_lines)}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        self.conf.write_text(conf)
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for n in self.nodes:
            (root / "spool" / n).mkdir()
            self._spawn(f"slurmd-{n}", [_binary("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
        self._wait(self._all_idle, timeout_s, f"nodes {', '.join(self.nodes)} idle in sinfo")

    def _all_idle(self) -> bool:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env, timeout=10)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        """Waits until `ready()`; a RuntimeError (the test skips: the daemons
        cannot run here) when one of them exits or `timeout_s` passes."""
        def up() -> bool:
            if ready():
                return True
            for name, popen in self._procs:
                if popen.poll() is not None:
                    raise RuntimeError(f"{name} exited ({popen.returncode}) while waiting for {what}\n{self.log()}")
            return False

        try:
            wait_until(up, timeout_s, what, interval_s=0.2)
        except pytest.fail.Exception:
            raise RuntimeError(f"no {what} within {timeout_s} s\n{self.log()}") from None

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` for this cluster: SLURM_CONF names its slurm.conf, and the
        Slurm variables of a job around the test (run under srun?) are gone."""
        env = {k: v for k, v in base.items() if not k.startswith(("SLURM_", "SLURMD_", "SRUN_", "SBATCH_", "SALLOC_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 60.0,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        """Runs a Slurm command (srun, sbatch ...) against this cluster, in
        environment `env` (default: this process's), which srun and sbatch
        pass on to the tasks."""
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, cwd=cwd,
                              env=self.env if env is None else self.environment(env))

    def sbatch(self, script: str, env: Mapping[str, str], cwd: str, timeout_s: float = 90.0) -> tuple[str, str, str]:
        """Submits batch script `script` (a path) and waits for its job to end:
        its id, end state (COMPLETED, FAILED, ...) and ExitCode. It polls
        scontrol: `sbatch --wait` polls slowly, and takes half a minute more."""
        done = self.run(["sbatch", "--parsable", script], env=env, cwd=cwd, timeout_s=30)
        job = done.stdout.strip().split(";")[0]
        if done.returncode != 0 or not job.isdigit():
            raise AssertionError(f"sbatch exited {done.returncode}: {done.stdout[-1000:]}{done.stderr[-2000:]}")
        fields: dict[str, str] = {}

        def ended() -> bool:
            shown = self.run(["scontrol", "show", "job", "-o", job], timeout_s=10).stdout
            fields.clear()
            fields.update(f.split("=", 1) for f in shown.split() if "=" in f)
            return fields.get("JobState") in ENDED

        try:
            wait_until(ended, timeout_s, lambda: f"batch job {job} ended, still {fields.get('JobState') or 'unknown'}\n"
                       f"{self.log()}", interval_s=0.2)
        finally:
            if fields.get("JobState") not in ENDED:
                self.run(["scancel", job], timeout_s=10)
        return job, fields["JobState"], fields.get("ExitCode", "")

    def log(self) -> str:
        """The tail of every daemon's log, for a failure's message."""
        out = []
        for path in [*self._logs.values(), self.root / "slurmctld.log",
                     *(self.root / f"slurmd-{n}.log" for n in self.nodes)]:
            if path.exists():
                out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(out)

    def close(self) -> None:
        """Cancels this cluster's jobs (their steps end with them), then stops
        the slurmds, slurmctld and munged, by pid, SIGKILL after 10 s."""
        if any(name == "slurmctld" and p.poll() is None for name, p in self._procs):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=10)
        for name, popen in reversed(self._procs):
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    popen.send_signal(signal.SIGTERM)
                try:
                    popen.wait(10)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait(10)
        self._procs.clear()
