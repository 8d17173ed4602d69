"""Peak memory per rank, measured against the memory model, per configuration and per phase.

    .venv/bin/python bench/memory.py                         # ~160M parameters on 2x2x2, six configurations
    .venv/bin/python bench/memory.py --markdown              # the tables in docs/memory.md
    .venv/bin/python bench/memory.py --layers 4 --hidden 256 --configs zero3 zero_topo-int4-ef
    python bench/memory.py --device cuda --layout none --load-layout none --set bf16.enabled=true ...
    .venv/bin/python bench/memory.py --allocator --layout none --load-layout none --configs zero3

A configuration is a preset (configs/<preset>.yml) plus overrides: the four presets, and zero_topo
with INT4 gradients with and without error feedback (CONFIGS), so the memory model's error_feedback
term is checked against measurement: the two differ by that term alone. Each configuration trains
the same model for two steps on the simulated layout with `memory_report` on, saving a checkpoint
at the end; every checkpoint is then resumed by the same resume run (--load-layout, --load-preset:
zero_topo on 2x2 by default, another world size and other factors) for one more step, with the
configuration's own overrides (quantization, error feedback). Every rank writes its measured peak
resident set per phase (build, step, save, load; megatron/logging/memory.py); the table shows the
largest rank's peak above its own baseline (the process after imports and data indices, before any
model state: measured, and shown) next to the model's prediction (megatron/analytic/memory_model.py,
predict_peak_bytes, with the activation estimate of megatron/model/sizes.py), and the ratio
measured / predicted. On a GPU (--device cuda) the measure is the device's peak allocation against
the model's device terms; on a CPU with --allocator the CPU allocator's peak (torch.profiler's
memory events, which count a mapped checkpoint file at its size) against the model's total: the
GPU's quantity, without the resident set's allocator slack and untouched pages. One process
(--layout none) runs the single-process engine, and the model predicts that engine there. The last
table is the model's prediction per GCD for the paper's 20B on 48 Frontier nodes, where it counts.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron.config import load_config
from megatron.model.sizes import parameter_count
from megatron.topology import ShardLayout
from megatron.analytic.memory_model import PEAK_PHASES, device_phase_bytes, predict_peak_bytes
from megatron.analytic.model_inputs import (activations_from_config, autocast_copies_from_config,
                                            comm_spec_from_config, padded_vocab_of)

REPO = Path(__file__).resolve().parents[1]

GB = 1e9
BIG = ["configs/20B.yml", "configs/frontier.yml", "configs/zero_topo.yml", "configs/local_setup.yml"]
INT4_GRADS = "zero_optimization.zero_quantized_gradients=true"
ERROR_FEEDBACK = "zero_optimization.quantization_error_feedback=true"
# name -> (preset, overrides): trained with configs/<preset>.yml and the overrides; resumed with the
# overrides too (the load preset's residuals, when error feedback is on, are then in the load row).
CONFIGS = {"zero3": ("zero3", []), "hsdp": ("hsdp", []), "zero_topo": ("zero_topo", []), "zeropp": ("zeropp", []),
           "zero_topo-int4": ("zero_topo", [INT4_GRADS]),
           "zero_topo-int4-ef": ("zero_topo", [INT4_GRADS, ERROR_FEEDBACK])}
# The pair whose difference is the error-feedback residuals alone (same padding, same collectives).
EF_PAIR = ("zero_topo-int4", "zero_topo-int4-ef")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=1, help="micro-batch per rank")
    p.add_argument("--layout", default="sim-2x2x2", help="configs/<layout>.yml for the training runs (none: one process)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   help="configurations (CONFIGS: a preset and its overrides)")
    p.add_argument("--load-layout", default="sim-2x2", help="layout the checkpoints are resumed on (none: one process)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: measure the GPU's peak allocation per phase against the model's device terms")
    p.add_argument("--allocator", action="store_true",
                   help="cpu: measure the CPU allocator's peak per phase (memory_report_allocator), not the resident set")
    p.add_argument("--load-preset", default="zero_topo", help="preset every checkpoint is resumed with")
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra config overrides")
    p.add_argument("--markdown", action="store_true")
    return p.parse_args(argv)


def measure_of(args) -> str:
    """What a phase's peak is: the GPU's allocation, the CPU allocator's bytes, or the resident set."""
    return "device" if args.device == "cuda" else "allocator" if args.allocator else "rss"


def model_sets(args, log_dir: Path, extra: list[str]) -> list[str]:
    sets = [f"num_layers={args.layers}", f"hidden_size={args.hidden}", f"num_attention_heads={args.heads}",
            f"seq_length={args.seq}", f"train_micro_batch_size_per_gpu={args.micro}", "gradient_accumulation_steps=1",
            "train_batch_size=null", "eval_iters=0", "log_interval=1", "memory_report=true",
            "checkpoint_factor=null", "keep_last_n_checkpoints=null", f"log_dir={log_dir}", f"device={args.device}",
            f"memory_report_allocator={str(measure_of(args) == 'allocator').lower()}", *args.sets, *extra]
    return [item for s in sets for item in ("--set", s)]


def run(files: list[str], sets: list[str]) -> None:
    cmd = [sys.executable, str(REPO / "deepy.py"), "train.py", *files, *sets]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench run failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")


def measured(log_dir: Path, measure: str = "rss") -> tuple[dict, int]:
    """({phase: largest rank's peak above its baseline}, largest baseline): the resident set above
    the process's baseline; an allocator's peak (the GPU's, or the CPU's traced) counts from nothing."""
    ranks = [json.loads(p.read_text()) for p in sorted((log_dir / "memory").glob("rank_*.json"))]
    key = {"device": "device_peak", "allocator": "allocator_peak", "rss": "peak_rss"}[measure]
    baselines = [r["baseline_rss"] if measure == "rss" else 0 for r in ranks]
    phases = {phase: max(r[key][phase] - base for r, base in zip(ranks, baselines) if phase in r[key])
              for phase in PEAK_PHASES if any(phase in r[key] for r in ranks)}
    return phases, max(baselines)


def predicted(files: list[str], sets: list[str], measure: str = "rss") -> dict:
    cfg = load_config([str(REPO / f) for f in files], [s for s in sets if s != "--set"], notices=[])
    vocab = padded_vocab_of(cfg)
    peaks = predict_peak_bytes(comm_spec_from_config(cfg, vocab), activations_from_config(cfg, vocab),
                               autocast_copies_from_config(cfg, vocab))
    return {phase: device_phase_bytes(terms) if measure == "device" else terms["total"] for phase, terms in peaks.items()}


def layout_files(layout: str) -> list[str]:
    return [] if layout == "none" else [f"configs/{layout}.yml"]


def print_table(header: list[str], rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in [header] + rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.allocator and args.device == "cuda":
        raise SystemExit("bench/memory.py: --allocator traces the CPU allocator; on a GPU the device's own peak is measured")
    measure = measure_of(args)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("bench/memory.py: --device cuda, but torch sees no GPU", file=sys.stderr)
            return 77
    base = ["configs/tiny-cpu.yml"]
    rows, got_by, want_by = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            preset, extra = CONFIGS[name]
            work = Path(tmp) / name
            train_files = base + layout_files(args.layout) + [f"configs/{preset}.yml"]
            train_sets = model_sets(args, work / "train", [*extra, "train_iters=2", f"save={work / 'ck'}"])
            run(train_files, train_sets)
            load_files = base + layout_files(args.load_layout) + [f"configs/{args.load_preset}.yml"]
            load_sets = model_sets(args, work / "load", [*extra, "train_iters=3", f"load={work / 'ck'}", "save=null"])
            run(load_files, load_sets)
            got_train, baseline = measured(work / "train", measure)
            got_load, load_baseline = measured(work / "load", measure)
            want_train = predicted(train_files, train_sets, measure)
            want_load = predicted(load_files, load_sets, measure)
            suffix = name[len(preset):]
            for phase in PEAK_PHASES:
                load = phase == "load"
                got = got_load.get(phase) if load else got_train.get(phase)
                want = want_load[phase] if load else want_train[phase]
                where = f"{args.load_preset}{suffix} on {args.load_layout}" if load else f"{name} on {args.layout}"
                if got is None:
                    continue
                got_by[name, phase], want_by[name, phase] = got, want
                rows.append([name, phase, where, f"{(load_baseline if load else baseline) / GB:.2f}",
                             f"{got / GB:.3f}", f"{want / GB:.3f}", f"{got / want:.2f}"])
        cfg = load_config([str(REPO / f) for f in base], [s for s in model_sets(args, Path(tmp), []) if s != "--set"],
                          notices=[])
        params = parameter_count(cfg.model, padded_vocab_of(cfg))
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch {args.micro}: "
          f"{params / 1e6:.1f}M parameters (fp32 full copy {4 * params / GB:.2f} GB); peaks are the largest "
          + {"device": "rank's device allocation (torch.cuda.max_memory_allocated), against the model's device terms",
             "allocator": "rank's CPU allocator bytes (torch.profiler's memory events, mapped files included)",
             "rss": "rank's, above its baseline"}[measure])
    print(f"build, step, save: each configuration on {args.layout}; load: every configuration's checkpoint "
          f"resumed as {args.load_preset} on {args.load_layout} (with the configuration's quantization and "
          "error feedback, if any)")
    print_table(["configuration", "phase", "run", "baseline GB", "measured GB", "predicted GB",
                 "measured / predicted"], rows, args.markdown)
    if all(name in args.configs for name in EF_PAIR):
        print()
        print_error_feedback(got_by, want_by, args.markdown)
    print()
    print_20b(args.markdown)
    return 0


def print_error_feedback(got_by: dict, want_by: dict, markdown: bool) -> None:
    """The residuals measured: each phase's peak with error feedback minus the same configuration
    without it (same padding, same collectives), against the model's difference (its error_feedback
    term in the states, and in the save's pieces)."""
    off, on = EF_PAIR
    print(f"error feedback: peak of {on} minus {off}, measured and predicted")
    rows = []
    for phase in PEAK_PHASES:
        if not all(key in got_by for key in ((on, phase), (off, phase))):
            continue
        got, want = got_by[on, phase] - got_by[off, phase], want_by[on, phase] - want_by[off, phase]
        rows.append([phase, f"{got / GB:.3f}", f"{want / GB:.3f}", f"{got / want:.2f}" if want else "-"])
    print_table(["phase", "measured difference GB", "predicted difference GB", "measured / predicted"], rows,
                markdown)


def print_20b(markdown: bool) -> None:
    """The model's per-GCD prediction for the 20B on 48 Frontier nodes (no process baseline)."""
    env = {"SLURM_JOB_NUM_NODES": "48"}
    cfg = load_config([str(REPO / f) for f in BIG], env=env, notices=[])
    vocab = cfg.model.padded_vocab_size
    peaks = predict_peak_bytes(comm_spec_from_config(cfg, vocab), activations_from_config(cfg, vocab))
    layout = ShardLayout.from_config(cfg)
    print(f"20B on 48 Frontier nodes ({layout.preset} {layout.factors.as_tuple()}, bf16, "
          f"micro-batch {cfg.training.train_micro_batch_size_per_gpu} x {cfg.model.seq_length} tokens, "
          f"activation checkpointing {'on' if cfg.model.checkpoint_activations else 'off'}): predicted GB per GCD")
    terms = sorted({t for phase in peaks.values() for t in phase if t != "total"})
    rows = [[phase] + [f"{peaks[phase].get(t, 0) / GB:.2f}" for t in terms] + [f"{peaks[phase]['total'] / GB:.2f}"]
            for phase in PEAK_PHASES]
    print_table(["phase", *terms, "total"], rows, markdown)


if __name__ == "__main__":
    sys.exit(main())
