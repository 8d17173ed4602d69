#!/usr/bin/env python
"""The step-time model's projection for the paper's runs: 10B and 20B on 8-48 Frontier nodes.

    .venv/bin/python bench/frontier_model.py --markdown          # docs/frontier-model.md
    .venv/bin/python bench/frontier_model.py --nodes 8 48 --accumulation 8 --png ''

Per model, node count and configuration (the shipped configs: configs/<model>.yml + the preset's
yml, bf16, micro batch 4, activation checkpointing on, on ``topology.preset frontier``): the
predicted optimizer step, its TFLOPS per GCD (model FLOPs, recompute not counted), the memory
model's peak per GCD, the inter-node bytes per GCD; the zero_topo / zeropp ratio and each
configuration's weak-scaling efficiency against 8 nodes, beside the paper's 1.71x and 0.94; for
zero_topo, how much of the step the cross-node gradient reduction and the weight refresh take
(the terms the paper's volume table leaves out). Last, the sensitivity the paper's 1.71x implies:
the factor on every link's bandwidth (inter-node, and all tiers) at which the model's
zero_topo / zeropp ratio reaches 1.71 at 48 nodes.

Figures: ``megatron/topology/topology.py`` FRONTIER_LINKS (nominal per-link bandwidths) and
``hardware.DEVICES['mi250x_gcd']`` (an assumed 35% of the bf16 peak; optimizer and quantizer costs per
element as measured on an H200); ``--probe`` replaces them
with a probe's (tools/probe_links.py on an allocation).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron.config import load_config  # noqa: E402
from megatron.topology import ShardLayout, Topology  # noqa: E402
from megatron.zero_topo.model_inputs import padded_vocab_of, quant_spec_of  # noqa: E402
from megatron.zero_topo.planner import Candidate, evaluate, inputs_from_config  # noqa: E402
from megatron.zero_topo.hardware import Hardware, TierLink  # noqa: E402
from megatron.zero_topo.time_model import scaling_efficiency  # noqa: E402

PAPER_RATIO, PAPER_EFFICIENCY = 1.71, 0.94
GB = 1e9
QUANT = ("zero_optimization.zero_quantized_weights=true", "zero_optimization.zero_quantized_gradients=true")
# label -> (preset file, overrides): the paper's two (zeropp with qwZ + qgZ, zero_topo INT8/INT4) and their kin.
CONFIGS = {
    "zero3": ("zero3", ()),
    "zeropp (qwZ+qgZ)": ("zeropp", QUANT),
    "hsdp": ("hsdp", ()),
    "zero_topo": ("zero_topo", ()),
    "zero_topo INT8/INT4": ("zero_topo", QUANT),
    "zero_topo INT4 cross/INT8 refresh": ("zero_topo", ("zero_optimization.cross_node_grad_bits=4",
                                                        "zero_optimization.refresh_bits=8")),
}
PAPER_PAIR = ("zero_topo INT8/INT4", "zeropp (qwZ+qgZ)")
BOUNDARY = ("cross_grad_reduce", "refresh", "replica_allreduce")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["10B", "20B"], help="configs/<name>.yml")
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 48])
    p.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--probe", help="link probe JSON instead of the preset's figures")
    p.add_argument("--overlap-efficiency", type=float, default=None,
                   help="override the device's overlap efficiency (0 = nothing hidden: the pessimistic bound)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--png", default=str(REPO_ROOT / "docs" / "figures" / "frontier_model.png"))
    p.add_argument("--json", help="write every row here")
    return p.parse_args(argv)


def config_for(model: str, preset: str, overrides: tuple, nodes: int, accumulation: int):
    return load_config([str(REPO_ROOT / "configs" / f"{model}.yml"), str(REPO_ROOT / "configs" / f"{preset}.yml")],
                       ["topology.preset=frontier", f"num_nodes={nodes}",
                        f"gradient_accumulation_steps={accumulation}", *overrides], notices=[])


def hardware(cfg, probe, scale_inter: float = 1.0, scale_all: float = 1.0, overlap=None) -> Hardware:
    hw = Hardware.from_topology(Topology.from_config(cfg, cfg.topology.world_size), backend="nccl")
    if probe:
        hw = hw.with_probe(probe, probe)
    if overlap is not None:
        hw = dataclasses.replace(hw, device=dataclasses.replace(hw.device, overlap_efficiency=overlap,
                                                                overlap_by_tier={}))
    links = {tier: TierLink(link.bandwidth * scale_all * (scale_inter if tier == "inter_node" else 1.0),
                            link.latency_s) for tier, link in hw.links.items()}
    return dataclasses.replace(hw, links=links)


def predict(model: str, label: str, nodes: int, accumulation: int, probe=None, scale_inter=1.0, scale_all=1.0,
            overlap=None):
    preset, overrides = CONFIGS[label]
    cfg = config_for(model, preset, overrides, nodes, accumulation)
    vocab = padded_vocab_of(cfg)
    inputs = inputs_from_config(cfg, vocab, hardware(cfg, probe, scale_inter, scale_all, overlap))
    row = evaluate(Candidate(ShardLayout.from_config(cfg), label, quant_spec_of(cfg.zero),
                             bool(cfg.model.checkpoint_activations)), inputs)
    st = row.time
    return {"model": model, "config": label, "nodes": nodes, "gcds": cfg.topology.world_size,
            "factors": list(row.factors), "step_s": st.total_s, "tflops": st.tflops_per_device,
            "peak_gb": row.peak_bytes / GB, "inter_gb": row.bytes_per_tier.get("inter_node", 0.0) / GB,
            "exposed_s": dict(st.exposed_s), "comm_s": dict(st.comm_s),
            "inter_node_comm_s": dict(st.inter_node_comm_s)}


def ratio_at(model, nodes, accumulation, probe, overlap=None, **scale) -> float:
    a, b = (predict(model, label, nodes, accumulation, probe, overlap=overlap, **scale)["tflops"]
            for label in PAPER_PAIR)
    return a / b


def scale_for_ratio(model, nodes, accumulation, probe, which: str, overlap=None, target: float = PAPER_RATIO):
    """The bandwidth factor (inter-node links only, or every tier) at which the ratio reaches target,
    by bisection on log scale; None when even 1/1000 of the bandwidth does not reach it."""
    key = "scale_inter" if which == "inter" else "scale_all"
    lo, hi = 1e-3, 1.0
    if ratio_at(model, nodes, accumulation, probe, overlap, **{key: lo}) < target:
        return None
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        if ratio_at(model, nodes, accumulation, probe, overlap, **{key: mid}) >= target:
            lo = mid
        else:
            hi = mid
    return lo


def render(header, rows, markdown) -> str:
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                         + ["| " + " | ".join(map(str, r)) + " |" for r in rows])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(r, widths)) for r in [header] + rows)


def report(rows: list, args) -> str:
    out = []
    h = "### " if args.markdown else ""
    for model in args.models:
        mine = [r for r in rows if r["model"] == model]
        eff = {label: scaling_efficiency({r["nodes"]: r["tflops"] for r in mine if r["config"] == label})
               for label in CONFIGS}
        table = []
        for r in mine:
            table.append([r["nodes"], r["gcds"], r["config"], tuple(r["factors"]), f"{r['step_s']:.2f}",
                          f"{r['tflops']:.1f}", f"{eff[r['config']][r['nodes']]:.3f}", f"{r['peak_gb']:.1f}",
                          f"{r['inter_gb']:.2f}"])
        out += [f"\n{h}{model}, accumulation {args.accumulation}: predicted per optimizer step\n",
                render(["nodes", "GCDs", "config", "(w, g, os)", "step s", "TFLOPS/GCD", "scaling eff.",
                        "peak GB/GCD", "inter-node GB/GCD"], table, args.markdown)]
        ratios = []
        for n in args.nodes:
            by = {r["config"]: r for r in mine if r["nodes"] == n}
            topo, pp = by[PAPER_PAIR[0]], by[PAPER_PAIR[1]]
            boundary = sum(topo["exposed_s"].get(p, 0.0) for p in BOUNDARY)
            inter = sum(topo["inter_node_comm_s"].values())
            ratios.append([n, f"{topo['tflops'] / pp['tflops']:.3f}", PAPER_RATIO,
                           f"{eff[PAPER_PAIR[0]][n]:.3f}", PAPER_EFFICIENCY,
                           f"{boundary:.3f}", f"{100 * boundary / topo['step_s']:.1f}%",
                           f"{100 * sum(topo['inter_node_comm_s'].get(p, 0.0) for p in BOUNDARY) / inter:.0f}%"
                           if inter else "-"])
        out += [f"\n{h}{model}: {PAPER_PAIR[0]} against {PAPER_PAIR[1]}, and its step-boundary hops\n",
                render(["nodes", "TFLOPS ratio", "paper", "scaling eff.", "paper", "cross-node grad + refresh s",
                        "share of step", "share of inter-node comm"], ratios, args.markdown)]
        phases = sorted({p for r in mine for p in r["exposed_s"]})
        last = max(args.nodes)
        rows_last = [r for r in mine if r["nodes"] == last]
        out += [f"\n{h}{model} on {last} nodes: seconds on the critical path by phase\n",
                render(["config", *phases], [[r["config"], *[f"{r['exposed_s'].get(p, 0.0):.3f}" for p in phases]]
                                             for r in rows_last], args.markdown)]
    return "\n".join(out)


def sensitivity(args) -> str:
    h = "### " if args.markdown else ""
    lines = []
    last = max(args.nodes)
    for model in args.models:
        inter = scale_for_ratio(model, last, args.accumulation, args.probe, "inter", args.overlap_efficiency)
        every = scale_for_ratio(model, last, args.accumulation, args.probe, "all", args.overlap_efficiency)

        def text(s):
            return "not reached at 1/1000 of the bandwidth" if s is None else f"x {s:.4f}"
        lines.append([model, last, text(inter), text(every)])
    return (f"\n{h}Bandwidth at which the model gives the paper's {PAPER_RATIO}x ({PAPER_PAIR[0]} / {PAPER_PAIR[1]})\n\n"
            + render(["model", "nodes", "inter-node bandwidth", "every tier's bandwidth"], lines, args.markdown))


def plot(rows: list, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(args.models), figsize=(6 * len(args.models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], args.models):
        for label in CONFIGS:
            pts = sorted((r["gcds"], r["tflops"]) for r in rows if r["model"] == model and r["config"] == label)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_title(f"{model}: predicted TFLOPS per GCD (accumulation {args.accumulation})")
        ax.set_xlabel("GCDs (8 per node)")
        ax.set_ylabel("model TFLOPS per GCD")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)


BANDWIDTH_FACTORS = (1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001)


def plot_bandwidth(args) -> str:
    """The paper pair's TFLOPS ratio at the largest node count against a factor on the inter-node
    bandwidth: where the model would reach the paper's 1.71x."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    last = max(args.nodes)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for model in args.models:
        ratios = [ratio_at(model, last, args.accumulation, args.probe, args.overlap_efficiency, scale_inter=f)
                  for f in BANDWIDTH_FACTORS]
        ax.plot(BANDWIDTH_FACTORS, ratios, marker="o", label=f"{model}, {last} nodes")
    ax.axhline(PAPER_RATIO, color="grey", linestyle="--", label=f"paper: {PAPER_RATIO}x")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xscale("log")
    ax.invert_xaxis()
    ax.set_xlabel("inter-node bandwidth / Frontier's nominal 4 x 25 GB/s per node")
    ax.set_ylabel(f"TFLOPS {PAPER_PAIR[0]} / {PAPER_PAIR[1]}")
    ax.set_title(f"predicted ratio, accumulation {args.accumulation}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = str(Path(args.png).with_name(Path(args.png).stem + "_bandwidth.png"))
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = [predict(model, label, n, args.accumulation, args.probe, overlap=args.overlap_efficiency)
            for model in args.models for n in sorted(args.nodes) for label in CONFIGS]
    print(report(rows, args))
    print(sensitivity(args))
    if args.png:
        plot(rows, args)
        print(f"\ncharts: {args.png}, {plot_bandwidth(args)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
