"""Start the ranks of a run: `train.py --neox-config-json PATH` once per rank.

- local: this machine; one process per rank of the configured layout (1 without one), with the
  torchrun-style environment RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT, plus NEOX_TOPO_SIMULATED=1 for a simulated layout and NEOX_TOPO_EXIT_WITH_PARENT=<this
  pid> (ranks exit if deepy dies: megatron/launch/rank_guard.py). One command, one exit code: when a rank
  fails, the others are stopped and the root cause's code is returned. Every rank's output passes
  through here line by line (megatron/launch/rank_output.py: to the console, and in full to a log file per
  rank); a failure ends with the first failed rank's error, once, and one line per other rank
  (megatron/launch/failure_report.py).
- slurm: an `srun` command line (block distribution, one GPU per task bound to the closest
  cores, `-c7` on Frontier), executed in place of this process inside the allocation; tasks get
  NEOX_TOPO_EXIT_WITH_PARENT=any.
- hostfile: DeepSpeed's launcher (`deepspeed --hostfile ...`), executed in place of this process.
The command builders are pure functions so they can be tested without a cluster.
"""
from __future__ import annotations

import math
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, TextIO

from megatron.config import ConfigError, NeoXConfig, world_size_of
from megatron.launch.failure_report import RankEnd, headline, how_it_ended, root_cause, where_it_was, where_the_logs_are
from megatron.launch.rank_guard import EXIT_WITH_PARENT
from megatron.launch.rank_output import RankOutput
from megatron.launch.exit_codes import STOP_CODES

DEFAULT_MASTER_PORT = 29500
# Frontier settings from OLCF's documentation; applied only where the environment has none.
FRONTIER_ENV = {
    "NCCL_SOCKET_IFNAME": "hsn0",
    "NCCL_CROSS_NIC": "1",
    "NCCL_NET_GDR_LEVEL": "PHB",
    "FI_MR_CACHE_MONITOR": "kdreg2",
    "FI_CXI_DISABLE_HOST_REGISTER": "1",
    "HSA_FORCE_FINE_GRAIN_PCIE": "1",
}


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
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
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


@dataclass(frozen=True)
class RankExit:
    rank: int
    returncode: int
    at: float  # time.monotonic() when it was reaped


class RankExits:
    """One thread per rank blocked in wait(), so exits arrive in the order they happen, to the
    millisecond: a poll loop visiting the ranks in order would name rank 0 when ranks 1 and 0 end
    in the same tick, and a killed rank's peers end within milliseconds of it."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self.ended: dict[int, RankExit] = {}

    def add(self, rank: int, proc: subprocess.Popen) -> None:
        threading.Thread(target=self._wait, args=(rank, proc), daemon=True).start()

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self._queue.put(RankExit(rank, code, time.monotonic()))

    def next(self, timeout: Optional[float]) -> Optional[RankExit]:
        """The next exit, or None after `timeout` seconds (interruptible: signals reach deepy meanwhile)."""
        try:
            ended = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        self.ended[ended.rank] = ended
        return ended

    def wait_all(self, world: int, timeout_s: float = 30.0) -> dict[int, RankExit]:
        deadline = time.monotonic() + timeout_s
        while len(self.ended) < world and time.monotonic() < deadline:
            self.next(timeout=max(0.0, deadline - time.monotonic()))
        return self.ended


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> set[int]:
    """SIGTERM each still-running rank's process group (its own session), SIGKILL after the grace
    time; returns the ranks it signalled."""
    alive = {rank: p for rank, p in enumerate(procs) if p.poll() is None}
    for p in alive.values():
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in alive.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()
    return set(alive)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the rank was started with start_new_session: its group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


def exit_code_of(returncode: int) -> int:
    """A shell-style exit code (128 + signal number for a rank killed by a signal)."""
    return 128 - returncode if returncode < 0 else returncode


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
    procs: list[subprocess.Popen] = []
    outputs: dict[int, RankOutput] = {}
    exits = RankExits()
    forwarded = _forward_stop_signals(procs)
    try:
        for rank in range(world):
            # Started from this thread, which outlives them: the ranks' parent-death signal is tied to it.
            proc = subprocess.Popen(list(command), env=local_rank_env(base, rank, world, addr, port, simulated,
                                                                            os.getpid()),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            procs.append(proc)
            exits.add(rank, proc)
            live = rank == 0 or rank_output == "all"
            outputs[rank] = RankOutput(rank, proc, console, errors, lock, live=live,
                                       log_path=folder / f"rank{rank}.log")
        failed = _wait_first_failure(exits, outputs, world)
    except KeyboardInterrupt:
        for out in outputs.values():
            out.quiet()
        _stop(procs, grace_s)
        for out in outputs.values():
            out.finish()
        print("deepy: interrupted; stopped all ranks", file=errors, flush=True)
        return 130
    except OSError as err:
        _stop(procs, grace_s)
        for out in outputs.values():
            out.finish()
        raise ConfigError(f"cannot start {command[0]!r}: {err}") from None
    finally:
        _restore_signals(forwarded)
    if failed is None:
        for out in outputs.values():
            out.finish()
            out.release_hold()
        return max(proc.returncode for proc in procs)  # 0, or the stop code every rank agreed on
    for out in outputs.values():
        out.quiet()
    stopped = _stop(procs, grace_s)
    ended = exits.wait_all(world)
    for out in outputs.values():
        out.finish()
    ends = [RankEnd(rank, procs[rank].returncode, ended[rank].at if rank in ended else time.monotonic(),
                    stopped=rank in stopped, error=outputs[rank].error.line, last_output=outputs[rank].last_output)
            for rank in range(world)]
    root = root_cause(ends)
    _report_failure(root, ends, outputs, folder, errors, lock)
    return exit_code_of(root.returncode) or 1


def _wait_first_failure(exits: RankExits, outputs: Mapping[int, RankOutput], world: int,
                        tick_s: float = 0.5) -> Optional[RankExit]:
    """Block until every rank is done (-> None) or one fails (-> its exit); meanwhile show held
    tracebacks of ranks that went on running."""
    while len(exits.ended) < world:
        ended = exits.next(timeout=tick_s)
        if ended is not None and ended.returncode != 0 and ended.returncode not in STOP_CODES:
            return ended  # a stop code is a clean end: the others are waited for, not stopped
        now = time.monotonic()
        for out in outputs.values():
            out.release_stale_hold(now)
    return None


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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _forward_stop_signals(procs: list) -> dict:
    """Slurm's warning signals reach deepy; pass them to every rank so they save and exit together."""
    def forward(signum, frame):
        for proc in procs:
            if proc.poll() is None:
                _signal_group(proc, signum)
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}


def _restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


# --- Slurm -----------------------------------------------------------------------------------------

def srun_command(cfg: NeoXConfig, rank_command: Sequence[str]) -> list[str]:
    """`srun` for the layout: block distribution so consecutive ranks share a node (and a GPU)."""
    nodes, per_node = num_nodes(cfg), ranks_per_node(cfg)
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes * per_node}", f"--ntasks-per-node={per_node}",
           "--distribution=block"]
    if cfg.training.device != "cpu":
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
    out["MASTER_PORT"] = str(cfg.launcher.master_port or env.get("MASTER_PORT") or DEFAULT_MASTER_PORT)
    out[EXIT_WITH_PARENT] = "any"  # each task exits if its slurmstepd is gone (megatron/launch/rank_guard.py)
    if cfg.topology.preset == "frontier":
        for key, value in FRONTIER_ENV.items():
            out.setdefault(key, value)
    return out


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
        return LaunchPlan(kind, [srun_command(cfg, rank_command)], [rank_env], notes)
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
