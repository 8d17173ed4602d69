"""Speed side by side on an emulated cluster: our presets and layouts, DeepSpeed ZeRO-3 / hpZ / MiCS and
FSDP2 (fully_shard, HSDP), each at its default and as an expert runs it for gradient accumulation, train
the same GPT-NeoX on the same data; each configuration is timed, its bytes counted per tier and its
memory read (docs/benchmarks.md). The command line is bench/compare_peers.py.

Layouts: 2x2x2 is three tiers (tools/emulate_cluster.py --gpus-per-node 2: each GPU's pair of ranks in a
namespace of its own behind a --gpu-rate link, nodes behind --rate links); 2x4 and 2x2 are the two-tier
cluster of the earlier tables (every rank of a node on one loopback).

    .venv/bin/python bench/compare_peers.py                  # the whole matrix (as root)
    .venv/bin/python bench/compare_peers.py --only ds_zero3 ours_zero_topo --layouts 2x2 \\
        --accumulation 4 --steps 3 --warmup 1 --out /tmp/c.json --png /tmp/c.png --markdown
    .venv/bin/python bench/compare_peers.py --from-json bench/results/compare_peers.json --markdown

Every (configuration, layout, accumulation, overlap) is one launch of tools/emulate_cluster.py: two
nodes as network namespaces whose links are rate-limited (--rate), R ranks per node, rendezvous on
node 0's address (env://). Each rank runs bench/compare_peers.py --rank-main: it builds the peer
with megatron/benchmarking/peers.py (the same config builder, batches and trainers as the parity
runs), trains --warmup steps, then --steps timed steps. Before each step's clock starts every peer passes a barrier; the
step's time is rank 0's wall time of the trainer's step (all micro-batches and the optimizer). The
global mean loss is all-reduced after the clock stops.

Inter-node bytes: each node's first rank reads its interface counters (/sys/class/net/
$GLOO_SOCKET_IFNAME/statistics, inside its namespace) around the timed steps, so set-up, warmup and
teardown are outside the window. The window also holds one barrier and one loss all-reduce per
step; their bytes are measured by the same loop without training (the "bookkeeping" window) and
subtracted. Our engine's ledger (what each rank says it sent to the other node) is read around the
same window and summed over ranks. Peak memory is ru_maxrss, the largest over ranks.

Exit codes: 0 when every configuration ran, 1 when some failed (each failure is a row of the table),
2 for bad arguments, 69 when this machine cannot emulate a cluster (not root, or no iproute2).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from megatron.benchmarking import CHECKOUT, peers
from megatron.benchmarking import compare_report as report
from megatron.model.sizes import parameter_count

TOOL = CHECKOUT / "tools" / "emulate_cluster.py"
RANK_SCRIPT = CHECKOUT / "bench" / "compare_peers.py"  # the command line; with --rank-main it is one rank
UNAVAILABLE = 69
DEFAULT_OUT = CHECKOUT / "bench" / "results" / "compare_peers_three_tier.json"  # compare_peers.json: the two-tier history
DEFAULT_PNG = CHECKOUT / "bench" / "results" / "compare_peers_three_tier.png"
# Layouts: the name, the topology tiers our engine sees (slowest first). 2 x 4 is a Frontier-like
# node of 2 GPUs x 2 GCDs, so zero_topo's weight tier is the pair: (2, 4, 8), as (2, 8, N) there.
# 2x2x2 is the same ranks on the three-tier network (THREE_TIER: GPUs per node).
LAYOUTS = {"2x2x2": (2, 2, 2), "2x4": (2, 2, 2), "2x2": (2, 2)}
THREE_TIER = {"2x2x2": 2}
# DeepSpeed MiCS was removed in 0.19.7: its rows run DeepSpeed 0.19.6 from this folder, put first on
# PYTHONPATH (`pip install --no-deps --target DIR deepspeed==0.19.6`), with an extension cache of its own.
DEEPSPEED_MICS_VERSION = "0.19.6"
DEEPSPEED_MICS_DIR = Path(os.environ.get("NEOX_DEEPSPEED_MICS_DIR",
                                         Path.home() / ".cache" / "neox_topo" / f"deepspeed-{DEEPSPEED_MICS_VERSION}"))
# The benchmark's model: 4.2M parameters (16.8 MB in fp32). One DeepSpeed ZeRO-3 micro-step sends
# ~90 MB across the node links; at 300 Mbit/s that takes longer than the compute of 8 ranks on 2 cores
# (measured at accumulation 4 on 2 x 4: 3.2 s per step with unlimited links, 7.7 s at 300 Mbit/s;
# docs/benchmarks.md "Choosing the rate").
# The global micro-batch is 8 sequences on both layouts (micro-batch 8 / ranks), so every layout and
# every peer trains on exactly the same tokens.
MODELS = {"bench": dict(num_layers=4, hidden_size=256, num_heads=4, seq_length=128, vocab=2048),
          "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab=384)}
GLOBAL_MICRO_BATCH = 8


@dataclass(frozen=True)
class Config:
    """One peer configuration (a row of the table, per layout x accumulation x overlap)."""
    key: str
    label: str
    peer: str
    preset: str                      # the configs/<preset>.yml our config builder reads
    overrides: tuple = ()            # `--set`-style, for ours
    quantized: bool = False          # DeepSpeed qwZ + qgZ
    hpz: bool = False                # DeepSpeed hpZ over the node
    mics: str = ""                   # DeepSpeed MiCS, shard group = the node: "hierarchical" or "flat" gather
    reshard: str = "default"         # FSDP2 reshard_after_forward: default (True), keep (False), node (int)
    defer: str = "none"              # FSDP2, before the last micro-batch: none, all_reduce, gradient
    layouts: tuple = ()              # the layouts it applies to (empty: all)
    best: bool = False               # a peer as an expert configures it for accumulation on a slow link

    @property
    def has_overlap(self) -> bool:   # overlap_comm is our engine's key; the peers run as they do
        return self.peer == "ours"

    def trainer_options(self, shape: peers.Shape, dtype: str = "fp32") -> dict:
        half = {"bf16": True} if dtype == "bf16" else {}
        if self.peer == "deepspeed":
            return {"hpz": shape.ranks_per_node if self.hpz else 1, "quantized_weights": self.quantized,
                    "quantized_gradients": self.quantized, "mics": shape.ranks_per_node if self.mics else 0,
                    "mics_hierarchical": self.mics != "flat", **half}
        if self.peer == "fsdp2":
            reshard = {"default": True, "keep": False, "node": shape.ranks_per_node}[self.reshard]
            return {"reshard_after_forward": reshard, "defer": self.defer, **half}
        return {}

    def dtype_overrides(self, dtype: str) -> list[str]:
        """Ours in bf16: bf16 compute and every unquantized hop in bf16, the cross-node ones included
        (fp32_allreduce false: 16-bit on the wire, as the peers' bf16 modes send)."""
        return ["bf16.enabled=true", "fp32_allreduce=false"] if dtype == "bf16" and self.peer == "ours" else []


QUANT = ("zero_optimization.zero_quantized_weights=true", "zero_optimization.zero_quantized_gradients=true")
EIGHT = ("2x2x2", "2x4")  # explicit factors of 8 ranks


def factors(w: int, g: int, os_: int) -> tuple:
    return (f"zero_optimization.shard_factors=[{w}, {g}, {os_}]",)


CONFIGS = [  # DeepSpeed ZeRO-3 first: the history's ratios are to it; issue 41's to the best peer row
    Config("ds_zero3", "DeepSpeed ZeRO-3", "deepspeed", "zero3"),
    Config("ds_hpz", "DeepSpeed ZeRO-3 + hpZ", "deepspeed", "zero3", hpz=True, best=True),
    Config("ds_mics", "DeepSpeed MiCS (shard = node, hierarchical gather)", "deepspeed", "zero3", mics="hierarchical",
           best=True),
    Config("ds_mics_flat", "DeepSpeed MiCS (shard = node, flat gather)", "deepspeed", "zero3", mics="flat", best=True),
    Config("ds_zeropp", "DeepSpeed ZeRO++ (qwZ+qgZ+hpZ)", "deepspeed", "zero3", hpz=True, quantized=True),
    Config("fsdp2", "FSDP2 fully_shard", "fsdp2", "zero3"),
    Config("fsdp2_node", "FSDP2 fully_shard, reshard to node, sync last micro-batch", "fsdp2", "zero3",
           reshard="node", defer="gradient", best=True),
    Config("fsdp2_hsdp", "FSDP2 HSDP", "fsdp2", "hsdp"),
    Config("fsdp2_hsdp_best", "FSDP2 HSDP, all-reduce last micro-batch, no reshard", "fsdp2", "hsdp",
           reshard="keep", defer="all_reduce", best=True),
    Config("fsdp2_hsdp_nosync", "FSDP2 HSDP, sync last micro-batch, no reshard", "fsdp2", "hsdp",
           reshard="keep", defer="gradient", best=True),
    Config("ours_zero3", "ours zero3", "ours", "zero3"),
    Config("ours_zeropp", "ours zeropp INT8w/INT4g", "ours", "zeropp", QUANT),
    Config("ours_hsdp", "ours hsdp", "ours", "hsdp"),
    Config("ours_zero_topo", "ours zero_topo", "ours", "zero_topo"),
    Config("ours_zero_topo_q", "ours zero_topo INT8w/INT4g", "ours", "zero_topo", QUANT),
    Config("ours_topo_148", "ours (1, 4, 8)", "ours", "zero_topo", factors(1, 4, 8), layouts=EIGHT),
    Config("ours_topo_228", "ours (2, 2, 8)", "ours", "zero_topo", factors(2, 2, 8), layouts=EIGHT),
    Config("ours_topo_288", "ours (2, 8, 8)", "ours", "zero_topo", factors(2, 8, 8), layouts=EIGHT),
    Config("ours_topo_448", "ours (4, 4, 8): w = node", "ours", "zero_topo", factors(4, 4, 8), layouts=EIGHT),
]
BY_KEY = {c.key: c for c in CONFIGS}
# DeepSpeed 0.19.8's quantizer op has no CPU build: with qwZ, deepspeed.initialize fails in ZeRO's
# Init (CUDAQuantizer -> QuantizerBuilder().load(): "This op had not been implemented on CPU
# backend."), with qgZ alone the first gradient reduction does. It runs only when asked for (--only).
# MiCS (DeepSpeed 0.19.6) gathers weights with all_gather_coalesced under torch's coalescing manager,
# which gloo lacks: "RuntimeError: Backend gloo does not implement startCoalescing" (mics.py:286 with the
# hierarchical gather, mics.py:240 with the flat one: both measured 2026-12-07). ds_mics stays in the matrix, a row
# with that error; ds_mics_flat runs only when asked for.
NOT_BY_DEFAULT = ("ds_zeropp", "ds_mics_flat")


class BenchError(Exception):
    """Bad arguments or an unreadable results file: one line, exit 2."""


# --------------------------------------------------------------------------------- one rank (child)

def bench_shape(model: str, layout: str, accumulation: int) -> peers.Shape:
    tiers = LAYOUTS[layout]
    world = peers.Shape(tiers=tiers).world_size
    return peers.Shape(tiers=tiers, micro_batch=GLOBAL_MICRO_BATCH // world, accumulation=accumulation,
                       **MODELS[model])


def read_interface() -> dict | None:
    """This node's uplink counters (the first rank of each node reads them), else None. On three tiers
    the uplink sits in the node's namespace, not the rank's: read there (`ip netns exec`, as root)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname or os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    names = ("tx_bytes", "rx_bytes")
    node_ns = os.environ.get("NEOX_EMU_NODE_NETNS")
    if node_ns:
        files = [f"/sys/class/net/{os.environ['NEOX_EMU_NODE_IF']}/statistics/{n}" for n in names]
        out = subprocess.run(["ip", "netns", "exec", node_ns, "cat", *files], capture_output=True, text=True,
                             check=True).stdout.split()
        return dict(zip(names, map(int, out)))
    stats = Path("/sys/class/net") / ifname / "statistics"
    return {name: int((stats / name).read_text()) for name in names}


def read_gpu_counters() -> dict | None:
    """Three tiers: what this GPU sent on its link and on its loopback (its pair's traffic), read by the
    GPU's first rank; else None."""
    per_gpu = os.environ.get("NEOX_EMU_RANKS_PER_GPU")
    if not per_gpu or int(os.environ.get("LOCAL_RANK", "0")) % int(per_gpu):
        return None
    sysfs = Path("/sys/class/net")
    return {"gpu_link_tx": int((sysfs / os.environ["GLOO_SOCKET_IFNAME"] / "statistics" / "tx_bytes").read_text()),
            "intra_gpu_tx": int((sysfs / "lo" / "statistics" / "tx_bytes").read_text())}


def read_counters() -> dict:
    return {"node": read_interface(), "gpu": read_gpu_counters()}


def counters_delta(before: dict, after: dict) -> dict:
    return {k: counter_delta(before[k], after[k]) for k in before}


def counter_delta(before: dict | None, after: dict | None) -> dict | None:
    return None if before is None else {k: after[k] - before[k] for k in before}


def ledger_inter_node(trainer) -> dict | None:
    """Our ledger's inter-node bytes of this rank, by phase (None for the peers)."""
    ledger = getattr(trainer, "ledger", None)
    if ledger is None:
        return None
    return {phase: nbytes for (phase, tier), nbytes in ledger.snapshot().items() if tier == "inter_node"}


def ledger_tiers(trainer) -> dict | None:
    """Our ledger's bytes of this rank, by tier (None for the peers)."""
    ledger = getattr(trainer, "ledger", None)
    if ledger is None:
        return None
    out: dict = {}
    for (_, tier), nbytes in ledger.snapshot().items():
        out[tier] = out.get(tier, 0) + nbytes
    return out


def timed_steps(trainer, first: int, count: int, barrier) -> tuple[list[float], list[float], list[float]]:
    """``count`` optimizer steps from step ``first``: rank-local wall times (a barrier before each
    clock starts), global mean losses (all-reduced after the clock stops) and grad norms."""
    times, losses, norms = [], [], []
    for step in range(first, first + count):
        barrier()
        start = time.perf_counter()
        local, norm = trainer.step(step)
        times.append(time.perf_counter() - start)
        losses.append(peers.global_mean(local))
        norms.append(norm)
    return times, losses, norms


def bookkeeping_window(count: int, barrier) -> dict | None:
    """The counters of the timed loop's own collectives (a barrier and a loss all-reduce per step,
    one closing barrier), without any training: subtracted from the timed window."""
    barrier()
    before = read_counters()
    for _ in range(count):
        barrier()
        peers.global_mean([0.0])
    barrier()
    return counters_delta(before, read_counters())


def rank_main(args: argparse.Namespace) -> int:
    """Join, build the peer, warm up, time the steps, write this rank's result, leave."""
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    out = Path(args.workdir) / f"rank{rank}.json"
    torch.set_num_threads(1)
    fields = json.loads(args.config)
    config = Config(**{**fields, "overrides": tuple(fields["overrides"]), "layouts": tuple(fields.get("layouts", ()))})
    shape = bench_shape(args.model, args.layouts[0], args.accumulation[0])
    overrides = list(config.overrides) + config.dtype_overrides(args.dtype)
    if config.has_overlap and args.overlap in ("on", "off"):
        overrides.append(f"zero_optimization.overlap_comm={'true' if args.overlap == 'on' else 'false'}")
    code = 0
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=shape.world_size,
                                timeout=timedelta(seconds=peers.PG_TIMEOUT_S))
        barrier = dist.barrier
        cfg = peers.run_config(shape, config.preset, overrides)
        trainer = peers.make_trainer(config.peer, cfg, shape, rank, **config.trainer_options(shape, args.dtype))
        warm_times, warm_losses, _ = timed_steps(trainer, 0, args.warmup, barrier)
        bookkeeping = bookkeeping_window(args.steps, barrier)
        barrier()
        counters, ledger, tiers = read_counters(), ledger_inter_node(trainer), ledger_tiers(trainer)
        times, losses, norms = timed_steps(trainer, args.warmup, args.steps, barrier)
        barrier()
        window = counters_delta(counters, read_counters())
        ledger_after, tiers_after = ledger_inter_node(trainer), ledger_tiers(trainer)
        ledger_window = None if ledger is None else {p: ledger_after[p] - ledger[p] for p in ledger}
        tier_window = None if tiers is None else {t: tiers_after[t] - tiers.get(t, 0) for t in tiers_after}
        breakdown = None
        if args.breakdown:  # one more step, after every window was read: where its time went
            from megatron.logging.step_profile import profile_step
            barrier()
            breakdown = profile_step(lambda: trainer.step(args.warmup + args.steps), torch.device("cpu")).as_dict()
            breakdown.pop("top")
        payload = {"ok": True, "rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
                   "step_times_s": warm_times + times, "losses": warm_losses + losses, "grad_norms": norms,
                   "interface_window": window["node"], "interface_bookkeeping": bookkeeping["node"],
                   "gpu_window": window["gpu"], "gpu_bookkeeping": bookkeeping["gpu"],
                   "ledger_inter_node_window": ledger_window, "ledger_tier_window": tier_window, "info": trainer.info(), "breakdown": breakdown,
                   "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
        trainer.close()
    except BaseException as err:  # noqa: BLE001 - what a rank raises goes into the table
        payload = {"ok": False, "rank": rank, "error": f"{type(err).__name__}: {err}",
                   "traceback": traceback.format_exc()}
        code = 1  # a failed rank exits at once, so the tool stops its peers instead of a 300 s hang
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, out)
    try:
        if code == 0 and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # gloo's C++ teardown can abort after the result is safe (seen on 2-core CPU runs)


# ----------------------------------------------------------------------------------------- launcher

def launch_command(args: argparse.Namespace, config: Config, layout: str, accumulation: int, overlap: str,
                   workdir: Path) -> list[str]:
    tiers = LAYOUTS[layout]
    per_node = peers.Shape(tiers=tiers).ranks_per_node
    inner = [sys.executable, str(RANK_SCRIPT), "--rank-main", "--config", json.dumps(asdict(config)),
             "--layouts", layout, "--accumulation", str(accumulation),
             *(["--overlap", overlap] if overlap != "default" else []),
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model, "--dtype", args.dtype,
             *(["--breakdown"] if args.breakdown else []), "--workdir", str(workdir)]
    three = (["--gpus-per-node", str(THREE_TIER[layout]), "--gpu-rate", args.gpu_rate]
             if layout in THREE_TIER else [])
    return [sys.executable, str(TOOL), "--nodes", str(tiers[0]), "--ranks-per-node", str(per_node), *three,
            "--rate", args.rate, "--report", str(workdir / "report.json"), "--timeout-s", str(args.launch_timeout),
            "--prefix", "nxcmp", "--command", shlex.join(inner)]


def run_one(args: argparse.Namespace, config: Config, layout: str, accumulation: int, overlap: str) -> dict:
    """One emulated-cluster launch; returns its row (``ok`` false with a one-line error on failure)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"cmp_{config.key}_{layout}_a{accumulation}_"))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(peers.DEFAULT_EXTENSIONS_DIR))
    row = {"config": config.key, "label": config.label, "peer": config.peer, "layout": layout,
           "tiers": list(LAYOUTS[layout]), "three_tier": layout in THREE_TIER, "accumulation": accumulation,
           "overlap": overlap if config.has_overlap else None, "best": config.best, "steps": args.steps,
           "warmup": args.warmup}
    if config.mics:
        if not (DEEPSPEED_MICS_DIR / "deepspeed").is_dir():
            return {**row, "ok": False, "launch_s": 0.0, "error": (
                f"MiCS was removed from DeepSpeed in 0.19.7 and needs {DEEPSPEED_MICS_VERSION}, not found in "
                f"{DEEPSPEED_MICS_DIR} (pip install --no-deps --target {DEEPSPEED_MICS_DIR} "
                f"deepspeed=={DEEPSPEED_MICS_VERSION})")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DEEPSPEED_MICS_DIR), env.get("PYTHONPATH")]))
        env["TORCH_EXTENSIONS_DIR"] = env["TORCH_EXTENSIONS_DIR"] + f"_ds{DEEPSPEED_MICS_VERSION}"
    start = time.monotonic()
    with open(workdir / "launch.log", "w") as log:
        code = subprocess.run(launch_command(args, config, layout, accumulation, overlap, workdir), env=env,
                              cwd=CHECKOUT, stdout=log, stderr=subprocess.STDOUT).returncode
    row["launch_s"] = round(time.monotonic() - start, 1)
    ranks = [json.loads(p.read_text()) for p in sorted(workdir.glob("rank*.json"))]
    tool = json.loads((workdir / "report.json").read_text()) if (workdir / "report.json").exists() else None
    shape = bench_shape(args.model, layout, accumulation)
    row.update(report.summarize_ranks(ranks, tool, code, args.steps, args.warmup, shape.world_size))
    row["dtype"] = args.dtype
    row["expected_inter_node_bytes_per_step"] = expected_inter_node_bytes(config, shape, parameter_count(
        peers.run_config(shape, config.preset).model, shape.vocab), 2 if args.dtype == "bf16" else 4)
    if not row["ok"]:
        row["log"] = str(workdir / "launch.log")  # kept: the full tracebacks are in the rank files
        if not ranks:  # the network or the ranks' start failed: the tool's last line says why
            tail = (workdir / "launch.log").read_text().strip().splitlines()
            said = [line for line in tail if "error" in line.lower()] or tail
            row["error"] = report.one_line(said[-1] if said else row["error"])
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return row


def plan(args: argparse.Namespace) -> list[tuple[Config, str, int, str]]:
    """Every launch, DeepSpeed ZeRO-3 first in each (layout, accumulation) group."""
    keys = args.only or [c.key for c in CONFIGS if c.key not in NOT_BY_DEFAULT]
    overlaps = ["off", "on"] if args.overlap == "both" else [args.overlap]
    runs = []
    for layout in args.layouts:
        for accumulation in args.accumulation:
            for config in CONFIGS:
                if config.key in keys and (not config.layouts or layout in config.layouts):
                    for overlap in (overlaps if config.has_overlap else ["default"]):
                        runs.append((config, layout, accumulation, overlap))
    return runs


def expected_inter_node_bytes(config: Config, shape: peers.Shape, params: int, elem: int = 4) -> float | None:
    """What a peer should send across nodes per optimizer step (all nodes, payload, gradients of ``elem``
    bytes), where its algorithm is plain: the HSDP-like rows' cross-replica all-reduce of the gradients.
    Each of the R shard positions all-reduces its 4P/R bytes (fp32) among the node count k of replicas:
    2(k-1)/k x 4P/R per rank, all of it cross-node, k ranks per position: 8P(k-1) in all (half in bf16),
    once per micro-batch by default,
    once per step when deferred (FSDP2 all_reduce or gradient, MiCS at the boundary). None where gloo's
    own algorithms decide (its reduce-scatter is an all-reduce; docs/emulated_cluster.md) or the row is ours
    (the ledger says it)."""
    k = shape.nodes
    replica_all_reduce = 2 * elem * params * (k - 1)
    if config.peer == "fsdp2" and config.preset == "hsdp":
        return replica_all_reduce * (1 if config.defer != "none" else shape.accumulation)
    if config.mics:
        return replica_all_reduce
    return None


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version()}


def versions() -> dict:
    import torch
    out = {"torch": torch.__version__}
    try:
        from importlib.metadata import version
        out["deepspeed"] = version("deepspeed")
    except Exception:  # noqa: BLE001 - absent is fine: its rows fail with the import error
        out["deepspeed"] = None
    out["deepspeed_mics"] = DEEPSPEED_MICS_VERSION if (DEEPSPEED_MICS_DIR / "deepspeed").is_dir() else None
    return out


def run_matrix(args: argparse.Namespace, argv: list[str]) -> dict:
    runs = plan(args)
    shape = bench_shape(args.model, "2x2", 1)
    results = {"meta": {"command": "bench/compare_peers.py " + shlex.join(argv), "rate": args.rate,
                        "gpu_rate": args.gpu_rate, "three_tier_layouts": THREE_TIER,
                        "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup, "model": {**MODELS[args.model],
                        "parameters": parameter_count(peers.run_config(shape, "zero3").model, shape.vocab)},
                        "global_micro_batch": GLOBAL_MICRO_BATCH, "machine": machine(), **versions(),
                        "overlap_key": overlap_key_present(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "load_average_start": list(os.getloadavg())},
               "rows": []}
    start = time.monotonic()
    for i, (config, layout, accumulation, overlap) in enumerate(runs, 1):
        row = run_one(args, config, layout, accumulation, overlap)
        results["rows"].append(row)
        report.add_ratios(results["rows"])
        print(f"[{i}/{len(runs)}] {report.progress_line(row)}", flush=True)
        write_json(args.out, results)  # a long run interrupted still leaves what it measured
    results["meta"]["wall_s"] = round(time.monotonic() - start, 1)
    results["meta"]["load_average_end"] = list(os.getloadavg())  # was the machine quiet? (1, 5, 15 min)
    return results


def overlap_key_present() -> bool:
    schema = CHECKOUT / "megatron" / "config" / "schema.py"
    return "zero_optimization.overlap_comm" in schema.read_text()


def write_json(path: str, results: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1) + "\n")


# ------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="compare_peers.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="CONFIG",
                   help=f"configurations to run (default: all but {', '.join(NOT_BY_DEFAULT)}, whose "
                        "quantizer op DeepSpeed does not build for CPU): " + ", ".join(c.key for c in CONFIGS))
    p.add_argument("--layouts", nargs="+", default=["2x2x2"], metavar="NxR",
                   help="layouts: 2x2x2 (8 ranks on three tiers; the default), 2x4 (the same 8 ranks, two tiers), "
                        "2x2 (4 ranks, two tiers)")
    p.add_argument("--accumulation", nargs="+", type=int, default=[1, 4],
                   help="gradient accumulation counts (default 1 4)")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per configuration (default 4)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default 1)")
    p.add_argument("--rate", default="640mbit",
                   help="each node link's rate per direction, tc syntax (default 640mbit; the two-tier history ran 300mbit)")
    p.add_argument("--gpu-rate", default="640mbit",
                   help="three-tier layouts (2x2x2): each GPU's link in its node, per direction (default 640mbit)")
    p.add_argument("--overlap", choices=("on", "off", "both"), default="both",
                   help="our zero_optimization.overlap_comm: on, off, or both (two rows per preset; default)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="fp32 (default; the history's) or bf16: every side in its bf16 mode, 16-bit on the wire "
                        "(DeepSpeed bf16, FSDP2 MixedPrecisionPolicy bf16/bf16, ours bf16 with fp32_allreduce false)")
    p.add_argument("--model", choices=tuple(MODELS), default="bench",
                   help="bench: 4 layers, hidden 256, seq 128, vocab 2048 (default); tiny: the parity model")
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help=f"results JSON (default {DEFAULT_OUT.relative_to(CHECKOUT)})")
    p.add_argument("--png", default=str(DEFAULT_PNG), help="bar chart of step time / DS ZeRO-3's ('' for none)")
    p.add_argument("--markdown", action="store_true", help="print the markdown table (and the goals) at the end")
    p.add_argument("--breakdown", action="store_true",
                   help="profile one more step on every rank after the timed ones: its compute and its exposed "
                        "communication (the time only collectives ran; megatron/logging/step_profile.py)")
    p.add_argument("--from-json", metavar="PATH", help="run nothing: table and chart from an earlier results JSON")
    p.add_argument("--launch-timeout", type=float, default=600, help="seconds one launch may take (default 600)")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)  # a rank's Config as JSON (any configuration, e.g. bench/time_model.py's)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        raise BenchError(f"--steps {args.steps}: must be at least 1")
    if args.warmup < 0:
        raise BenchError(f"--warmup {args.warmup}: must be non-negative")
    if args.launch_timeout <= 0:
        raise BenchError(f"--launch-timeout {args.launch_timeout:g}: must be positive")
    bad = [c for c in args.only or [] if c not in BY_KEY]
    if bad:
        raise BenchError(f"--only {' '.join(bad)}: unknown configuration; choose from {', '.join(BY_KEY)}")
    bad = [layout for layout in args.layouts if layout not in LAYOUTS]
    if bad:
        raise BenchError(f"--layouts {' '.join(bad)}: unknown layout; choose from {', '.join(LAYOUTS)}")
    if any(a < 1 for a in args.accumulation):
        raise BenchError(f"--accumulation {args.accumulation}: every count must be at least 1")
    return args


