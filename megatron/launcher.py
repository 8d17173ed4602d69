"""Start the ranks of a run: `train.py --neox-config-json PATH` once per rank.

- local: this machine; one process per rank of the configured layout (1 without one), with the
  torchrun-style environment RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT, plus NEOX_TOPO_SIMULATED=1 for a simulated layout. One command, one exit code: when a
  rank fails, the others are stopped and the failing rank's code is returned. Every rank's output
  passes through here line by line (stdout to stdout, stderr to stderr), so lines never mix: rank
  0's as is, the others' prefixed `[rank k]`, or shown only if that rank fails.
- slurm: an `srun` command line (block distribution, one GPU per task bound to the closest
  cores, `-c7` on Frontier), executed in place of this process inside the allocation.
- hostfile: DeepSpeed's launcher (`deepspeed --hostfile ...`), executed in place of this process.
The command builders are pure functions so they can be tested without a cluster.
"""
from __future__ import annotations

import collections
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence, TextIO

from megatron.config import ConfigError, NeoXConfig, world_size_of
from megatron.exit_codes import STOP_CODES

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
                   simulated: bool) -> dict:
    """The environment of one local rank (all ranks share this machine, so LOCAL_RANK = RANK)."""
    env = dict(base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
               PYTHONUNBUFFERED="1")  # output is piped through deepy: let lines arrive as printed
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


class _RankOutput:
    """Copies one rank's stdout and stderr to the console line by line, so lines of different
    ranks never mix: rank 0 as is, others prefixed `[rank k]`, live or only if that rank fails."""

    def __init__(self, rank: int, proc: subprocess.Popen, console: TextIO, errors: TextIO,
                 lock: threading.Lock, live: bool, keep: int = 200):
        self.prefix = f"[rank {rank}] " if rank else ""
        self.lock, self.live = lock, live
        self.tail: collections.deque = collections.deque(maxlen=keep)
        self.threads = [threading.Thread(target=self._pump, args=(stream, target), daemon=True)
                        for stream, target in ((proc.stdout, console), (proc.stderr, errors))]
        for thread in self.threads:
            thread.start()

    def _pump(self, stream, target: TextIO) -> None:
        for raw in iter(stream.readline, b""):
            line = self.prefix + raw.decode("utf-8", "replace").rstrip("\n")
            if self.live:
                self._write([(target, line)])
            else:
                self.tail.append((target, line))
        stream.close()

    def _write(self, lines) -> None:
        with self.lock:
            for target, line in lines:
                target.write(line + "\n")  # one write per line: atomic even on an unbuffered stream
                target.flush()

    def finish(self, show_tail: bool) -> None:
        for thread in self.threads:
            thread.join(timeout=5.0)
        if show_tail and self.tail:
            self._write(list(self.tail))


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each still-running rank's process group (its own session), SIGKILL after the grace time."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the rank was started with start_new_session: its group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


def exit_code_of(returncode: int) -> int:
    """A shell-style exit code (128 + signal number for a rank killed by a signal)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def run_local(cfg: NeoXConfig, command: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
              rank_output: str = "all", console: Optional[TextIO] = None, errors: Optional[TextIO] = None,
              grace_s: float = 10.0, poll_s: float = 0.05) -> int:
    """Run `command` once per rank on this machine; 0 when all succeed (a stop code of
    megatron/exit_codes.py when they stopped on a signal), else the first failure's code."""
    console, errors = console or sys.stdout, errors or sys.stderr
    if rank_output not in ("all", "errors"):
        raise ValueError(f"rank_output must be 'all' or 'errors', not {rank_output!r}")
    world = world_size_of(cfg)
    base = dict(os.environ if env is None else env)
    addr = cfg.launcher.master_addr or "127.0.0.1"
    port = cfg.launcher.master_port or free_port()
    simulated = cfg.topology.simulate is not None
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    outputs: dict[int, _RankOutput] = {}
    forwarded = _forward_stop_signals(procs)
    try:
        for rank in range(world):
            proc = subprocess.Popen(list(command), env=local_rank_env(base, rank, world, addr, port, simulated),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            procs.append(proc)
            live = rank == 0 or rank_output == "all"
            outputs[rank] = _RankOutput(rank, proc, console, errors, lock, live=live)
        failed = _wait_first_failure(procs, poll_s)
    except KeyboardInterrupt:
        _stop(procs, grace_s)
        for out in outputs.values():
            out.finish(show_tail=False)
        print("deepy: interrupted; stopped all ranks", file=errors, flush=True)
        return 130
    except OSError as err:
        _stop(procs, grace_s)
        raise ConfigError(f"cannot start {command[0]!r}: {err}") from None
    finally:
        _restore_signals(forwarded)
    if failed is not None:
        _stop(procs, grace_s)
    for rank, out in outputs.items():
        out.finish(show_tail=failed is not None and rank == failed)
    if failed is None:
        return max(proc.returncode for proc in procs)  # 0, or the stop code every rank agreed on
    code = procs[failed].returncode
    others = world - 1
    stopped = f"; stopped the other {others} rank{'s' if others != 1 else ''}" if others else ""
    print(f"deepy: rank {failed} {describe_exit(code)}{stopped}", file=errors, flush=True)
    return exit_code_of(code) or 1


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


def _wait_first_failure(procs: Sequence[subprocess.Popen], poll_s: float) -> Optional[int]:
    """Block until every rank is done (-> None) or one fails (-> its rank)."""
    while True:
        running = False
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code is None:
                running = True
            elif code != 0 and code not in STOP_CODES:
                return rank  # a stop code is a clean end: the others are waited for, not stopped
        if not running:
            return None
        time.sleep(poll_s)


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
                          [local_rank_env(env, rank, world, addr, port, simulated) for rank in range(world)])
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
