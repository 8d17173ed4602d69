"""Predicted communication volume per rank per optimizer step, by phase and tier, per preset.

Default: GPT-NeoX 20B (44 layers, hidden 6144, 64 heads, vocab 50,432, untied) on 48 Frontier nodes
(layout 48 x 4 x 2 = 384 GCDs), bf16, gradient accumulation 1 and 8, for zero3, zeropp, hsdp and
zero_topo. Bytes per rank are the ledger's world sum divided by N (ring hops that cross a node
boundary are few and land on few ranks; the average is what the NICs of a node carry per GCD).
``--quantized`` adds the quantized variants (engine.md, "Quantized collectives"; block 2048):
zero_topo-q (INT8 weight gathers, INT4 gradient hops, INT4 cross-node gradients, INT8 refresh) and
zeropp-q (ZeRO++ qwZ + qgZ: INT8 weight gathers and secondary copy, INT4 two-hop gradients).

    .venv/bin/python bench/comm_volume.py                 # the default table
    .venv/bin/python bench/comm_volume.py --markdown --quantized   # docs/communication.md
    .venv/bin/python bench/comm_volume.py --layers 2 --hidden 128 --heads 4 --vocab 512 --layout 2 2 2
"""
from __future__ import annotations

import argparse
import math

from megatron.topology.layout import ShardLayout, display_name, preset_of_display_name
from megatron.analytic.comm_model import (
    PHASES, CommSpec, QuantSpec, predict_ledger, transformer_block_units)
from megatron.config.schema import ModelConfig
from megatron.topology import Topology
from megatron.model.sizes import unit_flops_per_token
from megatron.analytic.hardware import Hardware
from megatron.analytic.time_model import COMPUTE, OPTIMIZER, RECOMPUTE, StepWork, step_time
from megatron.analytic.memory_model import neox_unit_sizes, predict_model_state_bytes

# Quantized variants: label -> (preset, DeepSpeed-style switches; bits follow engine.md's defaults).
QUANTIZED = {"zero_topo-q": ("zero_topo", dict(quantized_weights=True, quantized_gradients=True)),
             "zeropp-q": ("zeropp", dict(quantized_weights=True, quantized_gradients=True))}
GB = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=44)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--vocab", type=int, default=50432, help="padded vocabulary")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4 x hidden)")
    p.add_argument("--tied", action="store_true", help="tie the output layer to the embedding")
    p.add_argument("--layout", type=int, nargs="+", default=[48, 4, 2], help="tier sizes, slowest first")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype-bytes", type=int, default=2, choices=(2, 4))
    p.add_argument("--fp32-allreduce", action="store_true")
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--presets", nargs="+", default=["zero3", "zeropp", "hsdp", "zero_topo"],
                   help=f"presets or quantized variants ({', '.join(QUANTIZED)})")
    p.add_argument("--quantized", action="store_true", help="append the quantized variants to --presets")
    p.add_argument("--block-size", type=int, default=2048, help="quantization block of the quantized variants")
    p.add_argument("--error-feedback", action="store_true", help="quantized variants keep error-feedback residuals")
    p.add_argument("--tokens-per-micro-batch", type=int, default=2048,
                   help="per rank, for the step time: the sequence length, one sequence per micro-batch")
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    return p.parse_args(argv)


def table(header: list, rows: list, markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(("{:<%d}" if i == 0 else "{:>%d}") % w for i, w in enumerate(widths))
    return "\n".join(fmt.format(*row) for row in [header] + rows)


def heading(text: str, markdown: bool) -> None:
    print(f"#### {text}\n" if markdown else text)


def main(argv=None) -> None:
    args = parse_args(argv)
    units = neox_unit_sizes(args.layers, args.hidden, args.heads, args.vocab, args.intermediate, untied=not args.tied)
    params = sum(units)
    layout = tuple(args.layout)
    n = math.prod(layout)
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
          f"{'tied' if args.tied else 'untied'}: {params:,} parameters in {len(units)} units")
    print(f"layout {' x '.join(map(str, layout))} = {n} ranks; compute dtype {args.dtype_bytes} bytes; "
          f"bytes per rank = all ranks' bytes / {n}; 'x P' = bytes per rank / parameter count\n")
    model = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                        seq_length=args.tokens_per_micro_batch, max_position_embeddings=args.tokens_per_micro_batch,
                        intermediate_size=args.intermediate, no_weight_tying=not args.tied)
    flops = unit_flops_per_token(model, args.vocab)
    # Frontier's figures (time_model.py): the layout's tiers, MI250X GCDs, RCCL.
    hardware = Hardware.from_topology(Topology.simulated(layout), device="mi250x_gcd", backend="nccl")
    engine = StepWork(args.tokens_per_micro_batch, flops)
    serial = StepWork(args.tokens_per_micro_batch, flops, prefetch_gathers=False, overlap_comm=False)
    summary = []
    labels = args.presets + ([q for q in QUANTIZED if q not in args.presets] if args.quantized else [])
    for label in labels:
        preset, switches = QUANTIZED.get(label, (preset_of_display_name(label), None))
        quant = (QuantSpec.from_settings(**switches, block_size=args.block_size, error_feedback=args.error_feedback)
                 if switches else QuantSpec())
        for a in args.micro_batches:
            spec = CommSpec(units, ShardLayout.resolve(layout, preset=preset), micro_batches=a, compute_bytes=args.dtype_bytes,
                            fp32_allreduce=args.fp32_allreduce, quant=quant,
                            checkpointed_units=transformer_block_units(len(units)) if args.checkpoint_activations
                            else frozenset())
            ledger = predict_ledger(spec)
            tiers = list(spec.tiers)
            rows = []
            for phase in PHASES:
                per_tier = [ledger.get((phase, t), 0) / n for t in tiers]
                if any(per_tier):
                    rows.append([phase] + [f"{b / GB:.3f}" for b in per_tier])
            totals = [sum(ledger.get((p, t), 0) for p in PHASES) / n for t in tiers]
            rows.append(["total"] + [f"{b / GB:.3f}" for b in totals])
            rows.append(["x P"] + [f"{b / params:.4f}" for b in totals])
            name = label if switches else display_name(preset)
            heading(f"{name}, gradient accumulation {a}: GB per rank per optimizer step", args.markdown)
            print(table(["phase"] + tiers, rows, args.markdown) + "\n")
            memory = predict_model_state_bytes(spec)["per_rank"]["total"]
            timed = step_time(spec, hardware, engine)
            flat = step_time(spec, hardware, serial)
            compute = sum(flat.exposed_s.get(k, 0.0) for k in (COMPUTE, RECOMPUTE, OPTIMIZER))
            inter = totals[tiers.index("inter_node")]
            summary.append([name, str(a), f"{inter / GB:.2f}", f"{inter / params:.3f}",
                            f"{inter / params / a:.3f}", f"{memory / GB:.1f}",
                            f"{compute:.2f}", f"{sum(flat.comm_s.values()):.2f}", f"{flat.total_s:.2f}",
                            f"{timed.total_s:.2f}"])
    heading("summary (inter-node GB per rank per step; x P = / parameters; states = model states per rank;"
            " times from the step-time model, megatron/analytic/time_model.py, on Frontier's figures: compute s"
            " = forward, backward, recompute and optimizer; step s = compute + comm, nothing overlapped;"
            " overlapped s = the engine's schedule, prefetched gathers and overlapped gradient reduction)",
            args.markdown)
    print(table(["preset", "A", "inter GB", "x P", "x P / micro-step", "states GB", "compute s", "comm s",
                 "step s", "overlapped s"], summary, args.markdown))


if __name__ == "__main__":
    main()
