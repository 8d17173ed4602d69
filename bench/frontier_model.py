#!/usr/bin/env python
"""The paper's runs predicted by the step-time model: 10B and 20B on 8-48 Frontier nodes, under each
figure set, beside the paper's ratios (docs/frontier-model.md).

    .venv/bin/python bench/frontier_model.py --write docs/frontier-model.md     # every table, the charts
    .venv/bin/python bench/frontier_model.py --figures frontier-measured --models 20B --micro-batches 1

Per figure set (``nominal``: the topology's per-tier links; ``frontier-measured`` and
``frontier-eager``: RCCL as the PCCL authors timed it on Frontier with libfabric's rendezvous
settings and with its default eager protocol, megatron/analytic/figure_sets.py), model, micro-batch,
accumulation and node count, every configuration's predicted optimizer step (the shipped configs:
configs/<model>.yml + the preset's yml, bf16, activation checkpointing on, topology.preset
frontier). ZeRO-3 and ZeRO++ are DeepSpeed's, as DeepSpeed issues their collectives
(megatron/analytic/deepspeed_model.py); ours run as our engine does (comm_model). The paper's four
numbers set beside ours: ZeRO++ / ZeRO-3 (1.405), ZeRO-topo / ZeRO++ (1.71), ZeRO-topo / ZeRO-3 (2.40)
and ZeRO-topo's weak-scaling efficiency from 8 to 48 nodes (0.94). Then the points of the Frontier
sets; the four numbers under other readings of the CSV's rows (needs ../shared's CSV) and under
mechanisms the sets leave out; each assumption of the frontier-measured set varied alone (a
tornado chart); and the inter-node bandwidth at which the paper's 1.71 would be reached. ``--write`` replaces the marked sections of the doc; its
prose is not generated.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from functools import lru_cache
from pathlib import Path

from megatron.config import load_config
from megatron.model.sizes import unit_parameter_shapes
from megatron.topology import Topology
from megatron.analytic.comm_model import groups_of_kind, step_collectives
from megatron.analytic.deepspeed_model import deepspeed_collectives, on_deepspeed_schedule
from megatron.analytic import pccl_frontier
from megatron.analytic.figure_sets import FIGURE_SET_NAMES, POINTS_OF, Assumptions, frontier_curves
from megatron.analytic.hardware import Hardware, TierLink
from megatron.analytic.memory_model import device_peak_bytes, predict_peak_bytes
from megatron.analytic.model_inputs import activations_from_config, comm_spec_from_config, padded_vocab_of, step_work_from_config
from megatron.benchmarking.doc_sections import MissingSection, replace_section
from megatron.analytic.time_model import collectives_bytes_by_tier, scaling_efficiency, step_time

REPO_ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
QUANT = ("zero_optimization.zero_quantized_weights=true", "zero_optimization.zero_quantized_gradients=true")
ZERO3, ZEROPP = "ZeRO-3 (DeepSpeed)", "ZeRO++ hpZ+qwZ+qgZ (DeepSpeed)"
TOPO_PAPER, TOPO_OURS = "zero_topo, the paper's (all-reduce cross hop)", "zero_topo INT8/INT4 (ours)"
TOPO_PAPER_DS = "zero_topo, the paper's, cross hop every micro-step"
# label -> (preset file, overrides, whose collectives: DeepSpeed's, our engine's, or ours on
# DeepSpeed's schedule: the cross-node all-reduce behind every micro-step's backward)
CONFIGS = {
    ZERO3: ("zero3", (), "deepspeed"),
    ZEROPP: ("zeropp", QUANT, "deepspeed"),
    TOPO_PAPER: ("zero_topo_paper", (), "ours"),
    TOPO_PAPER_DS: ("zero_topo_paper", (), "deepspeed schedule"),
    TOPO_OURS: ("zero_topo", QUANT, "ours"),
    "zero_topo INT4 cross/INT8 refresh (ours)": ("zero_topo", ("zero_optimization.cross_node_grad_bits=4",
                                                              "zero_optimization.refresh_bits=8"), "ours"),
    "zero_topo unquantized (ours)": ("zero_topo", (), "ours"),
    "zero3 (ours)": ("zero3", (), "ours"),
    "zeropp qwZ+qgZ (ours)": ("zeropp", QUANT, "ours"),
    "hsdp (ours)": ("hsdp", (), "ours"),
}
PAPER = {"ZeRO++ / ZeRO-3": 1.405, "ZeRO-topo / ZeRO++": 1.71, "ZeRO-topo / ZeRO-3": 1.405 * 1.71,
         "scaling eff. 8->48": 0.94}
PAPER_TEXT = ("1.405", "1.71", "2.40 (1.405 x 1.71)", "0.94")
MARKERS = ("ratios", "counts", "curves", "readings", "mechanisms", "tflops", "phases", "sensitivity", "bandwidth")
FRONTIER_SETS = tuple(POINTS_OF)
REGIME_OF = {"frontier-measured": "clean", "frontier-eager": "eager"}
# Other readings of the CSV's rows than the shipped one (pccl_frontier.derive's keywords).
READINGS = (("2-128 nodes' median, each job's first size left out (shipped)", {}),
            ("each job's first size kept", {"drop_first": False}),
            ("the 32- and 64-node jobs only (around 48)", {"nodes": (32, 64)}),
            ("the 8-node job only", {"nodes": (8,)}))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--figures", nargs="+", default=list(FIGURE_SET_NAMES), choices=FIGURE_SET_NAMES)
    p.add_argument("--models", nargs="+", default=["20B", "10B"], help="configs/<name>.yml")
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 48])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--accumulation", type=int, nargs="+", default=[1, 8])
    p.add_argument("--paper-micro-batch", type=int, default=4,
                   help="the micro-batch of the per-node-count tables and the sensitivity (docs: why 4)")
    p.add_argument("--probe", help="a link probe JSON on top of each figure set (tools/probe_links.py)")
    p.add_argument("--write", help="replace the marked sections of this markdown file (docs/frontier-model.md)")
    p.add_argument("--png-dir", default=str(REPO_ROOT / "docs" / "figures"), help="'' for no charts")
    p.add_argument("--json", help="write every row here")
    p.add_argument("--no-sensitivity", action="store_true")
    return p.parse_args(argv)


# -- one prediction -----------------------------------------------------------------------------

@lru_cache(maxsize=None)
def config_for(model: str, label: str, nodes: int, micro: int, accumulation: int):
    preset, overrides, _ = CONFIGS[label]
    return load_config([str(REPO_ROOT / "configs" / f"{model}.yml"), str(REPO_ROOT / "configs" / f"{preset}.yml")],
                       ["topology.preset=frontier", f"num_nodes={nodes}", f"train_micro_batch_size_per_gpu={micro}",
                        f"gradient_accumulation_steps={accumulation}", *overrides], notices=[])


def hardware(cfg, figures: str, probe=None, variant=None) -> Hardware:
    hw = Hardware.from_topology(Topology.from_config(cfg, cfg.topology.world_size), backend="nccl", figures=figures)
    if probe:
        hw = hw.with_probe(probe, probe)
    return variant(hw) if variant else hw


def collectives_of(cfg, spec, label: str) -> list:
    """The step's collectives of a configuration: DeepSpeed's, ours, or ours on DeepSpeed's schedule."""
    whose = CONFIGS[label][2]
    if whose == "deepspeed":
        return deepspeed_collectives(spec, unit_parameter_shapes(cfg.model, padded_vocab_of(cfg)))
    cols = step_collectives(spec)
    return on_deepspeed_schedule(cols, spec.micro_batches) if whose == "deepspeed schedule" else cols


def predict(model: str, label: str, nodes: int, micro: int, accumulation: int, figures: str, probe=None,
            variant=None, coalesced_baselines: bool = False) -> dict:
    cfg = config_for(model, label, nodes, micro, accumulation)
    vocab = padded_vocab_of(cfg)
    spec = comm_spec_from_config(cfg, vocab)
    cols = None if coalesced_baselines and CONFIGS[label][2] == "deepspeed" else collectives_of(cfg, spec, label)
    st = step_time(spec, hardware(cfg, figures, probe, variant), step_work_from_config(cfg, vocab), cols)
    acts = activations_from_config(cfg, vocab)
    per_tier = collectives_bytes_by_tier(spec, cols)
    return {"figures": figures, "model": model, "config": label, "nodes": nodes, "gcds": cfg.topology.world_size,
            "micro_batch": micro, "accumulation": accumulation, "step_s": st.total_s, "tflops": st.tflops_per_device,
            "peak_gb": device_peak_bytes(predict_peak_bytes(spec, acts)) / GB,
            "inter_gb": per_tier.get("inter_node", 0.0) / spec.world_size / GB,
            "exposed_s": dict(st.exposed_s), "comm_s": dict(st.comm_s)}


def ratio(a: dict, b: dict) -> float:
    return a["tflops"] / b["tflops"]


# -- the tables ----------------------------------------------------------------------------------

def render(header, rows) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def ratio_table(rows: dict, args) -> str:
    last, first = max(args.nodes), min(args.nodes)
    out = [["paper (arXiv 2501.04266)", "20B", "?", "?", *PAPER_TEXT, "-", "-"]]
    for figures in args.figures:
        for model in args.models:
            for micro in args.micro_batches:
                for acc in args.accumulation:
                    at = {label: rows[(figures, model, label, last, micro, acc)] for label in CONFIGS}
                    eff = scaling_efficiency({n: rows[(figures, model, TOPO_PAPER, n, micro, acc)]["tflops"]
                                              for n in (first, last)})[last]
                    out.append([figures, model, micro, acc, f"{ratio(at[ZEROPP], at[ZERO3]):.3f}",
                                f"{ratio(at[TOPO_PAPER], at[ZEROPP]):.3f}", f"{ratio(at[TOPO_PAPER], at[ZERO3]):.3f}",
                                f"{eff:.3f}", f"{ratio(at[TOPO_PAPER_DS], at[ZEROPP]):.3f}",
                                f"{ratio(at[TOPO_OURS], at[ZEROPP]):.3f}"])
    return render(["figures", "model", "micro-batch", "accumulation", "ZeRO++ / ZeRO-3",
                   "ZeRO-topo / ZeRO++", "ZeRO-topo / ZeRO-3", f"ZeRO-topo scaling eff. {first}->{last}",
                   "ZeRO-topo every micro-step / ZeRO++", "ours INT8/INT4 / ZeRO++"], out)


def four_numbers(args, model: str, figures: str, micro: int, acc: int, variant=None) -> list:
    """The paper's four numbers as predicted: ZeRO++ / ZeRO-3, ZeRO-topo / ZeRO++, ZeRO-topo / ZeRO-3
    at the largest node count, ZeRO-topo's scaling efficiency from the smallest."""
    first, last = min(args.nodes), max(args.nodes)

    def at(label, n=last):
        return predict(model, label, n, micro, acc, figures, args.probe, variant)
    z3, zpp, topo = at(ZERO3), at(ZEROPP), at(TOPO_PAPER)
    eff = topo["tflops"] / at(TOPO_PAPER, first)["tflops"]
    return [f"{ratio(zpp, z3):.3f}", f"{ratio(topo, zpp):.3f}", f"{ratio(topo, z3):.3f}", f"{eff:.3f}"]


def _four_header(args) -> list:
    return ["ZeRO++ / ZeRO-3", "ZeRO-topo / ZeRO++", "ZeRO-topo / ZeRO-3",
            f"ZeRO-topo scaling eff. {min(args.nodes)}->{max(args.nodes)}"]


def readings_table(args, model: str, rows_csv: list) -> str:
    """The four numbers with each Frontier set rebuilt from another reading of the CSV's rows."""
    micro, acc = args.paper_micro_batch, args.accumulation[0]
    out = [["paper", "-", *PAPER_TEXT]]
    for figures in FRONTIER_SETS:
        for name, kw in READINGS:
            points = pccl_frontier.derive(rows_csv, REGIME_OF[figures], **kw)
            out.append([figures, name, *four_numbers(args, model, figures, micro, acc, _points(points))])
    return render(["figures", "rows read", *_four_header(args)], out)


def mechanisms_table(args, model: str) -> str:
    """The four numbers under what the sets leave out, one at a time: no overlap at all, micro-batch
    1, and every rate between nodes slowed 10x and 100x (as if RCCL ran without its
    libfabric plugin, say)."""
    acc, micro = args.accumulation[0], args.paper_micro_batch
    variants = (("as shipped", micro, None), ("no overlap of communication and compute", micro,
                                              _device(overlap_efficiency=0.0)),
                ("micro-batch 1", 1, None),
                ("every inter-node rate x 0.1", micro, _inter_node(0.1)),
                ("every inter-node rate x 0.01", micro, _inter_node(0.01)))
    out = [["paper", "-", "-", *PAPER_TEXT]]
    for figures in args.figures:
        for name, m, variant in variants:
            out.append([figures, name, m, *four_numbers(args, model, figures, m, acc, variant)])
    return render(["figures", "what changes", "micro-batch", *_four_header(args)], out)


def curves_table() -> str:
    """The measured points of the Frontier sets: busbw GB/s and the time one ring step takes (us)."""
    keys = [(figures, coll, span) for span in ("world", "node") for figures in FRONTIER_SETS
            for coll in pccl_frontier.COLLECTIVES]
    by_key = {k: {s: g for s, g, *_ in POINTS_OF[k[0]][(k[1], k[2])]} for k in keys}
    steps = sorted({s for k in keys for s in by_key[k]})

    def cell(k, s):
        g = by_key[k].get(s)
        return "" if g is None else f"{g:g} ({s / (g * 1e3):.1f})"
    return render(["ring step", *(f"{f.split('-')[1]} {c.replace('_', '-')} {span}" for f, c, span in keys)],
                  [[_bytes(s), *(cell(k, s) for k in keys)] for s in steps])


def _bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def tflops_table(rows: dict, args) -> str:
    micro, out = args.paper_micro_batch, []
    for figures in args.figures:
        for model in args.models:
            for acc in args.accumulation:
                for label in CONFIGS:
                    r = [rows[(figures, model, label, n, micro, acc)] for n in args.nodes]
                    out.append([figures, model, acc, label, *(f"{x['tflops']:.1f}" for x in r),
                                f"{r[-1]['step_s']:.2f}", f"{r[-1]['peak_gb']:.1f}", f"{r[-1]['inter_gb']:.2f}"])
    last = max(args.nodes)
    return render(["figures", "model", "accumulation", "config", *(f"TFLOPS/GCD {n} nodes" for n in args.nodes),
                   f"step s ({last})", f"peak GB/GCD ({last})", f"inter-node GB/GCD ({last})"], out)




def counts_table(args, model: str) -> str:
    """How many collectives one optimizer step issues, by phase, op and group, and their sizes."""
    last, micro, acc = max(args.nodes), args.paper_micro_batch, args.accumulation[0]
    out = []
    for label in (ZERO3, "zero3 (ours)", ZEROPP, "zeropp qwZ+qgZ (ours)", TOPO_PAPER, TOPO_OURS):
        by: dict = {}
        cfg = config_for(model, label, last, micro, acc)
        spec = comm_spec_from_config(cfg, padded_vocab_of(cfg))
        for c in collectives_of(cfg, spec, label):
            if c.phase == "control" or len(groups_of_kind(c.group, spec)[0]) == 1:
                continue  # the trainer's scalars; a group of one rank sends nothing
            entry = by.setdefault((c.phase, c.op, c.group), [0, 0, None, 0])
            entry[0] += c.count
            entry[1] += c.count * c.nbytes
            entry[2] = c.nbytes if entry[2] is None else min(entry[2], c.nbytes)
            entry[3] = max(entry[3], c.nbytes)
        for (phase, op, group), (count, total, small, big) in sorted(by.items()):
            out.append([label, phase, op, group, count, f"{total / GB:.2f}", f"{small / 1e6:.3g}", f"{big / 1e6:.3g}"])
    return render(["config", "phase", "op", "group", "calls per step", "GB per step", "smallest MB", "largest MB"], out)


def phases_table(rows: dict, args) -> str:
    last, micro = max(args.nodes), args.paper_micro_batch
    picked = [rows[(f, m, label, last, micro, a)] for f in args.figures for m in args.models[:1]
              for a in args.accumulation[:1] for label in CONFIGS]
    phases = sorted({p for r in picked for p in r["exposed_s"]})
    return render(["figures", "config", *phases],
                  [[r["figures"], r["config"], *(f"{r['exposed_s'].get(p, 0.0):.3f}" for p in phases)] for r in picked])


# -- what moves the ratio ----------------------------------------------------------------------

def _curves(**assume):
    """The Frontier set in use rebuilt from its own points under other assumptions."""
    def apply(hw: Hardware) -> Hardware:
        return dataclasses.replace(hw, curves={**hw.curves, **frontier_curves(POINTS_OF[hw.figure_set],
                                                                              Assumptions(**assume))})
    return apply


def _points(points):
    """The curves rebuilt from other points (a reading of the CSV)."""
    def apply(hw: Hardware) -> Hardware:
        return dataclasses.replace(hw, curves={**hw.curves, **frontier_curves(points)})
    return apply


def _inter_node(f: float):
    """Every inter-node rate (the tier's, the cross and world curves') multiplied by ``f``."""
    def apply(hw: Hardware) -> Hardware:
        links = {t: TierLink(l.bandwidth * f, l.latency_s) if t == "inter_node" else l for t, l in hw.links.items()}
        curves = {k: (c.scaled(f) if k[1] in ("cross", "world") else c) for k, c in hw.curves.items()}
        return dataclasses.replace(hw, links=links, curves=curves)
    return apply


def _device(**scale):
    def apply(hw: Hardware) -> Hardware:
        d = hw.device
        return dataclasses.replace(hw, device=dataclasses.replace(
            d, overlap_by_tier={}, **{k: (v if k == "overlap_efficiency" else getattr(d, k) * v) for k, v in scale.items()}))
    return apply


# name -> ((low label, variant), (high label, variant)); None = the baselines coalesced per unit.
ASSUMPTIONS = {
    "world-ring rates (the runs' medians)": (("x 0.5", _curves(world_scale=0.5)), ("x 2", _curves(world_scale=2.0))),
    "in-node ring rates (the one-node job)": (("x 0.5", _curves(node_scale=0.5)), ("x 2", _curves(node_scale=2.0))),
    "cross rings' node egress (the world plateau)": (("2 NICs at osu_bw's 23.82 GB/s", _curves(cross_cap_gbs=47.64)),
                                                     ("4 NICs at osu_bw's 23.82 GB/s", _curves(cross_cap_gbs=95.28))),
    "all-to-all across nodes (ring / 2.5)": (("ring / 3", _curves(all_to_all_slowdown=3.0)),
                                             ("ring / 1", _curves(all_to_all_slowdown=1.0))),
    "overlap efficiency (0.9, assumed)": (("0.5", _device(overlap_efficiency=0.5)),
                                          ("1.0", _device(overlap_efficiency=1.0))),
    "achieved compute (38% of peak)": (("x 0.75", _device(achieved_flops=0.75)), ("x 1.25", _device(achieved_flops=1.25))),
    "quantization kernels (30 B/element)": (("x 0.5 the rate", _device(quantize_elements_per_s=0.5)),
                                            ("x 2 the rate", _device(quantize_elements_per_s=2.0))),
    "DeepSpeed's collectives (per parameter / bucket)": (None, ("coalesced per unit, as ours", None)),
}


def sensitivity(args, model: str = "20B", figures: str = "frontier-measured") -> list:
    """[(assumption, base, (low label, ratio), (high label, ratio))] of ZeRO-topo (paper) / ZeRO++."""
    last, micro, acc = max(args.nodes), args.paper_micro_batch, args.accumulation[0]

    def at(variant=None, coalesced=False) -> float:
        a, b = (predict(model, label, last, micro, acc, figures, args.probe, variant, coalesced)
                for label in (TOPO_PAPER, ZEROPP))
        return ratio(a, b)
    base = at()
    out = []
    for name, (low, high) in ASSUMPTIONS.items():
        sides = []
        for side in (low, high):
            if side is None:
                sides.append(("as modelled", base))
            elif side[1] is None:
                sides.append((side[0], at(coalesced=True)))
            else:
                sides.append((side[0], at(side[1])))
        out.append((name, base, *sides))
    return sorted(out, key=lambda r: -abs(r[3][1] - r[2][1]))


def sensitivity_table(sens: list) -> str:
    return render(["assumption (frontier-measured value)", "base ratio", "low setting", "ratio", "high setting", "ratio",
                   "spread"], [[n, f"{b:.3f}", lo[0], f"{lo[1]:.3f}", hi[0], f"{hi[1]:.3f}", f"{abs(hi[1] - lo[1]):.3f}"]
                               for n, b, lo, hi in sens])


def bandwidth_factor(args, model: str, figures: str, acc: int, target: float = PAPER["ZeRO-topo / ZeRO++"]):
    """The factor on every inter-node rate (tier figures and cross/world curves) at which ZeRO-topo
    (paper) / ZeRO++ reaches ``target``, by bisection on a log scale; None if not by 1/1000."""
    last, micro = max(args.nodes), args.paper_micro_batch

    def r(f):
        return ratio(*(predict(model, label, last, micro, acc, figures, args.probe, _inter_node(f))
                       for label in (TOPO_PAPER, ZEROPP)))
    lo, hi = 1e-3, 1.0
    if r(hi) >= target:
        return 1.0
    if r(lo) < target:
        return None
    for _ in range(25):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if r(mid) >= target else (lo, mid)
    return lo


def bandwidth_table(args) -> str:
    out = []
    for figures in args.figures:
        for acc in args.accumulation:
            f = bandwidth_factor(args, args.models[0], figures, acc)
            out.append([figures, args.models[0], max(args.nodes), args.paper_micro_batch, acc,
                        "not reached at 1/1000" if f is None else f"x {f:.4f}"])
    return render(["figures", "model", "nodes", "micro-batch", "accumulation",
                   f"inter-node rate for ZeRO-topo / ZeRO++ = {PAPER['ZeRO-topo / ZeRO++']}"], out)


# -- charts ------------------------------------------------------------------------------------

def plot_tflops(rows: dict, args, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    model, micro, acc = args.models[0], args.paper_micro_batch, args.accumulation[0]
    fig, axes = plt.subplots(1, len(args.figures), figsize=(6.2 * len(args.figures), 4.4), squeeze=False)
    for ax, figures in zip(axes[0], args.figures):
        for label in CONFIGS:
            pts = [rows[(figures, model, label, n, micro, acc)] for n in args.nodes]
            ax.plot([p["gcds"] for p in pts], [p["tflops"] for p in pts], marker="o", label=label,
                    linestyle="-" if CONFIGS[label][2] == "deepspeed" or "paper" in label else ":")
        ax.set_title(f"{model}, {figures}: micro-batch {micro}, accumulation {acc}", fontsize=10)
        ax.set_xlabel("GCDs (8 per node)")
        ax.set_ylabel("predicted model TFLOPS per GCD")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_sensitivity(sens: list, path: Path, title: str) -> None:
    """A tornado: per assumption, the ratio's range between its two settings (red: low, blue: high)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(sens) + 1.8))
    base = sens[0][1]
    right = max(max(lo[1], hi[1]) for _, _, lo, hi in sens)
    for i, (_name, _b, lo, hi) in enumerate(reversed(sens)):
        ax.barh(i, max(lo[1], hi[1]) - min(lo[1], hi[1]), left=min(lo[1], hi[1]), color="lightgrey")
        ax.plot([lo[1]], [i], "o", color="tab:red")
        ax.plot([hi[1]], [i], "o", color="tab:blue")
        ax.text(right * 1.02, i, f"{lo[0]}: {lo[1]:.2f}  |  {hi[0]}: {hi[1]:.2f}", va="center", fontsize=7)
    ax.set_yticks(range(len(sens)), [s[0] for s in reversed(sens)], fontsize=8)
    ax.axvline(base, color="black", linewidth=0.8, label=f"frontier-measured: {base:.2f}")
    ax.axvline(PAPER["ZeRO-topo / ZeRO++"], color="grey", linestyle="--", label="paper: 1.71")
    ax.set_xlim(min(0.7, min(min(lo[1], hi[1]) for _, _, lo, hi in sens) - 0.05), right * 1.9)
    ax.plot([], [], "o", color="tab:red", label="low setting")
    ax.plot([], [], "o", color="tab:blue", label="high setting")
    ax.set_xlabel("predicted ZeRO-topo (the paper's) / ZeRO++ (DeepSpeed) TFLOPS")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- the doc -------------------------------------------------------------------------------------

def write_sections(path: str, sections: dict) -> None:
    """Replace each ``<!-- frontier_model:NAME -->`` ... ``<!-- /frontier_model:NAME -->`` block."""
    text = Path(path).read_text()
    for name, body in sections.items():
        try:
            text = replace_section(text, f"<!-- frontier_model:{name} -->\n", f"<!-- /frontier_model:{name} -->", body + "\n")
        except MissingSection as error:
            raise SystemExit(f"frontier_model: {path}: {error}") from None
    Path(path).write_text(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = {}
    for figures in args.figures:
        for model in args.models:
            for micro in args.micro_batches:
                for acc in args.accumulation:
                    for n in sorted(args.nodes):
                        for label in CONFIGS:
                            rows[(figures, model, label, n, micro, acc)] = predict(model, label, n, micro, acc,
                                                                                  figures, args.probe)
    sections = {"ratios": ratio_table(rows, args), "phases": phases_table(rows, args),
                "counts": counts_table(args, args.models[0])}
    if args.paper_micro_batch in args.micro_batches:
        sections["tflops"] = tflops_table(rows, args)
    sens = None
    if any(f in FRONTIER_SETS for f in args.figures):
        sections["curves"] = curves_table()
    if not args.no_sensitivity:
        sections["mechanisms"] = mechanisms_table(args, args.models[0])
        if pccl_frontier.DATA.exists():
            sections["readings"] = readings_table(args, args.models[0], pccl_frontier.read_rows())
        else:
            print(f"frontier_model: {pccl_frontier.DATA} is absent: no readings table", file=sys.stderr)
    if not args.no_sensitivity and "frontier-measured" in args.figures:
        sens = sensitivity(args, args.models[0])
        sections["sensitivity"] = sensitivity_table(sens)
        sections["bandwidth"] = bandwidth_table(args)
    for name in MARKERS:
        if name in sections:
            print(f"\n<!-- frontier_model:{name} -->\n{sections[name]}")
    if args.png_dir:
        out = Path(args.png_dir)
        out.mkdir(parents=True, exist_ok=True)
        plot_tflops(rows, args, out / "frontier_model.png")
        if sens:
            plot_sensitivity(sens, out / "frontier_model_sensitivity.png",
                             f"{args.models[0]}, {max(args.nodes)} nodes, micro-batch {args.paper_micro_batch}, "
                             f"accumulation {args.accumulation[0]}, frontier-measured: one assumption at a time")
    if args.write:
        write_sections(args.write, sections)
    if args.json:
        Path(args.json).write_text(json.dumps([dict(r) for r in rows.values()], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
