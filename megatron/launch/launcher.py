"""Start the ranks of a run: `train.py --neox-config-json PATH` once per rank.

- local: this machine; one process per rank of the configured layout (1 without one), with the
  torchrun-style environment RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT, plus NEOX_TOPO_SIMULATED=1 for a simulated layout and NEOX_TOPO_EXIT_WITH_PARENT=<this
  pid> (ranks exit if deepy dies: megatron/launch/rank_guard.py), started and stopped by
  megatron/launch/spawner.py. One command, one exit code: when a rank fails, the others are stopped and
  the root cause's code is returned. Every rank's output passes
  through here line by line (megatron/launch/rank_output.py: to the console, and in full to a log file per
  rank); a failure ends with the first failed rank's error, once, and one line per other rank
  (megatron/launch/failure_report.py).
- slurm: an `srun` command line (block distribution; for a GPU run one GPU per task bound to the
  closest cores; `-c7` on Frontier), executed in place of this process inside the allocation; tasks
  get NEOX_TOPO_EXIT_WITH_PARENT=any and MASTER_PORT from the job id (`job_master_port`).
- hostfile: DeepSpeed's launcher (`deepspeed --hostfile ...`), executed in place of this process.
The command builders are pure functions so they can be tested without a cluster.
"""
from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, TextIO

from megatron.config import ConfigError, NeoXConfig, world_size_of
from megatron.config.validate import uses_gpus
from megatron.launch.failure_report import RankEnd, headline, how_it_ended, root_cause, where_it_was, where_the_logs_are
from megatron.launch.rank_guard import EXIT_WITH_PARENT
from megatron.launch.rank_output import RankOutput
from megatron.launch.exit_codes import STOP_CODES
from megatron.launch.spawner import PIPE, RankCommand, RankExit, RankProcesses, exit_code_of

DEFAULT_MASTER_PORT = 29500  # torchrun's; DeepSpeed's launcher and a Slurm run outside a job
# A Slurm job's rendezvous port: JOB_PORT_BASE + job id mod JOB_PORT_SPAN, below Linux's ephemeral
# range (32768-60999), so the OS never lends it to an outgoing connection, and different for any two
# jobs whose ids differ by less than the span (two jobs sharing a node each get their own).
JOB_PORT_BASE, JOB_PORT_SPAN = 20000, 10000
MALLOC_MMAP_THRESHOLD = "1048576"  # bytes: what the local launcher gives its ranks (local_rank_env says why)
# Frontier's RCCL/libfabric settings, applied only where the environment has none; the same values as
# tools/slurm/frontier/env.sh (tests/test_slurm_jobs.py compares them). Sources (docs/launch.md):
# [OLCF] OLCF, "PyTorch on Frontier" (docs.olcf.ornl.gov/software/python/pytorch_frontier.html);
# [HPE] HPE, "HPE Slingshot Application Note: Running RCCL-Based Applications"
#       (github.com/HewlettPackard/shs-ccl-docs, rccl/rccl_tuning_guide.md and ccl_env.sh);
# [PCCL] the PCCL authors' Frontier runs (axonn-ai/sc2025-pccl-reproducer run.sh, commit 5a6353f).
FRONTIER_ENV = {
    "NCCL_SOCKET_IFNAME": "hsn0",  # [OLCF] RCCL's bootstrap on the Slingshot interface
    "NCCL_CROSS_NIC": "1",  # [OLCF, HPE] rings may span NICs: better on large systems
    "NCCL_NET_GDR_LEVEL": "PHB",  # [HPE] GPU-NIC RDMA
    "FI_MR_CACHE_MONITOR": "kdreg2",  # [HPE] one of its two memory-registration monitors (userfaultfd the other)
    "FI_CXI_DISABLE_HOST_REGISTER": "1",  # [HPE] avoids ROCm allocation calls that can deadlock RCCL
    "HSA_FORCE_FINE_GRAIN_PCIE": "1",  # [HPE] peer access to the large BAR
    # [HPE, PCCL] no eager sends: every message waits for its receiver (rendezvous). Without these, world
    # all-gathers and reduce-scatters with 64-256 KiB chunks per rank took 10 ms-1.6 s per call in
    # the PCCL runs; with them the rate rose smoothly with size (docs/launch.md).
    "FI_CXI_RDZV_THRESHOLD": "0",
    "FI_CXI_RDZV_GET_MIN": "0",
    "FI_CXI_RDZV_EAGER_SIZE": "0",
    "FI_CXI_DEFAULT_CQ_SIZE": "131072",  # [HPE] larger completion queues for large jobs
    "FI_CXI_DEFAULT_TX_SIZE": "2048",  # [HPE] for jobs that depend on unexpected rendezvous messages
    "FI_CXI_RX_MATCH_MODE": "hybrid",  # [HPE] fall back to software matching when hardware runs out
}


def node_local_cache(kind: str, env: Mapping[str, str]) -> str:
    """/tmp/<kind>-<user>-<job id>: a cache folder on each node's own disk (a shared home or Lustre
    folder serialises every rank on its lock); the same name env.sh makes and removes."""
    return f"/tmp/{kind}-{env.get('USER') or 'neox'}-{env.get('SLURM_JOB_ID') or '0'}"


def ranks_per_node(cfg: NeoXConfig) -> int:
    layout = cfg.topology.layout
    return math.prod(layout[1:]) if layout else 1


def num_nodes(cfg: NeoXConfig) -> int:
    layout = cfg.topology.layout
    return layout[0] if layout else 1


def script_command(script: str, config_json: str, extra_args: Sequence[str] = (),
                   python: str = sys.executable) -> list[str]:
    """What every rank runs."""
    return [python, script, "--neox-config-json", str(config_json), *extra_args]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def local_rank_env(base: Mapping[str, str], rank: int, world_size: int, master_addr: str, master_port: int,
                   simulated: bool, launcher_pid) -> dict:
    """The environment of one local rank (all ranks share this machine, so LOCAL_RANK = RANK)."""
    env = dict(base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
               PYTHONUNBUFFERED="1")  # output is piped through deepy: let lines arrive as printed
    env[EXIT_WITH_PARENT] = str(launcher_pid)  # a rank never outlives deepy (megatron/launch/rank_guard.py)
    env.pop("NEOX_TOPO_SIMULATED", None)
    if simulated:
        env["NEOX_TOPO_SIMULATED"] = "1"
    if world_size > 1:
        # Oversubscribed CPU ranks fight over cores; torchrun makes the same choice.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
        # glibc's dynamic mmap threshold grows to 32 MB after the first large free, after which
        # unit-sized tensors come from arenas that keep freed memory: a fixed 1 MB threshold returns
        # every large tensor to the OS (measured: zero_topo step peak 1.95 -> 1.17 GB above baseline
        # per rank for 160M parameters on 2x2x2; bench/memory.py, docs/memory.md).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", MALLOC_MMAP_THRESHOLD)
    return env


def rank_log_folder(log_dir: str) -> Path:
    """Where every rank's full output goes: <log_dir>/rank_logs_<time>_<pid>/, else (log_dir not
    writable) a new temporary folder."""
    name = f"rank_logs_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}"
    folder = Path(log_dir) / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return folder.resolve()
    except OSError:
        return Path(tempfile.mkdtemp(prefix=name + "_"))


ROOT_CAUSE_LINES = 40  # of the failed rank's output the console had not seen (its traceback)


def run_local(cfg: NeoXConfig, command: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
              rank_output: str = "all", console: Optional[TextIO] = None, errors: Optional[TextIO] = None,
              grace_s: float = 10.0, log_folder: Optional[Path] = None) -> int:
    """Run `command` once per rank on this machine; 0 when all succeed (a stop code of
    megatron/launch/exit_codes.py when they stopped on a signal), else the root cause's code."""
    console, errors = console or sys.stdout, errors or sys.stderr
    if rank_output not in ("all", "errors"):
        raise ValueError(f"rank_output must be 'all' or 'errors', not {rank_output!r}")
    world = world_size_of(cfg)
    base = dict(os.environ if env is None else env)
    addr = cfg.launcher.master_addr or "127.0.0.1"
    port = cfg.launcher.master_port or free_port()
    simulated = cfg.topology.simulate is not None
    folder = log_folder or rank_log_folder(cfg.logging.log_dir)
    folder.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    outputs: dict[int, RankOutput] = {}
    # On any way out, ranks still running are stopped (the failure and interrupt paths stop them first).
    with RankProcesses(grace_s) as ranks:
        with ranks.forwarding(STOP_SIGNALS):
            try:
                for rank in range(world):
                    # Started from this thread, which outlives them: the ranks' parent-death signal is tied to it.
                    rank_env = local_rank_env(base, rank, world, addr, port, simulated, os.getpid())
                    proc = ranks.start(RankCommand(list(command), rank_env, output=PIPE))
                    live = rank == 0 or rank_output == "all"
                    outputs[rank] = RankOutput(rank, proc, console, errors, lock, live=live,
                                               log_path=folder / f"rank{rank}.log")
                failed = _wait_first_failure(ranks, outputs)
            except KeyboardInterrupt:
                for out in outputs.values():
                    out.quiet()
                ranks.stop()
                for out in outputs.values():
                    out.finish()
                print("deepy: interrupted; stopped all ranks", file=errors, flush=True)
                return 130
            except OSError as err:
                ranks.stop()
                for out in outputs.values():
                    out.finish()
                raise ConfigError(f"cannot start {command[0]!r}: {err}") from None
        if failed is None:
            for out in outputs.values():
                out.finish()
                out.release_hold()
            return max(proc.returncode for proc in ranks.procs)  # 0, or the stop code every rank agreed on
        for out in outputs.values():
            out.quiet()
        stopped = ranks.stop()
        ended = ranks.wait_all()
        for out in outputs.values():
            out.finish()
        ends = [RankEnd(rank, ranks.procs[rank].returncode, ended[rank].at if rank in ended else time.monotonic(),
                        stopped=rank in stopped, error=outputs[rank].error.line, last_output=outputs[rank].last_output)
                for rank in range(world)]
        root = root_cause(ends)
        _report_failure(root, ends, outputs, folder, errors, lock)
        return exit_code_of(root.returncode) or 1


def _wait_first_failure(ranks: RankProcesses, outputs: Mapping[int, RankOutput],
                        tick_s: float = 0.5) -> Optional[RankExit]:
    """Block until every rank is done (-> None) or one fails (-> its exit); meanwhile show held
    tracebacks of ranks that went on running. A stop code is a clean end: the others are waited
    for, not stopped."""
    def release_stale_holds() -> None:
        now = time.monotonic()
        for out in outputs.values():
            out.release_stale_hold(now)
    return ranks.first_failure(clean_codes=(0, *STOP_CODES), tick_s=tick_s, on_tick=release_stale_holds)


def _report_failure(root: RankEnd, ends: Sequence[RankEnd], outputs: Mapping[int, RankOutput], folder: Path,
                    errors: TextIO, lock: threading.Lock) -> None:
    """The root cause first and once (with what the console has not seen of it), then one line per
    other rank, then where the full output is."""
    out = outputs[root.rank]
    unshown = list(out.unshown)
    shown = unshown[-ROOT_CAUSE_LINES:]
    lines = [(errors, headline(root, len(ends)))]
    context = where_it_was(root, ends)
    if context and not any(line == out.prefix + (root.last_output or "") for _, line in shown):
        lines.append((errors, context))
    if len(unshown) > len(shown):
        lines.append((errors, f"deepy: rank {root.rank}'s last {len(shown)} lines (all in {out.log_path}):"))
    lines += shown
    lines += [(errors, how_it_ended(end, root)) for end in ends if end is not root]
    lines.append((errors, where_the_logs_are(folder, len(ends))))
    out.write(lines)


# Slurm's warning signals reach deepy; every rank gets them, so they save and exit together.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


# --- Slurm -----------------------------------------------------------------------------------------

def srun_command(cfg: NeoXConfig, rank_command: Sequence[str], env: Optional[Mapping[str, str]] = None) -> list[str]:
    """`srun` for the layout: block distribution so consecutive ranks share a node (and a GPU); one
    GPU per task only for a GPU run (validate.uses_gpus: on a CPU-only allocation Slurm refuses
    --gpus-per-task)."""
    nodes, per_node = num_nodes(cfg), ranks_per_node(cfg)
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes * per_node}", f"--ntasks-per-node={per_node}",
           "--distribution=block"]
    if uses_gpus(cfg, os.environ if env is None else env):
        cmd += ["--gpus-per-task=1", "--gpu-bind=closest"]
    if cfg.topology.preset == "frontier":
        cmd.append("-c7")  # 7 of each node's 56 usable cores per GCD (OLCF's recommendation)
    if cfg.launcher.account:
        cmd.append(f"--account={cfg.launcher.account}")
    if cfg.launcher.comment:
        cmd.append(f"--comment={cfg.launcher.comment}")
    # One failed task ends the step: without it Slurm leaves the others waiting in a collective.
    cmd.append("--kill-on-bad-exit=1")
    return cmd + list(rank_command)


def slurm_hosts(env: Mapping[str, str], run: Callable = subprocess.run) -> list[str]:
    """The allocation's hosts in order (`scontrol show hostnames $SLURM_JOB_NODELIST`); [] when unknown."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return []
    try:
        out = run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return out.split()


def first_slurm_host(env: Mapping[str, str], run: Callable = subprocess.run) -> Optional[str]:
    """The first host of the allocation (the rendezvous host), or None."""
    hosts = slurm_hosts(env, run)
    return hosts[0] if hosts else None


def slurm_env(cfg: NeoXConfig, env: Mapping[str, str], master_addr: Optional[str]) -> dict:
    """The environment srun passes on: rendezvous address/port, Frontier defaults where unset."""
    out = dict(env)
    addr = cfg.launcher.master_addr or master_addr
    if addr:
        out["MASTER_ADDR"] = addr
    out["MASTER_PORT"] = str(cfg.launcher.master_port or env.get("MASTER_PORT") or job_master_port(env))
    out[EXIT_WITH_PARENT] = "any"  # each task exits if its slurmstepd is gone (megatron/launch/rank_guard.py)
    if cfg.topology.preset == "frontier":
        for key, value in FRONTIER_ENV.items():
            out.setdefault(key, value)
        out.setdefault("TRITON_CACHE_DIR", node_local_cache("triton", env))  # Triton makes the folder
    return out


def slurm_rendezvous(env: Mapping[str, str], run: Callable = subprocess.run) -> dict:
    """MASTER_ADDR and MASTER_PORT for a task that plain srun started (a tool, not deepy's srun
    line): the allocation's first host and the job's port, as `slurm_env` gives deepy's ranks; {}
    outside a Slurm job."""
    if not env.get("SLURM_JOB_ID"):
        return {}
    host = first_slurm_host(env, run)
    return {"MASTER_PORT": str(job_master_port(env)), **({"MASTER_ADDR": host} if host else {})}


def job_master_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of the Slurm job in `env` (JOB_PORT_BASE + its id mod JOB_PORT_SPAN; a
    requeued job keeps its id, so its port); DEFAULT_MASTER_PORT outside a job. A fixed port made the
    second job on a node fail with EADDRINUSE."""
    job = (env.get("SLURM_JOB_ID") or "").strip()
    if not job:
        return DEFAULT_MASTER_PORT
    number = int(job) if job.isdigit() else zlib.crc32(job.encode())
    return JOB_PORT_BASE + number % JOB_PORT_SPAN


# --- hostfile (DeepSpeed's launcher) ----------------------------------------------------------------

def deepspeed_command(cfg: NeoXConfig, script: str, config_json: str, extra_args: Sequence[str] = (),
                      deepspeed: Sequence[str] = ("deepspeed",)) -> list[str]:
    """`deepspeed --hostfile H ... script --neox-config-json PATH` (no --local_rank argument)."""
    la = cfg.launcher
    cmd = [*deepspeed, f"--hostfile={la.hostfile}"]
    if la.include or la.exclude:
        # DeepSpeed refuses --num_nodes/--num_gpus together with --include/--exclude.
        cmd += [f"--include={la.include}"] if la.include else []
        cmd += [f"--exclude={la.exclude}"] if la.exclude else []
    else:
        cmd += [f"--num_nodes={num_nodes(cfg)}", f"--num_gpus={ranks_per_node(cfg)}"]
    if la.master_addr:
        cmd.append(f"--master_addr={la.master_addr}")
    cmd += [f"--master_port={la.master_port or DEFAULT_MASTER_PORT}", "--no_local_rank",
            script, "--neox-config-json", str(config_json), *extra_args]
    return cmd


# --- dispatch ---------------------------------------------------------------------------------------

FREE_PORT_AT_LAUNCH = "<a free port, picked at launch>"
LAUNCHER_PID_AT_LAUNCH = "<deepy's pid at launch>"
NO_ALLOCATION = ("launcher slurm: no Slurm allocation here (SLURM_JOB_ID is unset); "
                 "run deepy.py inside sbatch or salloc, or use launcher: local")


@dataclass
class LaunchPlan:
    """What `launch` runs: the command(s) and each one's full environment. Local runs start one
    command per rank on this machine; slurm and hostfile runs replace deepy with one command."""
    kind: str
    commands: list
    envs: list
    notes: list = field(default_factory=list)  # what is missing for the launch to work


def plan_launch(cfg: NeoXConfig, script: str, config_json: str, extra_args: Sequence[str] = (),
                env: Optional[Mapping[str, str]] = None) -> LaunchPlan:
    """The plan of `launch`, built without starting anything (deepy --dry-run prints it)."""
    env = dict(os.environ if env is None else env)
    kind = cfg.launcher.launcher
    rank_command = script_command(script, config_json, extra_args)
    if kind == "local":
        world = world_size_of(cfg)
        addr = cfg.launcher.master_addr or "127.0.0.1"
        port = cfg.launcher.master_port or FREE_PORT_AT_LAUNCH
        simulated = cfg.topology.simulate is not None
        return LaunchPlan(kind, [rank_command] * world,
                          [local_rank_env(env, rank, world, addr, port, simulated, LAUNCHER_PID_AT_LAUNCH)
                           for rank in range(world)])
    if kind == "slurm":
        notes = [] if "SLURM_JOB_ID" in env else [NO_ALLOCATION]
        rank_env = slurm_env(cfg, env, first_slurm_host(env))
        if "MASTER_ADDR" not in rank_env:
            notes.append("no rendezvous host: `scontrol show hostnames $SLURM_JOB_NODELIST` gave none and "
                         "MASTER_ADDR is unset (set master_addr)")
        return LaunchPlan(kind, [srun_command(cfg, rank_command, env)], [rank_env], notes)
    if kind == "hostfile":
        return LaunchPlan(kind, [deepspeed_command(cfg, script, config_json, extra_args)], [env])
    raise ConfigError(f"launcher: {kind!r} is not supported; use local, slurm or hostfile")


def launch(cfg: NeoXConfig, script: str, config_json: str, *, extra_args: Sequence[str] = (),
           env: Optional[Mapping[str, str]] = None, rank_output: str = "all",
           execute: Callable[[list, dict], int] = None) -> int:
    """Start the run with cfg.launcher.launcher. slurm/hostfile replace this process (`execute`,
    default os.execvpe); local returns the run's exit code."""
    env = dict(os.environ if env is None else env)
    if cfg.launcher.launcher == "local":
        # run_local builds the same per-rank environments as the plan, with a port picked now.
        return run_local(cfg, script_command(script, config_json, extra_args), env=env, rank_output=rank_output)
    if cfg.launcher.launcher == "slurm" and "SLURM_JOB_ID" not in env:
        raise ConfigError(NO_ALLOCATION)
    plan = plan_launch(cfg, script, config_json, extra_args, env)
    return (execute or _exec)(plan.commands[0], plan.envs[0])


def _exec(command: list, env: dict) -> int:
    try:
        os.execvpe(command[0], command, env)
    except OSError as err:
        raise ConfigError(f"cannot run {command[0]!r}: {err}; is it installed and on PATH?") from None
    return 1  # not reached
