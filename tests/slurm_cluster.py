"""Driving the real Slurm of tools/slurm/local_cluster.sh from tests: submit a shipped job script with
`sbatch`, follow the job through `scontrol show job`, read its output file and Slurm's job-completion
log. Used by tests/test_slurm_real.py (`make test-slurm`)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO / "tools" / "slurm" / "local_cluster.sh"
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")
# Variables of the shell running pytest that must not leak into a job (sbatch exports the environment).
NOT_PASSED_ON = ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "NEOX_", "PYTEST_")


@dataclass
class JobState:
    state: str
    exit_code: str  # "<code>:<signal>", as Slurm prints it
    restarts: int
    nodes: str


class LocalSlurm:
    """The cluster: its SLURM_CONF, and a job environment built from this process's environment."""

    def __init__(self, conf: str, jobcomp_log: Path):
        self.conf = conf
        self.jobcomp_log = jobcomp_log

    def command(self, *args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        env = {**os.environ, "SLURM_CONF": self.conf, **kw.pop("env", {})}
        return subprocess.run(list(args), env=env, capture_output=True, text=True, check=check, timeout=timeout, **kw)

    def job_env(self, **extra: str) -> dict:
        """What a user's shell would hold at submission: the repository, its venv, no module system."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(NOT_PASSED_ON)}
        env.update(SLURM_CONF=self.conf, NEOX_TOPO_ROOT=str(REPO), NEOX_TOPO_VENV=sys.prefix,
                   NEOX_TOPO_SKIP_MODULES="1", NEOX_TOPO_SHOW_LAUNCH="1", PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def submit(self, script, sbatch_args: list, script_args: list, submit_dir: Path, env: dict) -> str:
        """`sbatch` from `submit_dir` (the job's SLURM_SUBMIT_DIR, where its `-o %x-%j.out` lands);
        `script` a path, or "--wrap" with the command line as the one script argument."""
        proc = subprocess.run(["sbatch", "--parsable", *sbatch_args, str(script), *script_args], cwd=submit_dir,
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"sbatch refused {script}: {proc.stderr}"
        return proc.stdout.strip().split(";")[0]

    def state(self, job: str) -> JobState:
        out = self.command("scontrol", "show", "job", "-o", job).stdout
        fields = dict(re.findall(r"(\w+)=(\S*)", out))
        return JobState(fields["JobState"], fields["ExitCode"], int(fields.get("Restarts", 0)), fields.get("NodeList", ""))

    def wait(self, job: str, until, timeout_s: float, poll_s: float = 0.5) -> JobState:
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.state(job)
            if until(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} still {st} after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def wait_done(self, job: str, timeout_s: float = 600) -> JobState:
        return self.wait(job, lambda st: st.state in FINAL_STATES, timeout_s)

    def job_ends(self, job: str) -> list[str]:
        """Every end of `job` in Slurm's job-completion log: one per requeue (PENDING) and the last one."""
        if not self.jobcomp_log.exists():
            return []
        return re.findall(rf"^JobId={job} .*?JobState=(\S+)", self.jobcomp_log.read_text(), re.M)


def output_of(submit_dir: Path, name: str, job: str) -> str:
    path = submit_dir / f"{name}-{job}.out"
    return path.read_text() if path.exists() else ""


LAUNCH = re.compile(r"^launch: rank (\d+) of (\d+), local rank (\d+), node (\S+), rendezvous (\S+):(\d+)$", re.M)


def launches(text: str) -> list[tuple]:
    """(rank, world, local rank, node, master addr, master port) of every `launch:` line."""
    return [(int(r), int(w), int(lr), node, addr, int(port)) for r, w, lr, node, addr, port in LAUNCH.findall(text)]


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (a run's unique folder): ranks left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def start_cluster(timeout_s: float = 900) -> tuple[Optional[LocalSlurm], bool, str]:
    """(cluster, whether this call started it, the script's output); cluster None when it failed."""
    was_up = subprocess.run([str(CLUSTER_SCRIPT), "status"], capture_output=True, text=True).returncode == 0
    proc = subprocess.run([str(CLUSTER_SCRIPT), "start"], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        return None, False, proc.stdout + proc.stderr
    conf = subprocess.run([str(CLUSTER_SCRIPT), "env"], capture_output=True, text=True, check=True).stdout
    conf_path = conf.strip().split("=", 1)[1]
    work = Path(conf_path).parent
    return LocalSlurm(conf_path, work / "log" / "jobcomp.log"), not was_up, proc.stderr
