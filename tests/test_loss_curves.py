"""tools/loss_curves.py on two short real runs of the trainer (and copies of their metrics edited the
way restarts and other runs leave them): CSV columns, the PNG, the gaps, restarts, one-line errors."""
from __future__ import annotations

import csv
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_deepy, run_together, tiny_run_config
from megatron.logging.run_history import read_run

TOOL = REPO / "tools" / "loss_curves.py"
STEPS = 6


def _load_tool():
    spec = importlib.util.spec_from_file_location("loss_curves", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


loss_curves = _load_tool()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_corpus) -> dict[str, Path]:
    """Two 6-step single-process runs differing only in seed: the noise pair (~2 s each, run at once)."""
    configs = {}
    for name, seed in (("zero3_s1", 1234), ("zero3_s2", 99)):
        folder = tmp_path_factory.mktemp(name)
        configs[name] = tiny_run_config(folder, tiny_corpus, seed=seed, train_iters=STEPS, eval_interval=3,
                                        eval_iters=1, log_interval=1, zero_optimization={"stage": 3})
    for done in run_together(*(lambda c=c: run_deepy("train.py", str(c), timeout=120) for c in configs.values())):
        assert done.returncode == 0, done.stderr[-2000:]
    return {name: cfg.parent / "logs" for name, cfg in configs.items()}


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def write_records(folder: Path, items: list[dict]) -> None:
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))


def final_valid(folder: Path) -> float:
    return [r["validation/lm_loss"] for r in records(folder) if "validation/lm_loss" in r][-1]


def test_two_real_runs_and_a_third_one_percent_worse(two_runs, tmp_path, capsys):
    # A third run: the baseline's history, its validation losses 1% higher (a copy of its folder,
    # config included, so it carries the same preset and tokens per step).
    worse = tmp_path / "worse"
    shutil.copytree(two_runs["zero3_s1"], worse)
    write_records(worse, [{**r, **({"validation/lm_loss": r["validation/lm_loss"] * 1.01}
                                   if "validation/lm_loss" in r else {})} for r in records(worse)])
    out = tmp_path / "out" / "curves"
    code = loss_curves.main([str(two_runs["zero3_s1"]), f"zero3_s2={two_runs['zero3_s2']}", f"worse={worse}",
                             "--baseline", "logs", "--noise-runs", "logs", "zero3_s2",
                             "--output", str(out), "--markdown"])
    printed = capsys.readouterr().out
    assert code == 0
    # The label of a folder without LABEL= is its name: the tiny config logs into <tmp>/logs.
    assert printed.splitlines()[2].startswith("| logs")

    with open(out.with_suffix(".csv")) as stream:
        rows = list(csv.DictReader(stream))
    assert tuple(rows[0]) == loss_curves.CSV_COLUMNS
    assert {r["run"] for r in rows} == {"logs", "zero3_s2", "worse"}
    first = [r for r in rows if r["run"] == "zero3_s2"]
    assert [int(r["iteration"]) for r in first] == list(range(1, STEPS + 1))
    assert {r["preset"] for r in rows} == {"zero3"}
    # tokens = iteration x global batch (8) x seq_length (32), from the run's config
    assert [int(r["tokens"]) for r in first] == [i * 8 * 32 for i in range(1, STEPS + 1)]
    assert [r["valid_loss"] != "" for r in first] == [False, False, True, False, False, True]
    train = [float(r["train_loss"]) for r in first]
    assert float(first[0]["train_loss_smoothed"]) == pytest.approx(train[0])  # debiased EMA starts at the point
    ema = 0.0
    for n, value in enumerate(train, start=1):
        ema = 0.9 * ema + 0.1 * value
    assert float(first[-1]["train_loss_smoothed"]) == pytest.approx(ema / (1 - 0.9 ** STEPS))

    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    # The gaps by hand: valid gap in % of the baseline, and in units of the seeds' spread.
    v1, v2 = final_valid(two_runs["zero3_s1"]), final_valid(two_runs["zero3_s2"])
    noise = abs(v1 - v2)
    table = out.with_suffix(".md").read_text()
    assert f"noise (spread of the seed runs' final validation loss): {noise:.4f}" in table
    cells = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines()[2:5]}
    assert cells["worse"][7] == "+1.00"
    assert float(cells["worse"][8]) == pytest.approx(0.01 * v1 / noise, abs=0.006)
    assert cells["zero3_s2"][7] == f"{100 * (v2 - v1) / v1:+.2f}"
    assert cells["zero3_s2"][9].rstrip(" |") == "yes"  # a seed run is within its own spread
    assert cells["logs (baseline)"][7] == "+0.00"


def test_a_resumed_run_keeps_the_latest_record_of_each_iteration(two_runs, tmp_path):
    """Attempt 1 logged steps 1-6 and died; attempt 2 resumed from the step-3 checkpoint and has
    logged 4-5 so far. Steps 4-5 are attempt 2's, step 6 (attempt 1's, not redone yet) is gone."""
    resumed = tmp_path / "resumed"
    shutil.copytree(two_runs["zero3_s1"], resumed)
    first = records(resumed)
    again = [{**r, "train/lm_loss": r["train/lm_loss"] + 1.0} for r in first
             if r["iteration"] in (4, 5) and "train/lm_loss" in r]
    write_records(resumed, first + again)
    with open(resumed / "metrics.jsonl", "a") as stream:
        stream.write('{"iteration": 5, "train/lm')  # killed while writing a record
    out = tmp_path / "curves"
    assert loss_curves.main([f"resumed={resumed}", "--output", str(out)]) == 0
    with open(out.with_suffix(".csv")) as stream:
        rows = list(csv.DictReader(stream))
    assert [int(r["iteration"]) for r in rows] == [1, 2, 3, 4, 5]
    by_step = {int(r["iteration"]): float(r["train_loss"]) for r in rows}
    original = {r["iteration"]: r["train/lm_loss"] for r in first if "train/lm_loss" in r}
    assert by_step == {**{i: original[i] for i in (1, 2, 3)}, 4: original[4] + 1.0, 5: original[5] + 1.0}
    assert rows[2]["valid_loss"] != ""  # the step-3 evaluation, before the restart point, stays


def test_an_eval_record_of_an_earlier_checkpoint_is_not_a_restart(two_runs, tmp_path):
    """eval.py appends {"iteration": <checkpoint's step>, "eval/...": ...} to the run's metrics.jsonl;
    scoring an earlier checkpoint must not read as a resumed attempt dropping the later steps."""
    run = tmp_path / "evaluated"
    shutil.copytree(two_runs["zero3_s1"], run)
    first = records(run)
    write_records(run, first + [{"iteration": 2, "eval/validation/lm_loss": 9.0, "eval/validation/ppl": 8103.08}])
    history = read_run(run)
    trained = sorted(r["iteration"] for r in first if "train/lm_loss" in r)
    assert history.restarts == 0
    assert sorted(history.series["train/lm_loss"]) == trained
    assert history.series["eval/validation/lm_loss"] == {2: 9.0}


def _one_line_error(args: list[str], capsys) -> str:
    assert loss_curves.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("loss_curves: error: ")
    return err[0]


def test_bad_inputs_are_one_line_errors(two_runs, tmp_path, capsys):
    run = str(two_runs["zero3_s1"])
    assert "no such file" in _one_line_error([str(tmp_path / "missing")], capsys)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert "is empty" in _one_line_error([str(tmp_path / "empty")], capsys)
    other = tmp_path / "other"
    other.mkdir()
    write_records(other, [{"iteration": 1, "runtime/iteration_time": 0.5}])
    assert "no common metric" in _one_line_error([run, str(other)], capsys)
    assert "--baseline 'nope' is not one of the runs: logs" in _one_line_error([run, "--baseline", "nope"], capsys)
    assert "--noise-runs 'x'" in _one_line_error([run, "--noise-runs", "logs", "x"], capsys)
    assert "two runs are labelled 'logs'" in _one_line_error([run, run], capsys)
    assert "--smooth" in _one_line_error([run, "--smooth", "ema:2"], capsys)
    assert "unrecognized arguments" in _one_line_error([run, "--bogus"], capsys)


def test_help_documents_the_table_and_smoothing():
    done = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for text in ("LABEL=RUN", "--baseline", "--noise-runs", "--smooth", "ema:W", "window:N", "spread",
                 "--markdown", "OUTPUT.csv", "exit code 2", "--group-seeds", "pooled"):
        assert text in done.stdout, text


def test_seed_groups_by_hand(tmp_path, capsys):
    """--group-seeds on hand-written histories: base_s1/s2 and opt_s1/s2 (two seeds each), single
    (one run, no seed suffix). Final validation losses: base 4.0, 4.2; opt 4.1, 4.5; single 4.3.

    By hand: means 4.1 and 4.3; pooled seed variance ((0.1^2 + 0.1^2) + (0.2^2 + 0.2^2)) / 2 = 0.05 over
    2 degrees of freedom (single adds none), sigma = 0.2236; opt's gap (4.3 - 4.1) / 4.1 = +4.88%,
    by seed +2.50% (4.1 vs 4.0) and +7.14% (4.5 vs 4.2), over sigma * sqrt(1/2 + 1/2): +0.89; single's
    gap +4.88%, over sigma * sqrt(1 + 1/2) = 0.2739: +0.73. At iteration 2 (valid 3.0, 3.2 / 3.3, 3.3 /
    3.1): opt +6.45%, single 0.00%."""
    finals = {"base_s1": (3.0, 4.0), "base_s2": (3.2, 4.2), "opt_s1": (3.3, 4.1), "opt_s2": (3.3, 4.5),
              "single": (3.1, 4.3)}
    specs = []
    for label, (early, final) in finals.items():
        folder = tmp_path / label
        folder.mkdir()
        write_records(folder, [{"iteration": 1, "train/lm_loss": 5.0},
                               {"iteration": 2, "train/lm_loss": 4.5, "validation/lm_loss": early},
                               {"iteration": 4, "train/lm_loss": 4.0, "validation/lm_loss": final}])
        specs.append(str(folder))
    code = loss_curves.main(specs + ["--baseline", "base_s1", "--group-seeds", "--markdown",
                                     "--output", str(tmp_path / "out" / "curves")])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed == (tmp_path / "out" / "curves.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): [cell.strip(" |") for cell in line.split(" | ")]
            for line in printed.splitlines() if line.startswith("| ")}
    assert rows["base (baseline)"][2:8] == ["2", "4.0000, 4.2000", "4.1000", "+0.00", "s1 +0.00, s2 +0.00", "-"]
    assert rows["opt"][2:8] == ["2", "4.1000, 4.5000", "4.3000", "+4.88", "s1 +2.50, s2 +7.14", "+0.89"]
    assert rows["single"][2:8] == ["1", "4.3000", "4.3000", "+4.88", "-", "+0.73"]
    assert "seed sigma (pooled standard deviation of the final validation loss, 2 degrees of freedom): 0.2236" in printed
    assert rows["2"][1:] == ["+6.45", "+0.00"] and rows["4"][1:] == ["+4.88", "+4.88"]
    assert rows["iteration"][1:] == ["opt gap %", "single gap %"]


def test_seed_groups_without_two_seeds_say_sigma_is_not_measured(tmp_path):
    rows = [loss_curves.Final("a_s1", "zero3", 4, None, 4.0, 4.0), loss_curves.Final("b_s1", "zero3", 4, None, 4.0, 4.4),
            loss_curves.Final("c_s2", "zero3", 4, None, 4.0, None)]  # no validation loss: left out
    groups, sigma, dof = loss_curves.seed_groups(rows, "a_s1")
    assert (sigma, dof) == (None, 0) and [g.name for g in groups] == ["a", "b"]
    assert groups[1].paired_gap_pct == {"s1": pytest.approx(10.0)} and groups[1].gap_in_sigma is None
    assert "seed sigma: not measured" in loss_curves.group_table(groups, "a", sigma, dof, markdown=False)
    with pytest.raises(loss_curves.UsageError, match="has no validation loss"):
        loss_curves.seed_groups(rows, "c_s2")
