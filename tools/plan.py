#!/usr/bin/env python
"""Every nested (w, g, os) layout (and ZeRO++) for a model on a machine, scored by the step-time model.

    .venv/bin/python tools/plan.py configs/20B.yml --topology frontier --nodes 8,16,32,48
    .venv/bin/python tools/plan.py configs/10B.yml --topology frontier --nodes 48 --memory-per-device 64GB \\
        --quantization all --checkpointing both --top 20 --markdown
    .venv/bin/python tools/plan.py configs/tiny-cpu.yml --topology sim --layout 2 2 2 --probe probe.json

Per node count: each candidate's quantization bits per phase (weight gathers / micro-step gradient
hops / cross-node gradients / refresh; 0 = the compute dtype), activation checkpointing, the
memory model's peak per device, the bytes one rank sends per step on each tier, the predicted step
time and model TFLOPS per device (and, for the best, the step's seconds by phase); ``*`` marks the best candidate that fits the memory budget (the
same search ``zero_optimization.plan: auto`` runs, megatron/analytic/planner.py). Below the --top
rows, the named presets (configs/zero3, zeropp, hsdp, zero_topo and zero_topo_paper .yml, each also
in its other precision; column "preset") that are not among them, with the configs' activation
checkpointing; a row that does not fit says which phase and terms exceed the budget. The summary gives
the best per node count and its scaling efficiency against the smallest count. Link and device
figures are --figures' (auto: frontier-measured on --topology frontier, docs/frontier-model.md), with
a probe's (tools/probe_links.py) on top with --probe.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from megatron.config import ConfigError, load_config
from megatron.topology import Topology
from megatron.topology.errors import TopologyError
from megatron.topology.layout import display_name
from megatron.analytic.comm_model import CommModelError
from megatron.analytic.figure_sets import FIGURE_SET_NAMES
from megatron.analytic.model_inputs import figure_set_of, figures_note, padded_vocab_of
from megatron.config.quant_spec import QuantSpec
from megatron.analytic.planner import (GB, PRESET_CONFIGS, QUANT_CHOICES, describe, inputs_from_config,
                                        preset_candidate, preset_rows, quant_spec, ranked, search, why_not)
from megatron.analytic.hardware import Hardware
from megatron.analytic.time_model import scaling_efficiency

TIER_COLUMNS = ("inter_node", "intra_node", "intra_gpu")
REPO = Path(__file__).resolve().parents[1]


def parse_size(text: str) -> float:
    """64GB, 64 GB, 64e9 or 64 (GB) -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*(GB|GiB|G)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 64GB)")
    value = float(match.group(1))
    unit = match.group(2)
    return value * (2**30 if unit == "GiB" else 1e9) if unit or value < 1e6 else value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", help="the model's YAML files (merged as deepy.py does)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--topology", choices=("frontier", "dgx", "sim"), default="frontier")
    p.add_argument("--nodes", default="8", help="comma-separated node counts (frontier, dgx)")
    p.add_argument("--layout", type=int, nargs="+", help="sim: tier sizes, slowest first (e.g. 2 2 2)")
    p.add_argument("--memory-per-device", type=parse_size, default=None, help="budget, e.g. 64GB (default: the device's)")
    p.add_argument("--figures", choices=("auto", *FIGURE_SET_NAMES), default="auto",
                   help="the figure set (docs/frontier-model.md); auto: frontier-measured on --topology frontier")
    p.add_argument("--probe", help="a link probe JSON (tools/probe_links.py) over the figure set")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: gloo for sim, else nccl")
    p.add_argument("--quantization", choices=("config", "all"), default="all",
                   help=f"config: the configs' bits only; all: also {', '.join(QUANT_CHOICES)} (default)")
    p.add_argument("--checkpointing", choices=("config", "on", "off", "both"), default="both")
    p.add_argument("--no-zeropp", action="store_true", help="leave ZeRO++ (hpZ) out of the candidates")
    p.add_argument("--top", type=int, default=12, help="rows per node count, fastest first (0 = all)")
    p.add_argument("--no-presets", action="store_true", help="leave out the named presets' rows")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", help="write every row here (times every candidate, also those that do not fit: slower)")
    return p.parse_args(argv)


def machine_overrides(args, nodes: int) -> list:
    if args.topology == "sim":
        if not args.layout:
            raise ConfigError("--topology sim needs --layout (tier sizes, slowest first)")
        return [f"topology.simulate=[{', '.join(map(str, args.layout))}]"]
    return [f"topology.preset={args.topology}", f"num_nodes={nodes}"]


def plan_nodes(args, nodes: int):
    """(the plan, its inputs, {preset label: candidate or why it has none}) for one node count."""
    machine = [*machine_overrides(args, nodes), f"topology.figure_set={args.figures}"]
    cfg = load_config(args.configs, [*args.overrides, *machine], notices=[])
    vocab = padded_vocab_of(cfg)
    if vocab is None:
        raise ConfigError(f"the vocabulary is unknown: the tokenizer file {cfg.tokenizer.vocab_file!r} is not there "
                          "(python deepy.py train.py ... builds the demo one); or pass --set vocab_size=N")
    topology = Topology.from_config(cfg, cfg.topology.world_size)
    backend = args.backend or ("gloo" if args.topology == "sim" else "nccl")
    hw = Hardware.from_topology(topology, backend=backend, figures=figure_set_of(cfg))
    if args.probe:
        hw = hw.with_probe(args.probe, args.probe)
    inputs = inputs_from_config(cfg, vocab, hw, args.memory_per_device)
    quants = {"config": QuantSpec.from_config(cfg.zero)}
    if args.quantization == "all":
        quants = {name: quant_spec(name, inputs.quant_block) for name in QUANT_CHOICES}
    ckpt = {"config": (bool(cfg.model.checkpoint_activations),), "on": (True,), "off": (False,),
            "both": (False, True)}[args.checkpointing]
    if nodes == min(int(n) for n in args.nodes.split(",")) and not args.probe and figures_note(cfg):
        print(figures_note(cfg))  # once: the published set was chosen for this Frontier topology
    plan = search(cfg.topology.layout, inputs, quants=quants, checkpointing=ckpt, include_zeropp=not args.no_zeropp)
    presets = {}
    if not args.no_presets:
        # the configs' checkpointing, unless the table is asked for one setting only
        preset_ckpt = ckpt[0] if len(ckpt) == 1 else bool(cfg.model.checkpoint_activations)
        for label, name, sets in PRESET_CONFIGS:
            try:
                preset_cfg = load_config([*args.configs, str(REPO / "configs" / f"{name}.yml")],
                                         [*args.overrides, *machine, *sets], notices=[])
                presets[label] = preset_candidate(preset_cfg, preset_ckpt)
            except (ConfigError, TopologyError) as err:
                presets[label] = f"not on this layout: {err}"
    return plan, inputs, presets


def row_cells(row, best, budget: float, presets: str = "") -> list:
    """One table row; ``presets``: the named presets this row is (comma-separated labels)."""
    c = row.candidate
    bits = c.quant.phase_bits
    w, g, os_ = row.factors
    layout = "zeropp" if c.layout.hpz else display_name(row.name)
    if c.cross_node_reduction != "reduce_scatter":
        layout += f" ({c.cross_node_reduction})"
    return ["*" if best is not None and row.candidate.key == best.candidate.key else "", presets, layout,
            f"({w}, {g}, {os_})",
            "/".join(str(bits[k]) for k in ("weight_gather_bits", "grad_reduce_bits", "cross_node_grad_bits",
                                             "refresh_bits")),
            "on" if c.checkpointed else "off", f"{row.peak_bytes / GB:.1f}", "yes" if row.feasible else "no",
            *[f"{row.bytes_per_tier.get(t, 0.0) / GB:.2f}" for t in TIER_COLUMNS],
            f"{row.time.total_s:.3f}", f"{row.time.tflops_per_device:.1f}",
            "" if row.feasible else why_not(row, budget)]


HEADER = ["", "preset", "layout", "(w, g, os)", "bits w/g/x/r", "ckpt", "peak GB", "fits", "inter GB",
          "intra_node GB", "intra_gpu GB", "step s", "TFLOPS", "why it does not fit"]


def table_rows(plan, inputs, presets: dict, top: int) -> list:
    """(row, preset labels, "") for the --top rows, then for each named preset not among them; and
    (None, label, why) for a preset this layout cannot run."""
    shown = ranked(plan, inputs, top)
    if plan.best is not None and all(r.candidate.key != plan.best.candidate.key for r in shown):
        shown = [plan.best] + shown
    labels: dict = {}
    extra, refused = [], []
    for label, row in preset_rows(plan, presets, inputs).items():
        if isinstance(row, str):
            refused.append((None, label, row))
            continue
        if row.candidate.key not in labels and all(r.candidate.key != row.candidate.key for r in shown + extra):
            extra.append(row)
        labels.setdefault(row.candidate.key, []).append(label)
    return [(r, ", ".join(labels.get(r.candidate.key, [])), "") for r in shown + extra] + refused


def phases_text(row) -> str:
    """The step's exposed seconds by phase (compute, recompute, optimizer, each communication phase)."""
    parts = sorted(((s, phase) for phase, s in row.time.exposed_s.items() if s > 0), reverse=True)
    return ", ".join(f"{phase} {s:.4g}" for s, phase in parts)


def render(header: list, rows: list, markdown: bool) -> str:
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                         + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    text = [h == HEADER[-1] for h in header]  # the reason reads left to right; numbers align right
    return "\n".join("  ".join(str(x).ljust(w) if left else str(x).rjust(w) for x, w, left in zip(r, widths, text)).rstrip()
                     for r in [header] + rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        counts = [int(n) for n in args.nodes.split(",")] if args.topology != "sim" else [0]
        planned = {n: plan_nodes(args, n) for n in counts}
    except (ConfigError, CommModelError, ValueError) as err:
        print(f"plan: error: {err}", file=sys.stderr)
        return 2
    plans = {n: plan for n, (plan, _, _) in planned.items()}
    dump = {}
    for n, (plan, inputs, presets) in planned.items():
        rows = table_rows(plan, inputs, presets, args.top)
        where = f"{n} nodes" if n else f"layout {args.layout}"
        print(f"\n{'### ' if args.markdown else ''}{where}: {len(plan.rows)} candidates, budget "
              f"{plan.budget / GB:.1f} GB per device, figures {plan.source}\n")
        cells = [row_cells(r, plan.best, plan.budget, labels) if r is not None
                 else ["", labels] + [""] * (len(HEADER) - 3) + [refused] for r, labels, refused in rows]
        header = HEADER if any(c[-1] for c in cells) else HEADER[:-1]  # the reason column only when a row needs it
        print(render(header, [c[:len(header)] for c in cells], args.markdown))
        print(f"\nbest: {plan.reason()}" if plan.best else f"\nnone fits: {plan.reason()}")
        if plan.best:
            print(f"best, seconds on the critical path by phase: {phases_text(plan.best)}")
        if args.json:
            dump[n] = [dict(zip(HEADER[1:], row_cells(r, plan.best, plan.budget)[1:]))
                       | {"best": r is plan.best} for r in ranked(plan, inputs)]
    best = {n: p.best.time.tflops_per_device for n, p in plans.items() if p.best}
    if len(best) > 1:
        eff = scaling_efficiency(best)
        print(f"\n{'### ' if args.markdown else ''}summary: the best layout per node count\n")
        print(render(["nodes", "best", "step s", "TFLOPS/device", "scaling efficiency"],
                     [[str(n), describe(plans[n].best), f"{plans[n].best.time.total_s:.3f}", f"{best[n]:.1f}",
                       f"{eff[n]:.3f}"] for n in best], args.markdown))
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
