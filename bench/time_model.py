#!/usr/bin/env python
"""The step-time model against measured step times on the emulated cluster (docs/time_model.md).

    .venv/bin/python bench/time_model.py --markdown                       # probe + every preset (as root)
    .venv/bin/python bench/time_model.py --from-json bench/results/time_model.json --markdown
    .venv/bin/python bench/time_model.py --from-json bench/results/time_model.json --repredict --tier-figures-only --markdown
    # issue 41: the three-tier cluster, our layouts of bench/results/compare_peers_three_tier.json, and the
    # planner's pick among them beside their measured times (as root)
    .venv/bin/python bench/time_model.py --layouts 2x2x2 --rate 640mbit --gpu-rate 640mbit --dtype bf16 \
        --accumulation 4 --presets zeropp_q hsdp zero_topo zero_topo_q topo_148 topo_228 topo_288 topo_448 \
        --out bench/results/time_model_three_tier.json --markdown --planner bench/results/compare_peers_three_tier.json
    # the planner alone, on a saved probe, against a measured file (runs nothing)
    .venv/bin/python bench/time_model.py --planner bench/results/compare_peers_three_tier.json --probe probe.json --markdown

One run: per layout (2x4 = tiers [2, 2, 2] on the two-tier network, 2x2, and 2x2x2: the same tiers on
the three-tier network of compare_peers.THREE_TIER, GPU links at --gpu-rate), tools/probe_links.py on
the emulated cluster at --rate (the link figures, the achieved FLOP/s of the benchmark's model with
all ranks computing, the optimizer and quantizer rates, the overlap efficiency), then every preset at every accumulation,
each one launch of compare_peers' timed loop (megatron/benchmarking/compare_peers.py's ``run_one``:
median of the timed steps, inter-node bytes from the interfaces). The prediction for each row is
``time_model.step_time`` on the row's own config (megatron/benchmarking/peers.py's ``run_config``:
the same model, batch and layout), with the layout's probe as the figures. The error is
predicted / measured - 1.

--planner FILE: the planner (megatron/analytic/planner.py) fed the same probe scores each of our rows
in FILE (a compare_peers or time_model results file; ``-``: this run's rows) as the candidate it is
(``planner.preset_candidate`` of the row's config), picks among them as its search would
(``planner.choose``), and sets its pick and ranking beside the measured step times; the free
search's best over every layout (16-bit and INT8/INT4) is given too.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron.benchmarking import compare_peers, peers
from megatron.benchmarking.emulated_network import environment_problem
from megatron.topology import Topology
from megatron.analytic.model_inputs import comm_spec_from_config, step_work_from_config
from megatron.analytic import planner
from megatron.analytic.hardware import Hardware
from megatron.analytic.time_model import COMPUTE, OPTIMIZER, RECOMPUTE, step_time

BENCH = Path(__file__).resolve().parent
REPO_ROOT = BENCH.parent

DEFAULT_OUT = BENCH / "results" / "time_model.json"
QUANT = compare_peers.QUANT
# Every preset, and the two quantized variants compare_peers times (key -> label, preset file, overrides).
PRESETS = {
    "ddp": ("ddp (stage 0)", "ddp", ()), "zero1": ("zero1", "zero1", ()), "zero2": ("zero2", "zero2", ()),
    "zero3": ("zero3", "zero3", ()), "hsdp": ("hsdp", "hsdp", ()), "zeropp": ("zeropp", "zeropp", ()),
    "zeropp_q": ("zeropp INT8w/INT4g", "zeropp", QUANT), "zero_topo": ("zero_topo", "zero_topo", ()),
    "zero_topo_q": ("zero_topo INT8w/INT4g", "zero_topo", QUANT),
    # issue 28's options on top of zero_topo INT8w/INT4g (not in the default run: --presets names them)
    "zero_topo_q_delta": ("zero_topo INT8w/INT4g + INT4 weight deltas", "zero_topo",
                          QUANT + ("zero_optimization.zero_quantized_weights_delta=true",)),
    "zero_topo_q_rotation": ("zero_topo INT8w/INT4g + Hadamard rotation", "zero_topo",
                             QUANT + ("zero_optimization.zero_quantized_gradients_rotation=hadamard",)),
}
DEFAULT_PRESETS = [key for key in PRESETS if key not in ("zero_topo_q_delta", "zero_topo_q_rotation")]
# issue 41's layouts around zero_topo (2, 4, 8), as compare_peers times them (ours_topo_148...): on 8 ranks
# only, and not in the default run. Their keys make compare_peers' row names (ours_<key>).
AROUND = {key: compare_peers.BY_KEY[f"ours_{key}"] for key in ("topo_148", "topo_228", "topo_288", "topo_448")}
PRESETS.update({key: (c.label.removeprefix("ours "), c.preset, c.overrides) for key, c in AROUND.items()})
PLANNER_GOAL = 0.05  # issue 41: the planner's pick measures within 5% of the fastest
TARGET = 0.25  # the aim: every row within 25%
# Phases shown in the table, by what they are.
GROUPS = {"compute": (COMPUTE, RECOMPUTE, OPTIMIZER), "gathers": ("fwd_gather", "bwd_gather", "recompute_gather"),
          "grad reduce": ("grad_reduce",), "step boundary": ("cross_grad_reduce", "replica_allreduce", "refresh"),
          "control": ("control",)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS, choices=tuple(PRESETS))
    p.add_argument("--layouts", nargs="+", default=list(compare_peers.LAYOUTS), choices=tuple(compare_peers.LAYOUTS))
    p.add_argument("--accumulation", nargs="+", type=int, default=[1, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rate", default="300mbit", help="each node link, per direction (tc syntax)")
    p.add_argument("--gpu-rate", default="640mbit",
                   help="three-tier layouts (2x2x2): each GPU's link in its node, per direction")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the rows' and the probe's dtype (compare_peers --dtype; bf16 = its 16-bit rows)")
    p.add_argument("--overlap", choices=("on", "off"), default="on", help="our overlap_comm (prefetch stays on)")
    p.add_argument("--probe-sizes-kb", type=int, nargs="+", default=[64, 1024, 8192])
    p.add_argument("--probe-repeats", type=int, default=5, help="timed runs per probe point (the median is kept)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--from-json", help="run nothing: the table from an earlier results file")
    p.add_argument("--repredict", action="store_true",
                   help="with --from-json: predict each row again with today's model on the file's probes")
    p.add_argument("--tier-figures-only", action="store_true",
                   help="with --repredict: drop the probes' curves (the model before them: per-tier fits only)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--launch-timeout", type=float, default=600)
    p.add_argument("--planner", metavar="MEASURED",
                   help="the planner's pick and ranking of our rows of this results file ('-': this run's), "
                        "fed the probe of each row's layout")
    p.add_argument("--probe", help="with --planner: this probe file for every layout; nothing is run")
    return p.parse_args(argv)


def probe_command(args, layout: str, out: Path) -> list:
    """tools/emulate_cluster.py running tools/probe_links.py on the layout's network: two tiers, or on a
    three-tier layout the GPU namespaces behind --gpu-rate links (as compare_peers' launch_command)."""
    shape = compare_peers.bench_shape("bench", layout, 1)
    tiers = compare_peers.LAYOUTS[layout]
    model = [shape.num_layers, shape.hidden_size, shape.num_heads, shape.seq_length, shape.vocab, shape.micro_batch]
    inner = [sys.executable, str(REPO_ROOT / "tools" / "probe_links.py"), "--layout", *map(str, tiers),
             "--out", str(out), "--model", *map(str, model), "--sizes-kb", *map(str, args.probe_sizes_kb),
             "--repeats", str(args.probe_repeats), "--dtype", args.dtype]
    three = (["--gpus-per-node", str(compare_peers.THREE_TIER[layout]), "--gpu-rate", args.gpu_rate]
             if layout in compare_peers.THREE_TIER else [])
    return [sys.executable, str(compare_peers.TOOL), "--nodes", str(tiers[0]), "--ranks-per-node",
            str(shape.ranks_per_node), *three, "--rate", args.rate, "--prefix", "nxprb", "--timeout-s",
            str(args.launch_timeout), "--command", shlex.join(inner)]


def network_of(args, layout: str) -> dict:
    """The emulated network a layout's probe and rows ran on (kept with the probe)."""
    three = layout in compare_peers.THREE_TIER
    return {"rate": args.rate, "gpus_per_node": compare_peers.THREE_TIER.get(layout, 0),
            "gpu_rate": args.gpu_rate if three else None}


def launch_args(args) -> argparse.Namespace:
    """What compare_peers' run_one and launch_command read of their own arguments."""
    return argparse.Namespace(steps=args.steps, warmup=args.warmup, model="bench", rate=args.rate,
                              gpu_rate=args.gpu_rate, dtype=args.dtype, breakdown=False,
                              launch_timeout=args.launch_timeout)


def ours(key: str) -> compare_peers.Config:
    label, preset, overrides = PRESETS[key]
    return compare_peers.Config(f"ours_{key}", f"ours {label}", "ours", preset, tuple(overrides),
                                layouts=AROUND[key].layouts if key in AROUND else ())


def row_config(config: compare_peers.Config, shape, overlap: str, dtype: str):
    """The config a row trains with: its preset and keys, then the dtype's and overlap_comm's, as
    compare_peers' rank_main adds them."""
    extra = list(config.dtype_overrides(dtype))
    if overlap in ("on", "off"):
        extra.append(f"zero_optimization.overlap_comm={'true' if overlap == 'on' else 'false'}")
    return peers.run_config(shape, config.preset, [*config.overrides, *extra])


def probe_hardware(cfg, shape, probe: dict, name: str) -> Hardware:
    """The figures of a row: its topology's (all three tiers on 2x2x2), each replaced by the probe's."""
    return Hardware.from_topology(Topology.from_config(cfg, shape.world_size), backend="gloo").with_probe(probe, name)


def probe_layout(args, layout: str, workdir: Path) -> dict:
    """tools/probe_links.py on the emulated layout's network, timing the benchmark's own model."""
    out = workdir / f"probe_{layout}.json"
    cmd = probe_command(args, layout, out)
    start = time.monotonic()
    log = workdir / f"probe_{layout}.log"
    with open(log, "w") as fh:
        code = subprocess.run(cmd, cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT,
                              env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
    if code != 0 or not out.exists():
        raise RuntimeError(f"probe on {layout} failed (exit {code}); log {log}")
    probe = json.loads(out.read_text())
    probe["launch_s"] = round(time.monotonic() - start, 1)
    probe["network"] = network_of(args, layout)
    return probe


def predict(key: str, layout: str, accumulation: int, overlap: str, probe: dict, dtype: str = "fp32") -> dict:
    """The model's step for one row, on the row's config, with the layout's probe."""
    shape = compare_peers.bench_shape("bench", layout, accumulation)
    cfg = row_config(ours(key), shape, overlap, dtype)
    spec = comm_spec_from_config(cfg, shape.vocab)
    hw = probe_hardware(cfg, shape, probe, f"probe {layout}")
    st = step_time(spec, hw, step_work_from_config(cfg, shape.vocab))
    return {"predicted_s": st.total_s, "exposed_s": st.exposed_s, "comm_s": st.comm_s,
            "tflops_per_device": st.tflops_per_device}


def run(args, argv) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="time_model_"))
    results = {"meta": {"command": "bench/time_model.py " + shlex.join(argv), "rate": args.rate,
                        "gpu_rate": args.gpu_rate, "three_tier_layouts": compare_peers.THREE_TIER,
                        "dtype": args.dtype, "steps": args.steps,
                        "warmup": args.warmup, "overlap": args.overlap, "machine": compare_peers.machine(),
                        **compare_peers.versions(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "comm_py": _comm_revision()}, "probes": {}, "rows": []}
    start = time.monotonic()
    launch = launch_args(args)
    for layout in args.layouts:
        probe = probe_layout(args, layout, workdir)
        results["probes"][layout] = probe
        print(f"probe {layout}: {probe['wall_s']} s; device {probe['device']}", flush=True)
        for accumulation in args.accumulation:
            for key in args.presets:
                config = ours(key)
                if config.layouts and layout not in config.layouts:
                    continue  # explicit factors of 8 ranks
                label = PRESETS[key][0]
                row = compare_peers.run_one(launch, config, layout, accumulation, args.overlap)
                row.update(key=key, label=label)
                if row["ok"]:
                    row.update(predict(key, layout, accumulation, args.overlap, probe, args.dtype))
                    row["error"] = row["predicted_s"] / row["median_step_s"] - 1
                results["rows"].append(row)
                print(f"{layout} a{accumulation} {label}: " + (f"measured {row['median_step_s']:.3f} s, predicted "
                      f"{row['predicted_s']:.3f} s ({row['error']:+.0%})" if row["ok"] else f"FAILED {row['error']}"),
                      flush=True)
                write(args.out, results)
    results["meta"]["wall_s"] = round(time.monotonic() - start, 1)
    write(args.out, results)
    return results


def repredict(results: dict, tier_figures_only: bool = False) -> None:
    """Each measured row predicted again on its layout's probe (without its curves if asked)."""
    for row in results["rows"]:
        if not row["ok"]:
            continue
        probe = dict(results["probes"][row["layout"]])
        if tier_figures_only:
            probe.pop("curves", None)
        row.update(predict(row["key"], row["layout"], row["accumulation"], results["meta"]["overlap"], probe,
                           results["meta"].get("dtype", "fp32")))
        row["error"] = row["predicted_s"] / row["median_step_s"] - 1


# -- the planner on the measured layouts ------------------------------------------------------------

def measured_config(row: dict) -> compare_peers.Config | None:
    """The configuration of one of our rows: a time_model row by its preset key, a compare_peers row by
    its configuration key; None for a peer's row."""
    if row.get("peer") != "ours":
        return None
    if row.get("key") in PRESETS:
        return ours(row["key"])
    return compare_peers.BY_KEY.get(row["config"])


def plan_measured(rows: list, probe: dict, name: str) -> dict:
    """The planner on one (layout, accumulation, dtype) group of measured rows: each of our rows scored
    as its candidate on the probe's figures, the pick among them, the free search's best."""
    first = rows[0]
    layout, accumulation, dtype, overlap = first["layout"], first["accumulation"], first.get("dtype", "fp32"), \
        first.get("overlap") or "default"
    shape = compare_peers.bench_shape("bench", layout, accumulation)
    # One set of inputs for every candidate, as tools/plan.py has: the presets differ only in layout and bits.
    base = row_config(compare_peers.BY_KEY["ours_zero_topo"], shape, overlap, dtype)
    checkpointed = bool(base.model.checkpoint_activations)
    inputs = planner.inputs_from_config(base, shape.vocab, probe_hardware(base, shape, probe, name))
    scored = []
    for row in rows:
        cfg = row_config(measured_config(row), shape, overlap, dtype)
        scored.append((row, planner.evaluate(planner.preset_candidate(cfg, checkpointed), inputs)))
    pick = planner.choose([plan_row for _, plan_row in scored])
    by_plan = sorted(scored, key=lambda x: x[1].time.total_s)
    by_measured = sorted(scored, key=lambda x: x[0]["median_step_s"])
    fastest = by_measured[0][0]
    picked = next(row for row, plan_row in scored if plan_row is pick) if pick else None
    free = planner.search(shape.tiers, inputs, quant_names=("none", "int8w-int4g"), checkpointing=(checkpointed,))
    entries = [{"config": row["config"], "label": row["label"], "candidate": planner.describe(plan_row),
                "measured_s": row["median_step_s"], "predicted_s": plan_row.time.total_s, "fits": plan_row.feasible,
                "measured_rank": 1 + by_measured.index((row, plan_row)),
                "planner_rank": 1 + by_plan.index((row, plan_row))} for row, plan_row in scored]
    over = picked["median_step_s"] / fastest["median_step_s"] - 1 if picked else None
    return {"layout": layout, "accumulation": accumulation, "dtype": dtype, "overlap": overlap, "probe": name,
            "network": probe.get("network"), "rows": entries, "pick": picked["config"] if picked else None,
            "fastest": fastest["config"], "pick_over_fastest": over,
            "within_goal": over is not None and over <= PLANNER_GOAL,
            "search_best": planner.describe(free.best) if free.best else None,
            "search_best_s": free.best.time.total_s if free.best else None}


def planner_view(measured: list, probes: dict) -> list:
    """plan_measured per (layout, accumulation, dtype) of our measured rows whose layout has a probe."""
    groups: dict = {}
    for row in measured:
        if row.get("ok") and measured_config(row) is not None:
            groups.setdefault((row["layout"], row["accumulation"], row.get("dtype", "fp32")), []).append(row)
    out = []
    for (layout, _, _), rows in sorted(groups.items()):
        probe = probes.get(layout)
        if probe is None:
            print(f"time_model: no probe of {layout}: its {len(rows)} rows are not planned", file=sys.stderr)
            continue
        network = probe.get("network")  # recorded by this script's runs; a bare probe file does not say
        if layout in compare_peers.THREE_TIER and network is not None and not network["gpus_per_node"]:
            print(f"time_model: the probe of {layout} was taken on a two-tier network", file=sys.stderr)
        out.append(plan_measured(rows, probe, probe.get("source", f"probe {layout}")))
    return out


def planner_markdown(views: list) -> str:
    lines = []
    for v in views:
        lines += [f"Planner on {v['layout']}, accumulation {v['accumulation']}, {v['dtype']} ({v['probe']}):", "",
                  "| row | planner's candidate | measured s | rank | planner s | rank |", "|---|---|---|---|---|---|"]
        for e in sorted(v["rows"], key=lambda e: e["measured_rank"]):
            mark = " *" if e["config"] == v["pick"] else ""
            lines.append(f"| {e['label']}{mark} | {e['candidate']} | {e['measured_s']:.3f} | {e['measured_rank']} | "
                         f"{e['predicted_s']:.3f} | {e['planner_rank']} |")
        if v["pick"]:
            verdict = "within" if v["within_goal"] else "NOT within"
            lines += ["", f"The planner picks * {v['pick']}: {v['pick_over_fastest']:+.1%} over the fastest measured "
                      f"({v['fastest']}), {verdict} {PLANNER_GOAL:.0%}. Its free search's best: "
                      f"{v['search_best']} at {v['search_best_s']:.3f} s."]
        else:
            lines += ["", "No measured layout fits the planner's memory budget."]
        lines.append("")
    return "\n".join(lines)


def _comm_revision() -> str:
    """The commit that last changed comm.py, and whether the working tree differs (the reduce-scatter)."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    last = git("log", "-1", "--format=%h %s", "--", "megatron/engine/comm.py")
    dirty = bool(git("status", "--porcelain", "megatron/engine/comm.py"))
    return last + (" (+ uncommitted changes)" if dirty else "")


def write(path, results) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1) + "\n")


def probe_markdown(results: dict) -> str:
    """The figures each layout's probe measured (what the predictions used): per-shape curves (read
    first), per-tier fits, the device."""
    lines = ["| layout | algorithm | shape | group (k) | MB/s at the step bytes |", "|---|---|---|---|---|"]
    for layout, probe in results.get("probes", {}).items():
        for algorithm, per_shape in sorted(probe.get("curves", {}).items()):
            for shape, curve in sorted(per_shape.items()):
                points = ", ".join(f"{rate * 1e3:,.1f} at {step / 1024:,.0f} KiB" for step, rate in curve["points"])
                lines.append(f"| {layout} | {algorithm} | {shape} | {curve['group']} ({curve['k']}) | {points} |")
    lines += ["", "| layout | algorithm | tier | bandwidth MB/s | latency us |", "|---|---|---|---|---|"]
    for layout, probe in results.get("probes", {}).items():
        for algorithm, per_tier in sorted(probe["algorithms"].items()):
            for tier, fig in per_tier.items():
                lines.append(f"| {layout} | {algorithm} | {tier} | {fig['bandwidth_gbs'] * 1e3:,.1f} | "
                             f"{fig['latency_us']:,.0f} |")
    lines += ["", "| layout | achieved GFLOP/s per rank | AdamW M elements/s | quantize M elements/s | copy MB/s | "
              "overlap by tier |", "|---|---|---|---|---|---|"]
    for layout, probe in results.get("probes", {}).items():
        d = probe["device"]
        overlap = ", ".join(f"{t} {e:.2f}" for t, e in d.get("overlap_by_tier", {}).items())
        copy = f"{d['copy_bytes_per_s'] / 1e6:,.0f}" if "copy_bytes_per_s" in d else "-"
        lines.append(f"| {layout} | {d['achieved_flops'] / 1e9:.1f} | {d['optimizer_elements_per_s'] / 1e6:.1f} | "
                     f"{d['quantize_elements_per_s'] / 1e6:.1f} | {copy} | {overlap} |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    gpu = f" (GPU links {results['meta']['gpu_rate']} on {', '.join(results['meta']['three_tier_layouts'])})" \
        if results["meta"].get("three_tier_layouts") else ""
    lines = [f"Rate {results['meta']['rate']}{gpu}; {results['meta'].get('dtype', 'fp32')}; "
             f"{results['meta']['steps']} timed steps after "
             f"{results['meta']['warmup']} warmup; overlap_comm {results['meta']['overlap']}; comm.py at "
             f"{results['meta'].get('comm_py', '?').split(' ')[0]}.", ""]
    header = ["layout", "preset", "A", "measured s", "predicted s", "error"] + [f"{g} s" for g in GROUPS]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = results["rows"]
    for row in rows:
        if not row["ok"]:
            lines.append(f"| {row['layout']} | {row['label']} | {row['accumulation']} | failed: {row['error']} |")
            continue
        parts = [f"{sum(row['exposed_s'].get(p, 0.0) for p in phases):.3f}" for phases in GROUPS.values()]
        flag = "" if abs(row["error"]) <= TARGET else " **"
        lines.append(f"| {row['layout']} | {row['label']} | {row['accumulation']} | {row['median_step_s']:.3f} | "
                     f"{row['predicted_s']:.3f} | {row['error']:+.0%}{flag} | " + " | ".join(parts) + " |")
    done = [r for r in rows if r["ok"]]
    if done:
        within = sum(abs(r["error"]) <= TARGET for r in done)
        mean_abs = sum(abs(r["error"]) for r in done) / len(done)
        lines += ["", f"{within} of {len(done)} rows within {TARGET:.0%}; mean |error| {mean_abs:.0%}; "
                  f"** marks a row outside {TARGET:.0%}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.probe and not args.planner:
        print("time_model: --probe goes with --planner", file=sys.stderr)
        return 2
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        if args.repredict:
            repredict(results, args.tier_figures_only)
    elif args.probe:  # the planner alone: nothing is run
        results = {"meta": {}, "probes": {}, "rows": []}
    else:
        problem = environment_problem()
        if problem:
            print(f"time_model: cannot emulate a cluster here: {problem}", file=sys.stderr)
            return compare_peers.UNAVAILABLE
        results = run(args, argv)
    if args.planner:
        measured = results["rows"] if args.planner == "-" else json.loads(Path(args.planner).read_text())["rows"]
        probes = results.get("probes", {})
        if args.probe:
            saved = json.loads(Path(args.probe).read_text())
            saved.setdefault("source", f"probe {args.probe}")
            probes = {layout: saved for layout, tiers in compare_peers.LAYOUTS.items() if list(tiers) == saved["layout"]}
        results["planner"] = planner_view(measured, probes)
        if not (args.from_json or args.probe):
            write(args.out, results)
    if args.markdown:
        if results["rows"]:
            print(markdown(results))
            print()
            print(probe_markdown(results))
        if args.planner:
            print()
            print(planner_markdown(results["planner"]))
    return 0 if all(r["ok"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
