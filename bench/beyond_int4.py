#!/usr/bin/env python
"""The step-time model's prediction for issue 28's options on the paper's 20B, 48 Frontier nodes.

    .venv/bin/python bench/beyond_int4.py                                   # print the table
    .venv/bin/python bench/beyond_int4.py --write docs/quantization.md      # refresh its marked section

Rows: ZeRO-topo with INT8 weights / INT4 gradients (today's quantized setting), the same with weight
deltas (INT4 changes on the refresh's cross hop), with the Hadamard rotation of gradient blocks,
with both, and per-tier widths (INT8 gradients inside a node, INT4 across); our zeropp with qwZ +
qgZ, and with per-tier widths. For each figure set (nominal, frontier-measured) and accumulation 1
and 8 at micro-batch 4: the predicted step time, TFLOPS per GCD, and the bytes one GCD sends across
nodes per optimizer step (megatron.analytic: comm_model, time_model; the same functions as
bench/frontier_model.py). A prediction, not a measurement: see docs/time_model.md for how far the
model has been checked.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from megatron.analytic.figure_sets import FIGURE_SET_NAMES
from megatron.analytic.hardware import Hardware
from megatron.analytic.model_inputs import comm_spec_from_config, padded_vocab_of, step_work_from_config
from megatron.analytic.comm_model import step_collectives
from megatron.analytic.time_model import collectives_bytes_by_tier, step_time
from megatron.benchmarking.doc_sections import MissingSection, replace_section
from megatron.config import load_config
from megatron.topology import Topology

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- beyond-int4:begin -->", "<!-- beyond-int4:end -->"
Z = "zero_optimization."
INT8_INT4 = (Z + "zero_quantized_weights=true", Z + "zero_quantized_gradients=true")
ROWS = {
    "zero_topo INT8 weights / INT4 gradients": ("zero_topo", INT8_INT4),
    "  + weight deltas (INT4)": ("zero_topo", INT8_INT4 + (Z + "zero_quantized_weights_delta=true",)),
    "  + Hadamard rotation": ("zero_topo", INT8_INT4 + (Z + "zero_quantized_gradients_rotation=hadamard",)),
    "  + both": ("zero_topo", INT8_INT4 + (Z + "zero_quantized_weights_delta=true",
                                           Z + "zero_quantized_gradients_rotation=hadamard")),
    "  per tier: INT8 in-node / INT4 across": ("zero_topo", (Z + "zero_quantized_weights=true", Z + "grad_reduce_bits=8",
                                                             Z + "cross_node_grad_bits=4")),
    "zeropp qwZ + qgZ (ours)": ("zeropp", INT8_INT4),
    "  per tier: INT8 node hop / INT4 rail hop": ("zeropp", (Z + "zero_quantized_weights=true", Z + "grad_reduce_bits=8",
                                                             Z + "cross_node_grad_bits=4")),
}


def predict(label: str, figures: str, nodes: int, micro: int, accumulation: int) -> dict:
    preset, overrides = ROWS[label]
    cfg = load_config([str(REPO / "configs" / "20B.yml"), str(REPO / "configs" / f"{preset}.yml")],
                      ["topology.preset=frontier", f"num_nodes={nodes}", f"train_micro_batch_size_per_gpu={micro}",
                       f"gradient_accumulation_steps={accumulation}", *overrides], notices=[])
    vocab = padded_vocab_of(cfg)
    spec = comm_spec_from_config(cfg, vocab)
    hw = Hardware.from_topology(Topology.from_config(cfg, cfg.topology.world_size), backend="nccl", figures=figures)
    cols = step_collectives(spec)
    st = step_time(spec, hw, step_work_from_config(cfg, vocab), cols)
    inter = collectives_bytes_by_tier(spec, cols).get("inter_node", 0.0) / spec.world_size
    return {"step_s": st.total_s, "tflops": st.tflops_per_device, "inter_gb": inter / 1e9}


def table(nodes: int, micro: int, accumulations: list[int], figure_sets: list[str]) -> str:
    head = ["option"] + [f"{f}, acc {a}: s / TFLOPS / GB across" for f in figure_sets for a in accumulations]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in ROWS:
        cells = []
        for figures in figure_sets:
            for acc in accumulations:
                r = predict(label, figures, nodes, micro, acc)
                cells.append(f"{r['step_s']:.2f} / {r['tflops']:.1f} / {r['inter_gb']:.2f}")
        lines.append(f"| {label.replace('  ', '&nbsp;&nbsp;')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accumulation", type=int, nargs="+", default=[1, 8])
    p.add_argument("--figures", nargs="+", default=list(FIGURE_SET_NAMES), choices=FIGURE_SET_NAMES)
    p.add_argument("--write", help="replace the marked section of this markdown file")
    args = p.parse_args(argv)
    text = (f"20B on {args.nodes} Frontier nodes ({8 * args.nodes} GCDs), micro-batch {args.micro_batch}; each cell: "
            "predicted step seconds / TFLOPS per GCD / GB one GCD sends across nodes per optimizer step. "
            "Written by `bench/beyond_int4.py --write docs/quantization.md`.\n\n"
            + table(args.nodes, args.micro_batch, args.accumulation, args.figures))
    print(text)
    if args.write:
        doc = Path(args.write)
        try:
            doc.write_text(replace_section(doc.read_text(), BEGIN, END, f"\n{text}\n"))
        except MissingSection as error:
            raise SystemExit(f"{doc}: {error}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
