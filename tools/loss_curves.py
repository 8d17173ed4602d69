#!/usr/bin/env python
"""Compare runs' loss curves: a PNG, a CSV of every point, and a final-loss table with each run's gap to a baseline.

    python tools/loss_curves.py runs/repro/180steps/zero3_s1 runs/repro/180steps/zero3_s2 \\
        runs/repro/180steps/zero_topo_int8_int4 --baseline zero3_s1 --noise-runs zero3_s1 zero3_s2 \\
        --output docs/figures/loss_curves --markdown

RUN is a metrics.jsonl or the log folder holding one (from here or from Frontier); LABEL=RUN names
it, otherwise the label is the folder's name. The preset (with its quantization) and the tokens per
iteration (global batch x seq_length) come from the newest neox_config_*.json beside it, which deepy
writes at every launch; records with a "tokens" field use it instead. Without either, the x axis is
the iteration for every run. Resumed runs are read as one history: repeated iterations keep the
latest record (megatron/logging/run_history.py).

Writes OUTPUT.png (training loss vs tokens, smoothed, raw points faint; validation loss as markers;
one colour per run, its preset in the legend; the right panel zooms into the second half) and
OUTPUT.csv (one row per run and iteration: run, preset, iteration, tokens, train_loss,
train_loss_smoothed, valid_loss), and prints the final-loss table (with --markdown as Markdown, also
written to OUTPUT.md):

  train     the smoothed training loss at the run's last logged iteration;
  valid     the run's last validation loss;
  gap       (run - baseline) / baseline in %, for train and valid;
  noise     the seed-to-seed noise: the spread (max - min) of the final validation losses of the
            --noise-runs (runs differing only in seed, e.g. the baseline and its reseeded copy);
            "gap / noise" is the validation gap in units of it, and a run is "within noise" when
            |gap| <= noise.

With --group-seeds, runs labelled NAME_s<K> (the same setup at seeds K = 1, 2, ...) form the group
NAME, and a second table compares groups rather than runs:

  mean      the mean over the group's seeds of the final validation loss;
  gap %     (group mean - baseline group's mean) / baseline group's mean, in %;
  by seed   each seed's gap to the baseline's run of the same seed (the same initialisation and
            data order), in %: a real difference shows the same sign at every seed;
  sigma     the seed-to-seed standard deviation of the final validation loss, pooled over every
            group with two or more seeds (the within-group sample variances weighted by their
            degrees of freedom, sum of n - 1);
  gap / sigma  the gap of the means over its own standard deviation, sigma * sqrt(1/n + 1/n_base)
            (n, n_base: the two groups' seed counts); |gap / sigma| below 2 is not a difference
            that two seeds can show.

Smoothing (--smooth, over logged points, not tokens): ema:W is TensorBoard's debiased exponential
moving average with weight W in [0, 1) (0.9 ~ the last 10 points); window:N the mean of the last N
points; none.

Bad inputs (a missing or empty file, no metric common to all runs, an unknown --baseline or
--noise-runs label) are one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron.logging.run_history import (TRAIN_LOSS, VALID_LOSS, RunError, RunHistory,
                                          read_run)

PROG = "loss_curves"
CSV_COLUMNS = ("run", "preset", "iteration", "tokens", "train_loss", "train_loss_smoothed", "valid_loss")


class UsageError(Exception):
    """A bad input: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other bad input of this tool
        raise UsageError(f"{message} (see --help)")


# -- smoothing ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Smoothing:
    kind: str  # ema | window | none
    value: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> "Smoothing":
        kind, _, value = spec.partition(":")
        try:
            if kind == "none" and not value:
                return cls("none")
            if kind == "ema" and 0.0 <= float(value) < 1.0:
                return cls("ema", float(value))
            if kind == "window" and int(value) >= 1:
                return cls("window", int(value))
        except ValueError:
            pass
        raise UsageError(f"--smooth {spec!r}: expected ema:W with 0 <= W < 1, window:N with N >= 1, or none")

    def __str__(self) -> str:
        return {"ema": f"EMA {self.value:g}", "window": f"mean of last {int(self.value)}", "none": "raw"}[self.kind]

    def apply(self, values: Sequence[float]) -> List[float]:
        if self.kind == "ema":  # debiased: the first point is itself, not pulled towards 0
            out, acc = [], 0.0
            for n, value in enumerate(values, start=1):
                acc = self.value * acc + (1.0 - self.value) * value
                out.append(acc / (1.0 - self.value ** n))
            return out
        if self.kind == "window":
            width = int(self.value)
            return [sum(values[max(0, i + 1 - width):i + 1]) / (i + 1 - max(0, i + 1 - width))
                    for i in range(len(values))]
        return list(values)


# -- reading ------------------------------------------------------------------------------------------
def parse_run(text: str) -> tuple[Optional[str], str]:
    """``LABEL=PATH`` or ``PATH`` (a path containing '=' can be given as ``./a=b``)."""
    label, sep, path = text.partition("=")
    if sep and label and "/" not in label:
        return label, path
    return None, text


def read_runs(specs: Sequence[str], notice) -> List[RunHistory]:
    runs = []
    for spec in specs:
        label, path = parse_run(spec)
        try:
            run = read_run(path, label)
        except RunError as error:
            raise UsageError(str(error)) from None
        if run.skipped_lines:
            notice(f"{run.label}: skipped {run.skipped_lines} line(s) of {run.metrics_path} that are not JSON "
                   f"records (a run killed while writing one)")
        runs.append(run)
    labels = [run.label for run in runs]
    duplicate = next((label for label in labels if labels.count(label) > 1), None)
    if duplicate:
        raise UsageError(f"two runs are labelled {duplicate!r}; name them with LABEL=PATH")
    return runs


def common_metrics(runs: Sequence[RunHistory], wanted: Sequence[str], notice) -> List[str]:
    kept, dropped = [], []
    for metric in wanted:
        missing = [run.label for run in runs if not run.series.get(metric)]
        if not missing:
            kept.append(metric)
        else:
            dropped.append(f"{metric} is not logged by {', '.join(missing)}: left out for every run")
    if not kept:
        have = "; ".join(f"{run.label}: {', '.join(sorted(k for k in run.series if k.endswith('loss'))) or 'no loss'}"
                         for run in runs)
        raise UsageError(f"no common metric: none of {', '.join(wanted)} is logged by every run ({have})")
    for message in dropped:
        notice(message)
    return kept


def use_tokens(runs: Sequence[RunHistory], notice) -> bool:
    lacking = [run.label for run in runs if any(run.tokens_at(i) is None for s in run.series.values() for i in s)]
    if lacking:
        notice(f"x axis: iterations (no config with train_batch_size and seq_length, nor a tokens field, "
               f"for {', '.join(lacking)})")
    return not lacking


# -- what is computed ---------------------------------------------------------------------------------
@dataclass
class Curve:
    run: RunHistory
    iterations: List[int]
    train: List[float]
    smoothed: List[float]
    valid_iterations: List[int]
    valid: List[float]


def curves(runs: Sequence[RunHistory], train_metric: Optional[str], valid_metric: Optional[str],
           smoothing: Smoothing) -> List[Curve]:
    """Each run's points of the two metrics (None: the metric is left out)."""
    out = []
    for run in runs:
        train = run.series.get(train_metric, {}) if train_metric else {}
        valid = run.series.get(valid_metric, {}) if valid_metric else {}
        iterations = sorted(train)
        values = [train[i] for i in iterations]
        out.append(Curve(run, iterations, values, smoothing.apply(values), sorted(valid),
                         [valid[i] for i in sorted(valid)]))
    return out


def csv_rows(curves_: Sequence[Curve], tokens: bool) -> List[dict]:
    rows = []
    for c in curves_:
        train = dict(zip(c.iterations, zip(c.train, c.smoothed)))
        valid = dict(zip(c.valid_iterations, c.valid))
        for iteration in sorted(set(train) | set(valid)):
            raw, smooth = train.get(iteration, ("", ""))
            rows.append({"run": c.run.label, "preset": c.run.preset, "iteration": iteration,
                         "tokens": int(c.run.tokens_at(iteration)) if tokens else "",
                         "train_loss": raw, "train_loss_smoothed": smooth, "valid_loss": valid.get(iteration, "")})
    return rows


@dataclass
class Final:
    label: str
    preset: str
    iteration: int
    tokens: Optional[float]
    train: Optional[float]
    valid: Optional[float]
    train_gap_pct: Optional[float] = None
    valid_gap_pct: Optional[float] = None
    gap_in_noise: Optional[float] = None
    within_noise: Optional[bool] = None


def finals(curves_: Sequence[Curve], baseline: str, noise_runs: Sequence[str], tokens: bool) -> tuple[List[Final], Optional[float]]:
    """Each run's final losses and gaps; the noise (spread of the noise runs' final validation)."""
    labels = [c.run.label for c in curves_]
    for name, option in [(baseline, "--baseline")] + [(n, "--noise-runs") for n in noise_runs]:
        if name not in labels:
            raise UsageError(f"{option} {name!r} is not one of the runs: {', '.join(labels)}")
    if noise_runs and len(set(noise_runs)) < 2:
        raise UsageError("--noise-runs needs at least two runs (the same setup with different seeds)")
    rows = []
    for c in curves_:
        last = max(c.iterations[-1] if c.iterations else 0, c.valid_iterations[-1] if c.valid_iterations else 0)
        rows.append(Final(c.run.label, c.run.preset, last, c.run.tokens_at(last) if tokens else None,
                          c.smoothed[-1] if c.smoothed else None, c.valid[-1] if c.valid else None))
    by_label = {row.label: row for row in rows}
    noise = None
    if noise_runs and all(by_label[n].valid is not None for n in noise_runs):
        finals_ = [by_label[n].valid for n in noise_runs]
        noise = max(finals_) - min(finals_)
    base = by_label[baseline]
    for row in rows:
        if row.train is not None and base.train:
            row.train_gap_pct = 100.0 * (row.train - base.train) / base.train
        if row.valid is not None and base.valid:
            row.valid_gap_pct = 100.0 * (row.valid - base.valid) / base.valid
            if noise is not None:
                row.within_noise = abs(row.valid - base.valid) <= noise
                if noise > 0:
                    row.gap_in_noise = (row.valid - base.valid) / noise
    return rows, noise


# -- seeds --------------------------------------------------------------------------------------------
SEED_LABEL = re.compile(r"^(?P<group>.+)_(?P<seed>s\d+)$")


def group_of(label: str) -> tuple[str, str]:
    """``NAME_s<K>`` -> (NAME, "s<K>"); any other label is a group of its own with no seed."""
    match = SEED_LABEL.match(label)
    return (match["group"], match["seed"]) if match else (label, "")


def _by_seed(by_seed: Dict[str, float]) -> List[str]:
    return sorted(by_seed, key=lambda seed: int(seed[1:]) if seed else -1)


@dataclass
class SeedGroup:
    name: str
    preset: str
    finals: Dict[str, float]  # seed ("s1") -> the run's final validation loss
    mean: float
    gap_pct: Optional[float] = None
    paired_gap_pct: Optional[Dict[str, float]] = None
    gap_in_sigma: Optional[float] = None


def seed_groups(rows: Sequence[Final], baseline: str) -> tuple[List[SeedGroup], Optional[float], int]:
    """Runs grouped by label NAME_s<K>; the pooled seed standard deviation and its degrees of freedom.

    Runs without a final validation loss are left out; a label without the suffix is a group of one.
    """
    members: Dict[str, Dict[str, Final]] = {}
    for row in rows:
        if row.valid is None:
            continue
        group, seed = group_of(row.label)
        members.setdefault(group, {})[seed] = row
    base_name = group_of(baseline)[0]
    if base_name not in members:
        raise UsageError(f"--baseline {baseline!r} has no validation loss: the groups cannot be compared")
    groups = [SeedGroup(name, next(iter(runs.values())).preset, {seed: r.valid for seed, r in runs.items()},
                        sum(r.valid for r in runs.values()) / len(runs))
              for name, runs in members.items()]
    squares = sum((value - g.mean) ** 2 for g in groups for value in g.finals.values())
    dof = sum(len(g.finals) - 1 for g in groups)
    sigma = math.sqrt(squares / dof) if dof else None
    base = next(g for g in groups if g.name == base_name)
    for g in groups:
        g.gap_pct = 100.0 * (g.mean - base.mean) / base.mean
        g.paired_gap_pct = {seed: 100.0 * (value - base.finals[seed]) / base.finals[seed]
                            for seed, value in g.finals.items() if seed in base.finals}
        if sigma and g is not base:
            g.gap_in_sigma = (g.mean - base.mean) / (sigma * math.sqrt(1 / len(g.finals) + 1 / len(base.finals)))
    return groups, sigma, dof


def gaps_by_evaluation(curves_: Sequence[Curve], baseline: str) -> tuple[List[int], Dict[str, List[float]]]:
    """At each validation iteration every run logged: each other group's mean validation loss's gap
    (%) to the baseline group's mean. Shows whether a gap grows with training (drift) or wanders."""
    members: Dict[str, List[Dict[int, float]]] = {}
    for c in curves_:
        if c.valid:
            members.setdefault(group_of(c.run.label)[0], []).append(dict(zip(c.valid_iterations, c.valid)))
    iterations = sorted(set.intersection(*(set(v) for runs in members.values() for v in runs))) if members else []
    means = {name: [sum(v[i] for v in runs) / len(runs) for i in iterations] for name, runs in members.items()}
    base = means.pop(group_of(baseline)[0], None)
    if base is None:
        return [], {}
    return iterations, {name: [100.0 * (m - b) / b for m, b in zip(values, base)] for name, values in means.items()}


def evaluation_table(iterations: Sequence[int], gaps: Dict[str, List[float]], markdown: bool) -> str:
    names = list(gaps)
    body = [[str(it)] + [f"{gaps[n][k]:+.2f}" for n in names] for k, it in enumerate(iterations)]
    return _format(["iteration"] + [f"{n} gap %" for n in names], body,
                   "each group's mean validation loss over its seeds, % above the baseline group's", markdown)


def group_table(groups: Sequence[SeedGroup], baseline_group: str, sigma: Optional[float], dof: int,
                markdown: bool) -> str:
    header = ["group", "preset", "seeds", "valid (each seed)", "mean", "gap %", "by seed %", "gap / sigma"]
    body = [[g.name + (" (baseline)" if g.name == baseline_group else ""), g.preset,
             str(len(g.finals)), ", ".join(f"{g.finals[s]:.4f}" for s in _by_seed(g.finals)), f"{g.mean:.4f}",
             f"{g.gap_pct:+.2f}", ", ".join(f"{s} {g.paired_gap_pct[s]:+.2f}" for s in _by_seed(g.paired_gap_pct)) or "-",
             "-" if g.gap_in_sigma is None else f"{g.gap_in_sigma:+.2f}"] for g in groups]
    note = (f"seed sigma (pooled standard deviation of the final validation loss, {dof} degrees of "
            f"freedom): {sigma:.4f}" if sigma else "seed sigma: not measured (no group has two seeds)")
    return _format(header, body, note, markdown)


# -- output -------------------------------------------------------------------------------------------
def _tokens_text(tokens: Optional[float]) -> str:
    if tokens is None:
        return "-"
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if tokens >= scale:
            return f"{tokens / scale:.2f}{suffix}"
    return f"{tokens:.0f}"


def table(rows: Sequence[Final], baseline: str, noise: Optional[float], smoothing: Smoothing,
          markdown: bool) -> str:
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    header = ["run", "preset", "iteration", "tokens", f"train ({smoothing})", "valid",
              "train gap %", "valid gap %"]
    if noise is not None:
        header += ["gap / noise", "within noise"]
    body = []
    for r in rows:
        line = [r.label + (" (baseline)" if r.label == baseline else ""), r.preset, str(r.iteration),
                _tokens_text(r.tokens), num(r.train, ".4f"), num(r.valid, ".4f"),
                num(r.train_gap_pct, "+.2f"), num(r.valid_gap_pct, "+.2f")]
        if noise is not None:
            within = "-" if r.within_noise is None else "yes" if r.within_noise else "no"
            line += [num(r.gap_in_noise, "+.2f"), within]
        body.append(line)
    note = (f"noise (spread of the seed runs' final validation loss): {noise:.4f}" if noise is not None
            else "noise: not measured (give --noise-runs)")
    return _format(header, body, note, markdown)


def _format(header: List[str], body: List[List[str]], note: str, markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines) + f"\n\n{note}\n"
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header] + body]
    return "\n".join(lines) + f"\n{note}\n"


def plot(curves_: Sequence[Curve], tokens: bool, smoothing: Smoothing, path: Path, title: Optional[str]) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("matplotlib is not installed: pip install -e '.[logging]' (the CSV and the table "
                         "need no plotting: rerun after installing it)") from None
    matplotlib.use("Agg")  # files only: no display needed (batch nodes, CI)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter

    def xs(c: Curve, iterations):
        return [c.run.tokens_at(i) for i in iterations] if tokens else list(iterations)

    fig, axes = plt.subplots(1, 2, figsize=(13, 6), gridspec_kw={"width_ratios": [3, 2]})
    ends = [max(xs(c, c.iterations + c.valid_iterations) or [0]) for c in curves_]
    zoom_from = 0.5 * max(ends or [0])
    zoom_values = []
    for index, c in enumerate(curves_):
        colour = f"C{index % 10}"
        train_x, valid_x = xs(c, c.iterations), xs(c, c.valid_iterations)
        for ax in axes:
            if c.train:
                ax.plot(train_x, c.train, color=colour, alpha=0.2, linewidth=0.7)
                ax.plot(train_x, c.smoothed, color=colour, linewidth=1.7, label=f"{c.run.label}: {c.run.preset}")
            if c.valid:
                ax.plot(valid_x, c.valid, color=colour, marker="o", markersize=4, markeredgecolor="black",
                        markeredgewidth=0.4, linestyle=":" if c.train else "-", linewidth=0.8,
                        label=None if c.train else f"{c.run.label}: {c.run.preset}")
        zoom_values += [v for x, v in zip(train_x, c.smoothed) if x >= zoom_from]
        zoom_values += [v for x, v in zip(valid_x, c.valid) if x >= zoom_from]
    xlabel = "tokens" if tokens else "iteration"
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if tokens:
            ax.xaxis.set_major_formatter(EngFormatter())
    axes[0].set_ylabel("loss (nats/token)")
    if zoom_values:
        low, high = min(zoom_values), max(zoom_values)
        pad = 0.08 * (high - low or 1.0)
        axes[1].set_xlim(zoom_from, max(ends) * 1.01)
        axes[1].set_ylim(low - pad, high + pad)
    axes[1].set_title("second half, zoomed", fontsize=10)
    handles, _ = axes[0].get_legend_handles_labels()
    handles += [Line2D([], [], color="grey", alpha=0.3, linewidth=0.7, label="training loss, raw"),
                Line2D([], [], color="grey", marker="o", markeredgecolor="black", linestyle=":",
                       label="validation loss")]
    longest = max(len(h.get_label()) for h in handles)
    columns = min(len(handles), 3 if longest <= 60 else 2)  # long labels: fewer columns, none cut
    fig.suptitle(title or f"Training loss ({smoothing}) and validation loss vs {xlabel}")
    # Below the panels, so it hides no curve.
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=columns, frameon=False)
    fig.tight_layout(rect=(0, 0.02 + 0.03 * math.ceil(len(handles) / columns), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # grows to the legend rather than cut it
    plt.close(fig)


def write_csv(rows: Sequence[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


# -- command line -------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="metrics.jsonl or its log folder; LABEL=RUN names it")
    parser.add_argument("--baseline", help="label of the run the gaps are measured from (default: the first run)")
    parser.add_argument("--noise-runs", nargs="+", default=[], metavar="LABEL",
                        help="two or more runs that differ only in seed: their final validation spread is the noise")
    parser.add_argument("--group-seeds", action="store_true",
                        help="also compare groups of runs labelled NAME_s<K> by their mean over seeds")
    parser.add_argument("-o", "--output", default="loss_curves",
                        help="writes OUTPUT.png and OUTPUT.csv (and OUTPUT.md with --markdown); default loss_curves")
    parser.add_argument("--smooth", default="ema:0.9", help="ema:W (default ema:0.9), window:N or none")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown and write OUTPUT.md")
    parser.add_argument("--title", help="figure title")
    parser.add_argument("--train-metric", default=TRAIN_LOSS, help=f"training-loss key (default {TRAIN_LOSS})")
    parser.add_argument("--valid-metric", default=VALID_LOSS, help=f"validation-loss key (default {VALID_LOSS})")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    def notice(message: str) -> None:
        print(f"{PROG}: notice: {message}", file=sys.stderr)

    try:
        args = parse_args(argv)
        smoothing = Smoothing.parse(args.smooth)
        runs = read_runs(args.runs, notice)
        metrics = common_metrics(runs, (args.train_metric, args.valid_metric), notice)
        tokens = use_tokens(runs, notice)
        curves_ = curves(runs, args.train_metric if args.train_metric in metrics else None,
                         args.valid_metric if args.valid_metric in metrics else None, smoothing)
        baseline = args.baseline or runs[0].label
        rows, noise = finals(curves_, baseline, args.noise_runs, tokens)
        grouped = seed_groups(rows, baseline) if args.group_seeds else None
        output = Path(args.output)
        write_csv(csv_rows(curves_, tokens), output.with_name(output.name + ".csv"))
        plot(curves_, tokens, smoothing, output.with_name(output.name + ".png"), args.title)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    text = table(rows, baseline, noise, smoothing, args.markdown)
    if grouped:
        groups, sigma, dof = grouped
        text += "\n" + group_table(groups, group_of(baseline)[0], sigma, dof, args.markdown)
        iterations, gaps = gaps_by_evaluation(curves_, baseline)
        if gaps:  # another setup than the baseline's
            text += "\n" + evaluation_table(iterations, gaps, args.markdown)
    if args.markdown:
        output.with_name(output.name + ".md").write_text(text)
    print(text, end="")
    print(f"wrote {output}.png, {output}.csv" + (f", {output}.md" if args.markdown else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
