"""Every sharding preset on the simulated topology, measured in one run: step time as a ratio to the
single-process engine, and the ledger's bytes per optimizer step by tier next to the analytic
model's prediction for the same run.

    .venv/bin/python bench/presets.py                      # tiny-cpu.yml on 2x2x2, 12 steps each
    .venv/bin/python bench/presets.py --layout sim-2x2 --steps 20 --markdown
    .venv/bin/python bench/presets.py --compare-prefetch   # each preset also with prefetch_gathers=false

Step time is the median `runtime/iteration_time` over the steps after the first two (warm-up) from
each run's metrics.jsonl; the baseline is the same model and global batch on one process, measured
in the same invocation. Eval is off, so each step's window holds exactly one step's traffic.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron.config import load_config
from megatron.analytic.comm_model import predict_ledger
from megatron.analytic.model_inputs import comm_spec_from_config, padded_vocab_of

REPO = Path(__file__).resolve().parents[1]

PRESETS = ("ddp", "zero1", "zero2", "zero3", "hsdp", "zeropp", "zero_topo")  # configs/<name>.yml
TIERS = ("intra_gpu", "intra_node", "inter_node")


def run(config_files: list[str], sets: list[str], workdir: Path) -> list[dict]:
    log_dir = workdir / "logs"
    cmd = [sys.executable, str(REPO / "deepy.py"), "train.py", *config_files,
           "--set", f"log_dir={log_dir}", "--set", "log_interval=1", "--set", "eval_iters=0",
           "--set", "save=null", "--set", "checkpoint_factor=null", *sum((["--set", s] for s in sets), [])]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench run failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()
            if "train/lm_loss" in line]


def predicted_per_step(cfg_paths: list[str], sets: list[str]) -> dict[str, int]:
    """The comm model's bytes per optimizer step by tier for the run these files and sets describe."""
    cfg = load_config(cfg_paths, sets, notices=[])
    out = {t: 0 for t in TIERS}
    # The demo tokenizer (and so the vocabulary) exists once the first run has built it.
    for (_phase, tier), nbytes in predict_ledger(comm_spec_from_config(cfg, padded_vocab_of(cfg))).items():
        out[tier] += nbytes
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny-cpu.yml")
    p.add_argument("--layout", default="sim-2x2x2", help="configs/<layout>.yml")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--compare-prefetch", action="store_true",
                   help="also run every preset with zero_optimization.prefetch_gathers=false; adds the "
                        "ratio of the step time without prefetch to the step time with it")
    p.add_argument("--set", dest="sets", action="append", default=[],
                   help="extra config overrides for every run, e.g. zero_optimization.zero_quantized_gradients=true")
    args = p.parse_args(argv)
    base = [str(REPO / args.config)]
    sets = [f"train_iters={args.steps}", *args.sets]
    with tempfile.TemporaryDirectory() as tmp:
        def median_time(records):
            times = [r["runtime/iteration_time"] for r in records[2:]] or [r["runtime/iteration_time"] for r in records]
            return statistics.median(times)

        baseline = median_time(run(base, sets, Path(tmp) / "single"))
        rows = []
        for name in args.presets:
            files = base + [str(REPO / f"configs/{args.layout}.yml"), str(REPO / f"configs/{name}.yml")]
            records = run(files, sets, Path(tmp) / name)
            measured = {t: statistics.median(r[f"comm/bytes/{t}"] for r in records[1:]) for t in TIERS}
            predicted = predicted_per_step(files, sets)
            step = median_time(records)
            row = [name, f"{step * 1000:.0f}", f"{step / baseline:.2f}"]
            if args.compare_prefetch:
                plain = median_time(run(files, sets + ["zero_optimization.prefetch_gathers=false"],
                                        Path(tmp) / f"{name}-no-prefetch"))
                row += [f"{plain / baseline:.2f}", f"{plain / step:.2f}"]
            rows.append(row + [f"{measured[t]:,.0f}" + ("" if measured[t] == predicted[t] else f" (model {predicted[t]:,})")
                               for t in TIERS])
    header = ["preset", "step ms", "x single", *(["no prefetch x single", "no prefetch / prefetch"]
                                                 if args.compare_prefetch else []),
              *(f"{t} B/step" for t in TIERS)]
    print(f"{args.config} on {args.layout}, {args.steps} steps; single-process step {baseline * 1000:.0f} ms "
          "(same global batch); bytes are all ranks' sends per optimizer step (ledger; equal to the model "
          "unless a model value is shown)")
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        for row in [header] + rows:
            print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
