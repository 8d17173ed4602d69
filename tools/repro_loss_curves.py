#!/usr/bin/env python
"""The loss-curve recipe (`make repro`): five runs of one small GPT-NeoX on the same data and seed, then their curves.

    make repro                        # the full recipe: configs/repro/model.yml's train_iters steps per run;
                                      # the figure and table are also copied to docs/figures/
    make repro REPRO_STEPS=20         # a quick end-to-end check in runs/repro/20steps/ (publishes nothing)
    python tools/repro_loss_curves.py --steps 20 --runs zero3_s1 zero_topo_int8_int4

Steps: (1) the data: all of the Python standard library's sources, a byte-level BPE trained on them
and the NeoX .bin/.idx (megatron/data/demo_corpus.py, built once into data/repro/); (2) the runs
below, each `deepy.py train.py configs/repro/model.yml <layout> <preset file>` on the simulated
2x2x2 cluster (8 gloo ranks; --layout configs/sim-2x2.yml for 4); (3) tools/loss_curves.py draws
runs/repro/<N>steps/loss_curves.{png,csv,md}: baseline zero3_s1, noise = the spread of zero3_s1 and
zero3_s2 (the same run but for its seed), and runs NAME_s<K> grouped by setup (--group-seeds: each
setup's mean over seeds, its gap in units of the pooled seed standard deviation, its gap at every
evaluation).

Each run lives in runs/repro/<N>steps/<run>/ (metrics.jsonl, the run's config JSON, train.log with
its output, checkpoints/). A run that has logged its last step's training and validation loss is not
redone; one that stopped part-way resumes from its last checkpoint (a quarter of the run at most is
repeated, and the curves read the repeated steps' latest records). Delete a run's folder to redo it.
Progress (a bar on a terminal, else a line every 10% or 30 s) counts the steps of all the runs to do.
"""
from __future__ import annotations

import argparse
import math
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron.config import ConfigError, load_config
from megatron.data.demo_corpus import DATA_PREFIX, ensure_demo_data
from megatron.logging.metrics import format_duration
from megatron.logging.progress import Progress
from megatron.logging.run_history import RunError, read_run

REPO = Path(__file__).resolve().parents[1]

MODEL = "configs/repro/model.yml"
LAYOUT = "configs/sim-2x2x2.yml"
RUNS_ROOT = "runs/repro"
# All of the standard library (about 9 MB on Python 3.11): ~2.5M tokens, so the full recipe's 1.3M
# training tokens are read once, not repeated (build_demo_corpus's 6 MB cap would give 1.6M).
CORPUS_MAX_BYTES = 16_000_000
EVALUATIONS_PER_RUN = 10
CHECKPOINTS_PER_RUN = 4
POLL_S = 2.0  # how often the progress reads the running run's metrics.jsonl


@dataclass(frozen=True)
class Run:
    """One run of the recipe: a preset file (with its quantization) and a seed; ``model_sets``:
    --set overrides of the recipe's model keys (another block shape)."""
    name: str
    preset_config: str
    seed: int
    model_sets: tuple = ()


RUNS = (
    Run("zero3_s1", "configs/zero3.yml", 1234),             # the baseline
    Run("zero3_s2", "configs/zero3.yml", 4321),             # the same but for its seed: the noise
    Run("zeropp_qwz_qgz", "configs/repro/zeropp_qwz_qgz.yml", 1234),
    Run("zero_topo_int8_int4", "configs/repro/zero_topo_int8_int4.yml", 1234),
    Run("zero_topo_int8_int4_ef", "configs/repro/zero_topo_int8_int4_ef.yml", 1234),
)
# Issue 28's study (--study beyond_int4): the baseline and INT8/INT4 with each new option alone and
# together, every one at two seeds, so a gap can be read in units of the seed spread; run long
# enough to show drift (--steps 400: four times the recipe's 100).
# Every option's first seed trains before any second seed, so a study stopped part way (7 h on 2
# cores) already compares every option once.
STUDIES = {"beyond_int4": tuple(
    Run(f"{stem}_s{i}", config, seed)
    for i, seed in ((1, 1234), (2, 4321))
    for stem, config in (("zero3", "configs/zero3.yml"),
                         ("zero_topo_int8_int4", "configs/repro/zero_topo_int8_int4.yml"),
                         ("zero_topo_int8_int4_delta", "configs/repro/zero_topo_int8_int4_delta.yml"),
                         ("zero_topo_int8_int4_rotation", "configs/repro/zero_topo_int8_int4_rotation.yml"),
                         ("zero_topo_int8_int4_delta_rotation", "configs/repro/zero_topo_int8_int4_delta_rotation.yml")))}
# Issue 40's study (--study llama): the recipe's model with a Llama block, ZeRO-3 against zero_topo
# INT8/INT4 at two seeds each. Same width, depth, heads, data, optimizer and schedule; RMSNorm, SwiGLU
# of inner width 1024 (3 x 384 x 1024 weights, about the 4h GELU MLP's 2 x 384 x 1536), 2 K/V heads
# for the 4 query heads, no biases, whole heads rotated, sequential residual. (--set, since a key
# may be written in one config file only.)
LLAMA_BLOCK = ("norm=rmsnorm", "rms_norm_epsilon=1e-5", "activation=swiglu", "intermediate_size=3072",
               "num_kv_heads=2", "use_bias_in_attn_linear=false", "use_bias_in_mlp=false", "rotary_pct=1",
               "gpt_j_residual=false")
STUDIES["llama"] = tuple(
    Run(f"llama_{stem}_s{i}", config, seed, LLAMA_BLOCK)
    for i, seed in ((1, 1234), (2, 4321))
    for stem, config in (("zero3", "configs/zero3.yml"), ("zero_topo_int8_int4", "configs/repro/zero_topo_int8_int4.yml")))
BASELINE = "zero3_s1"
NOISE_RUNS = ("zero3_s1", "zero3_s2")


def baseline_and_noise(names: Sequence[str]) -> tuple[Optional[str], tuple[str, ...]]:
    """The ZeRO-3 runs among ``names`` (a study's prefixed ones too): the baseline and the noise pair."""
    prefix = next((n[:-len(BASELINE)] for n in names if n.endswith(BASELINE)), None)
    if prefix is None:
        return None, ()
    noise = tuple(prefix + n for n in NOISE_RUNS)
    return prefix + BASELINE, noise if all(n in names for n in noise) else ()


def run_settings(steps: int) -> list[str]:
    """The --set overrides every run gets for a recipe of ``steps`` steps (the same cadence for any
    length: ten validation points, a checkpoint every quarter)."""
    return [f"train_iters={steps}", f"eval_interval={max(1, math.ceil(steps / EVALUATIONS_PER_RUN))}",
            f"checkpoint_factor={max(1, math.ceil(steps / CHECKPOINTS_PER_RUN))}"]


def run_command(run: Run, folder: Path, steps: int, layout: str) -> list[str]:
    ckpt = folder / "checkpoints"
    sets = [*run.model_sets, *run_settings(steps), f"seed={run.seed}", f"log_dir={folder}", f"save={ckpt}", f"load={ckpt}"]
    return [sys.executable, "deepy.py", "train.py", MODEL, layout, run.preset_config,
            *[arg for s in sets for arg in ("--set", s)]]


def logged_steps(folder: Path) -> int:
    """The last training step the run's metrics.jsonl holds (0 when it has none yet)."""
    try:
        last = read_run(folder).last("train/lm_loss")
    except RunError:
        return 0
    return last[0] if last else 0


def finished(folder: Path, steps: int) -> bool:
    """The run logged its last step's training and validation loss."""
    try:
        return read_run(folder).finished(steps)
    except RunError:
        return False


def step_times(folder: Path) -> list[float]:
    """runtime/iteration_time of the run's steps after the first two (start-up, first gathers)."""
    series = read_run(folder).series.get("runtime/iteration_time", {})
    return [series[i] for i in sorted(series) if i > 2]


def build_data(model_config: str) -> None:
    cfg = load_config([model_config], notices=[])
    prefix = Path(cfg.data.data_path)
    if prefix.name != DATA_PREFIX or Path(cfg.tokenizer.vocab_file) != prefix.parent / "tokenizer.json":
        raise ConfigError(f"{model_config}: the recipe builds <folder>/{DATA_PREFIX} and <folder>/tokenizer.json; "
                          f"data_path and vocab_file must name them")
    started = time.monotonic()
    data = ensure_demo_data(prefix.parent, vocab_size=cfg.tokenizer.vocab_size, max_bytes=CORPUS_MAX_BYTES,
                            log=lambda line: print(line, flush=True))
    print(f"[repro] data: {data.documents} files, {data.text_bytes / 1e6:.1f} MB, {data.tokens:,} tokens, "
          f"vocabulary {data.vocab_size} ({format_duration(time.monotonic() - started)})", flush=True)


def train(run: Run, folder: Path, steps: int, layout: str, bar: Progress) -> int:
    """Run (or resume) one run with its output in train.log; the bar follows its metrics.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    counted = logged_steps(folder)  # what the bar has been told about this run
    with open(folder / "train.log", "a") as log:
        log.write(f"\n$ {' '.join(run_command(run, folder, steps, layout))}\n")
        log.flush()
        proc = subprocess.Popen(run_command(run, folder, steps, layout), cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(POLL_S)
            done = logged_steps(folder)
            if done > counted:
                bar.update(done - counted)
                counted = done
    done = logged_steps(folder)
    bar.update(max(done - counted, 0))
    return proc.returncode


def summary(run: Run, folder: Path, wall_s: float, steps_run: int) -> str:
    history = read_run(folder)
    valid = history.last("validation/lm_loss")
    times = step_times(folder)
    median = f"{statistics.median(times):.2f} s/step (median)" if times else "no step times"
    return (f"[repro] {run.name}: {steps_run} steps in {format_duration(wall_s)} "
            f"({wall_s / max(steps_run, 1):.2f} s/step with start-up, evaluations and checkpoints; {median}); "
            f"final validation loss {valid[1]:.4f}" if valid else f"[repro] {run.name}: no validation loss")


def compare(root: Path, runs: Sequence[Run], steps: int, layout: str, publish: Optional[Path]) -> int:
    names = [run.name for run in runs]
    cmd = [sys.executable, "tools/loss_curves.py", *[f"{name}={root / name}" for name in names],
           "--output", str(root / "loss_curves"), "--markdown", "--group-seeds",
           "--title", f"make repro: {MODEL}, {steps} steps per run, {Path(layout).stem}"]
    baseline, noise = baseline_and_noise(names)
    if baseline is not None:
        cmd += ["--baseline", baseline]
    if noise:
        cmd += ["--noise-runs", *noise]
    print("[repro] $ " + " ".join(cmd), flush=True)
    code = subprocess.run(cmd, cwd=REPO).returncode
    if code == 0 and publish is not None:
        publish.mkdir(parents=True, exist_ok=True)
        for suffix in (".png", ".csv", ".md"):
            shutil.copyfile(root / f"loss_curves{suffix}", publish / f"loss_curves{suffix}")
        print(f"[repro] published {publish}/loss_curves.png, .csv, .md", flush=True)
    return code


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None,
                        help=f"optimizer steps per run (default: train_iters of {MODEL}, the full recipe)")
    parser.add_argument("--runs", nargs="+", choices=sorted({run.name for run in RUNS + sum(STUDIES.values(), ())}),
                        default=None, help="only these runs (default: all five, or the study's)")
    parser.add_argument("--study", choices=sorted(STUDIES), default=None,
                        help="another set of runs: beyond_int4 (issue 28: ten runs, run with --steps 400); llama "
                             "(issue 40: four runs of the model with a Llama block)")
    parser.add_argument("--layout", default=LAYOUT, help=f"simulated cluster (default {LAYOUT}; configs/sim-2x2.yml: 4 ranks)")
    parser.add_argument("--root", default=None, help=f"where the runs go (default {RUNS_ROOT}/<steps>steps)")
    parser.add_argument("--publish", default=None, type=Path,
                        help="also copy loss_curves.png/.csv/.md here (make repro: docs/figures)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        steps = args.steps or load_config([MODEL], notices=[]).training.train_iters
        if steps < 1:
            raise ConfigError(f"--steps {steps}: must be >= 1")
        build_data(MODEL)
    except ConfigError as error:
        print(f"repro: error: {error}", file=sys.stderr)
        return 2
    root = Path(args.root or f"{RUNS_ROOT}/{steps}steps")
    table = STUDIES[args.study] if args.study else RUNS
    runs = [run for run in table if args.runs is None or run.name in args.runs]
    todo = [run for run in runs if not finished(root / run.name, steps)]
    for run in runs:
        if run not in todo:
            print(f"[repro] {run.name}: finished earlier ({root / run.name}), not redone", flush=True)
    started = time.monotonic()
    total = sum(steps - logged_steps(root / run.name) for run in todo)
    with Progress("[repro]", total, "steps") as bar:
        for number, run in enumerate(todo, start=1):
            folder = root / run.name
            bar.set_description(f"[repro {number}/{len(todo)}] {run.name}")
            bar.write(f"[repro] {run.name}: training ({steps} steps, output in {folder / 'train.log'})")
            run_started, before = time.monotonic(), logged_steps(folder)
            code = train(run, folder, steps, args.layout, bar)
            if code != 0:
                bar.close(finished=False)
                tail = (folder / "train.log").read_text(errors="replace").splitlines()[-15:]
                print("\n".join(tail), file=sys.stderr)
                print(f"repro: error: {run.name} exited with code {code}; its output: {folder / 'train.log'}; "
                      f"run the same command again to resume it", file=sys.stderr)
                return code
            bar.write(summary(run, folder, time.monotonic() - run_started, steps - before))
    if todo:
        print(f"[repro] {len(todo)} run(s) trained in {format_duration(time.monotonic() - started)}", flush=True)
    return compare(root, runs, steps, args.layout, args.publish)


if __name__ == "__main__":
    sys.exit(main())
