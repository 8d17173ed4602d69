#!/usr/bin/env python
"""An emulated cluster on one machine: K "nodes" as network namespaces on a bridge, each node's link
rate-limited, R ranks started inside each node's namespace; or, with --gpus-per-node G, three tiers:
each GPU's ranks (a GCD pair) in a namespace of their own behind a link of --gpu-rate.

    # train.py on 2 nodes x 2 ranks over 1 Gbit/s links (deepy-style arguments after --)
    python tools/emulate_cluster.py --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        train.py configs/tiny-cpu.yml configs/sim-2x2.yml configs/zero3.yml --set train_iters=4
    # any command, once per rank ({rank} {local_rank} {node} {world_size} are replaced)
    python tools/emulate_cluster.py --nodes 2 --ranks-per-node 2 --rate 200mbit \\
        --command "python bench/x.py --out /tmp/x{rank}.json"
    # three tiers, Frontier-shaped: 2 nodes x 2 GPUs x 2 ranks (pair on loopback, GPU links, node links)
    python tools/emulate_cluster.py --nodes 2 --gpus-per-node 2 --ranks-per-node 4 --rate 640mbit \
        --gpu-rate 640mbit -- train.py configs/tiny-cpu.yml configs/sim-2x2x2.yml configs/zero_topo.yml
    # remove what a killed run left behind (namespaces, links and bridges of the prefix)
    python tools/emulate_cluster.py --cleanup

The network is megatron/benchmarking/emulated_network.py (its docstring says how it is built: a
bridge, a namespace and veth pair per node, tbf on both ends; nothing routed out).

The ranks. Rank r runs on node r // R as `ip netns exec <ns> COMMAND` with the local launcher's
environment (megatron.launch.launcher.local_rank_env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
NEOX_TOPO_SIMULATED for a simulated layout, NEOX_TOPO_EXIT_WITH_PARENT=<this pid>, thread and
malloc settings), with LOCAL_RANK = r % R and LOCAL_WORLD_SIZE = R instead of the single-host
values, GLOO_SOCKET_IFNAME=<run>n<node> (gloo binds to the node's interface) and MASTER_ADDR =
node 0's address. On three tiers rank r runs in GPU (r % R) // (R / G) of its node, with that GPU's
interface as GLOO_SOCKET_IFNAME, node 0's GPU 0 as MASTER_ADDR, and NEOX_EMU_NODE_NETNS /
NEOX_EMU_NODE_IF / NEOX_EMU_RANKS_PER_GPU so a benchmark can read its node's uplink counters (the uplink
sits in the node's namespace, not the rank's). When a rank fails the others are stopped (SIGTERM, SIGKILL after --grace-s); the
ranks are started and watched by megatron/launch/spawner.py, so the rank named is the first to fail.

Training. After `--` come deepy.py's arguments: `[SCRIPT.py] CONFIG.yml ... [--set KEY=VALUE]
[-d DIR] [-- script args]`. The configs are merged and validated exactly as deepy.py does
(megatron.config.load_config), the result is written once as JSON under the config's log_dir
(deepy.write_run_config: <log_dir>/neox_config_<time>_<pid>.json, the file deepy hands its ranks),
and every rank runs `python SCRIPT --neox-config-json THAT.json`. The config's layout must be
--nodes x --ranks-per-node (`topology.simulate: [2, R]`, or [2, gpus, gcds] with gpus x gcds = R;
the flags default to the layout); rank = node x R + local, the trainer's own numbering. A JSON
written earlier (by deepy.py, or by this tool) can be run directly with
`--command "python train.py --neox-config-json PATH"`; its layout is checked the same way.

Interface counters. /sys/class/net/<if>/statistics/{tx,rx}_{bytes,packets} of every node's
interface are read inside its namespace before the ranks start and after they end; the difference
is what crossed node boundaries (Ethernet frames: payload + TCP/IP/Ethernet headers + ACKs +
connection set-up). It is printed per node and, with --report PATH, written as JSON. On three tiers
the report adds the bytes per ledger tier (emulated_network.tier_bytes: uplinks, GPU links less the
uplinks, loopbacks of the GPU namespaces).

Exit codes: 0 all ranks succeeded; the first failed rank's code (128 + N for a signal N); 2 a
usage or config error; 69 (EX_UNAVAILABLE) no emulation possible here: not root, or ip / tc
(iproute2) missing, or the kernel refused a namespace, veth, bridge or tbf; 124 --timeout-s
expired; 130 / 143 interrupted by SIGINT / SIGTERM. The network is torn down in every case
(try/finally and signal handlers); only SIGKILL leaves it, for --cleanup.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, TextIO

from megatron.benchmarking.emulated_network import (COUNTERS, Cluster, EmulationError, UsageError, build, cleanup,
                                                    environment_problem, new_cluster, parse_rate, read_counters,
                                                    read_tier_counters, teardown, tier_bytes)
from megatron.launch.launcher import local_rank_env, script_command
from megatron.launch.spawner import PIPE, RankCommand, RankProcesses, exit_code_of

REPO = Path(__file__).resolve().parents[1]

USAGE = 2
UNAVAILABLE = 69  # EX_UNAVAILABLE (sysexits.h)
TIMED_OUT = 124  # as timeout(1)
DEFAULT_PREFIX = "nxemu"
DEFAULT_RATE = "1gbit"
DEFAULT_MASTER_PORT = 29500  # every run has its own namespaces: no clash between concurrent runs


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# --- the ranks ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankSpec:
    rank: int
    node: int
    command: list
    env: dict
    namespace: str = ""              # where it runs: its node's, or on three tiers its GPU's


def rank_specs(cluster: Cluster, per_node: int, command: Sequence[str], simulated: bool, master_port: int,
               base_env: Optional[dict] = None) -> list[RankSpec]:
    """Every rank's command and environment: the local launcher's, made multi-node."""
    world = cluster.nodes * per_node
    if cluster.three_tier and per_node % cluster.gpus:
        raise UsageError(f"--ranks-per-node {per_node} is not a multiple of --gpus-per-node {cluster.gpus}")
    per_gpu = per_node // cluster.gpus if cluster.three_tier else per_node
    base = dict(os.environ if base_env is None else base_env)
    specs = []
    for rank in range(world):
        node, local = divmod(rank, per_node)
        namespace, interface, _ = cluster.rank_place(node, local // per_gpu)
        env = local_rank_env(base, rank, world, cluster.master_address(), master_port, simulated, os.getpid())
        env.update(LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_node), GLOO_SOCKET_IFNAME=interface)
        if cluster.three_tier:
            env.update(NEOX_EMU_NODE_NETNS=cluster.namespace(node), NEOX_EMU_NODE_IF=cluster.node_if(node),
                       NEOX_EMU_RANKS_PER_GPU=str(per_gpu))
        fields = {"{rank}": rank, "{local_rank}": local, "{node}": node, "{world_size}": world}
        argv = [_substitute(arg, fields) for arg in command]
        specs.append(RankSpec(rank, node, argv, env, namespace))
    return specs


def _substitute(arg: str, fields: dict) -> str:
    for key, value in fields.items():
        arg = arg.replace(key, str(value))
    return arg


def _pump(stream, target: TextIO, prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        with lock:
            target.write(prefix + raw.decode("utf-8", "replace"))
            target.flush()


def run_ranks(cluster: Cluster, specs: Sequence[RankSpec], *, timeout_s: float = 0, grace_s: float = 10.0,
              out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Start every rank in its node's namespace; 0 when all succeed, else the code of the first rank
    to fail. `ip netns exec` enters the namespace and execs the command, so each process is the rank itself."""
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    try:
        with RankProcesses(grace_s) as ranks:
            for spec in specs:
                proc = ranks.start(RankCommand(["ip", "netns", "exec", spec.namespace or cluster.namespace(spec.node), *spec.command],
                                               spec.env, output=PIPE))
                prefix = f"[rank {spec.rank}] " if spec.rank else ""
                for stream, target in ((proc.stdout, out), (proc.stderr, err)):
                    pumps.append(threading.Thread(target=_pump, args=(stream, target, prefix, lock), daemon=True))
                    pumps[-1].start()
            try:
                failed = ranks.first_failure(timeout_s or None, tick_s=0.05)
            except TimeoutError:
                print(f"emulate_cluster: --timeout-s {timeout_s:g} expired; stopping the ranks", file=err, flush=True)
                return TIMED_OUT
            if failed is None:
                return 0
            code = exit_code_of(failed.returncode)
            print(f"emulate_cluster: rank {failed.rank} exited with {code}; stopping the others", file=err, flush=True)
            return code
    finally:
        for pump in pumps:
            pump.join(timeout=5)


# --- training configs ---------------------------------------------------------------------------------

def layout_of(cfg) -> tuple[int, int]:
    """(nodes, ranks per node) of a config's layout."""
    layout = cfg.topology.layout
    if not layout:
        raise UsageError("the config has no multi-rank layout; add a two-tier one, e.g. configs/sim-2x2.yml "
                         "(topology.simulate: [nodes, ranks per node])")
    return int(layout[0]), math.prod(int(x) for x in layout[1:])


def check_layout(cfg, nodes: Optional[int], per_node: Optional[int], gpus: int = 0) -> tuple[int, int]:
    have = layout_of(cfg)
    want = (nodes or have[0], per_node or have[1])
    if want != have:
        raise UsageError(f"the config's layout {cfg.topology.layout} is {have[0]} node(s) x {have[1]} ranks, "
                         f"not --nodes {want[0]} x --ranks-per-node {want[1]}; set topology.simulate: "
                         f"[{want[0]}, {want[1]}]")
    layout = cfg.topology.layout
    if gpus and len(layout) == 3 and int(layout[1]) != gpus:
        raise UsageError(f"the config's layout {layout} has {layout[1]} GPUs per node, not --gpus-per-node {gpus}")
    return have


class _DeepyArgs(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message}; after --: [SCRIPT.py] CONFIG.yml ... [--set KEY=VALUE] [-d DIR] [-- script args]")


def _deepy():
    """deepy.py, the launcher script at the checkout's root (a script, not part of the installed package)."""
    spec = importlib.util.spec_from_file_location("deepy", REPO / "deepy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def training_config(deepy_args: Sequence[str]) -> tuple[object, str, list[str]]:
    """deepy.py's arguments -> (the validated config, the script, the script's own arguments)."""
    deepy = _deepy()
    from megatron.checkpointing.folders import save_folder_conflict
    from megatron.config import ConfigError, launch_environment_error, load_config

    ours, script_args = deepy.split_args(list(deepy_args))
    p = _DeepyArgs(prog="emulate_cluster.py ... --", add_help=False)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("-d", "--conf_dir", default=None)
    p.add_argument("args", nargs="*")
    args = p.parse_intermixed_args(ours)
    positional = list(args.args)
    script = positional.pop(0) if positional and positional[0].endswith(".py") else str(REPO / "train.py")
    if not Path(script).is_file():
        raise UsageError(f"training script not found: {script}")
    configs = [str(Path(args.conf_dir) / c) if args.conf_dir else c for c in positional]
    if not configs:
        raise UsageError("no config file after --; e.g. -- train.py configs/tiny-cpu.yml configs/sim-2x2.yml")
    try:
        cfg = load_config(configs, args.overrides, env={})
        problem = launch_environment_error(cfg, {}) or save_folder_conflict(
            cfg.checkpoint.save, cfg.checkpoint.load, cfg.checkpoint.overwrite_checkpoints)
    except ConfigError as err:
        raise UsageError(str(err)) from None
    if problem:
        raise UsageError(problem)
    return cfg, script, script_args


def training_command(cfg, script: str, script_args: Sequence[str]) -> list[str]:
    """The rank command, with the config written once as JSON where deepy.py writes it."""
    deepy = _deepy()
    from megatron.config import ConfigError
    try:
        path = deepy.write_run_config(cfg)
    except ConfigError as err:
        raise UsageError(str(err)) from None
    return script_command(script, str(path), script_args)


def config_json_in(command: Sequence[str]):
    """The config named by `--neox-config-json PATH` in a command, loaded, else None."""
    if "--neox-config-json" not in command:
        return None
    from megatron.config import ConfigError, load_config_json
    i = list(command).index("--neox-config-json")
    try:
        return load_config_json(command[i + 1])
    except (IndexError, ConfigError) as err:
        raise UsageError(f"--neox-config-json: {err}") from None


# --- main -----------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emulate_cluster.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=None, help="emulated nodes (default: the config's layout; else 2)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: the config's layout; else 1)")
    p.add_argument("--rate", default=DEFAULT_RATE,
                   help="each node's link rate per direction, tc syntax (1gbit, 200mbit), or unlimited (default 1gbit)")
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="three tiers: this many GPU namespaces per node, the node's ranks spread over them "
                        "(each GPU's ranks share its loopback); 0 (default): two tiers")
    p.add_argument("--gpu-rate", default="unlimited",
                   help="three tiers: each GPU's link to its node's switch, per direction, tc syntax (default unlimited)")
    p.add_argument("--command", default=None,
                   help="run this command per rank instead of training (shell-split; {rank} {local_rank} {node} "
                        "{world_size} replaced)")
    p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT)
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="name prefix of namespaces and links (default nxemu)")
    p.add_argument("--report", default=None, metavar="PATH", help="write the run's counters as JSON here")
    p.add_argument("--timeout-s", type=float, default=0, help="stop the ranks after this many seconds (exit 124)")
    p.add_argument("--grace-s", type=float, default=10.0, help="SIGTERM -> SIGKILL grace when stopping ranks")
    p.add_argument("--cleanup", action="store_true", help="remove leftovers of --prefix whose owner is gone, then exit")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = _parser().parse_args(ours)
    problem = environment_problem()
    if problem:
        print(f"emulate_cluster: {problem}", file=sys.stderr)
        return UNAVAILABLE
    if args.cleanup:
        return cleanup(args.prefix, sys.stderr)
    if (args.command is None) == (not rest):
        raise UsageError("give either --command CMD or deepy-style arguments after -- (not both)")
    if args.command is not None:
        command = shlex.split(args.command)
        cfg = config_json_in(command)
    else:
        cfg, script, script_args = training_config(rest)
    if cfg is not None:
        nodes, per_node = check_layout(cfg, args.nodes, args.ranks_per_node, args.gpus_per_node)
        simulated = cfg.topology.simulate is not None
    else:
        nodes, per_node, simulated = args.nodes or 2, args.ranks_per_node or 1, False
    if args.command is None:
        command = training_command(cfg, script, script_args)
    if per_node < 1:
        raise UsageError(f"--ranks-per-node {per_node}: at least 1")
    cluster = new_cluster(args.prefix, nodes, args.rate, args.gpus_per_node, args.gpu_rate)
    specs = rank_specs(cluster, per_node, command, simulated, args.master_port)
    return emulate(cluster, specs, per_node, report=args.report, timeout_s=args.timeout_s, grace_s=args.grace_s)


def emulate(cluster: Cluster, specs: Sequence[RankSpec], per_node: int, *, report: Optional[str] = None,
            timeout_s: float = 0, grace_s: float = 10.0, err: TextIO = sys.stderr) -> int:
    """Build the network, run the ranks, count, tear down whatever happens."""
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    code, before, after, elapsed = None, None, None, 0.0
    try:
        build(cluster)
        gpus = f" on {cluster.gpus} GPU(s) behind {cluster.gpu_rate} links" if cluster.three_tier else ""
        print(f"emulate_cluster: {cluster.run_id}: {cluster.nodes} node(s) x {per_node} rank(s){gpus}, "
              f"{cluster.rate} per node link, master {cluster.master_address()}", file=err, flush=True)
        read = read_tier_counters if cluster.three_tier else read_counters
        before = read(cluster)
        start = time.monotonic()
        code = run_ranks(cluster, specs, timeout_s=timeout_s, grace_s=grace_s, err=err)
        elapsed = time.monotonic() - start
        after = read(cluster)
    except EmulationError as error:
        print(f"emulate_cluster: {error}", file=err)
        code = UNAVAILABLE
    except Interrupted as stop:
        print(f"emulate_cluster: {stop}; stopped the ranks", file=err)
        code = 128 + stop.signum
    except KeyboardInterrupt:
        print("emulate_cluster: interrupted; stopped the ranks", file=err)
        code = 128 + signal.SIGINT
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown short
        left = teardown(cluster)
        if left:
            print(f"emulate_cluster: could not remove {', '.join(left)}; run with --cleanup", file=err)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if before is not None and after is not None:
        result = summarize(cluster, per_node, before, after, elapsed, code)
        for line in describe(result):
            print(f"emulate_cluster: {line}", file=err)
        if report:
            Path(report).write_text(json.dumps(result, indent=2))
    return code


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def summarize(cluster: Cluster, per_node: int, before, after, elapsed: float, code: int) -> dict:
    tiers = None
    if cluster.three_tier:
        tiers = tier_bytes(before, after)
        before, after = before["inter_node"], after["inter_node"]
    nodes = [{"node": i, "namespace": cluster.namespace(i), "interface": cluster.node_if(i),
              "address": cluster.rank_place(i)[2] if not cluster.three_tier else None,
              **{c: after[i][c] - before[i][c] for c in COUNTERS}}
             for i in range(cluster.nodes)]
    out = {"run_id": cluster.run_id, "nodes": cluster.nodes, "ranks_per_node": per_node, "rate": cluster.rate,
           "rate_bits_per_s": parse_rate(cluster.rate), "elapsed_s": round(elapsed, 3), "exit_code": code,
           "per_node": nodes, "inter_node_tx_bytes": sum(n["tx_bytes"] for n in nodes)}
    if tiers is not None:
        out.update(gpus_per_node=cluster.gpus, gpu_rate=cluster.gpu_rate, gpu_rate_bits_per_s=parse_rate(cluster.gpu_rate),
                   tier_tx_bytes=tiers)
    return out


def describe(result: dict) -> list[str]:
    lines = [f"node {n['node']} ({n['address'] or n['interface']}): sent {n['tx_bytes']:,} B in {n['tx_packets']:,} frames, "
             f"received {n['rx_bytes']:,} B" for n in result["per_node"]]
    lines.append(f"inter-node bytes sent, all nodes: {result['inter_node_tx_bytes']:,} B "
                 f"in {result['elapsed_s']:.1f} s (exit {result['exit_code']})")
    if "tier_tx_bytes" in result:
        lines.append("bytes sent per tier: " + ", ".join(f"{t} {b:,} B" for t, b in result["tier_tx_bytes"].items()))
    return lines


def run(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return main(argv)
    except UsageError as err:
        print(f"emulate_cluster: error: {err}", file=sys.stderr)
        return USAGE


if __name__ == "__main__":
    sys.exit(run())
