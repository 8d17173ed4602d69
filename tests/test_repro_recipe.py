"""The loss-curve recipe without training it (make repro takes ~an hour): its configs are a small model
of NeoX-20B's shape family with the presets its runs name, its cadence is the model config's, and
finished runs are not redone. tests/test_loss_curves.py covers the figure and the table."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from conftest import REPO
from megatron.config import config_to_dict, load_config
from megatron.logging.run_history import preset_label
from megatron.model.sizes import parameter_count

spec = importlib.util.spec_from_file_location("repro_loss_curves", REPO / "tools" / "repro_loss_curves.py")
repro = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = repro  # its dataclasses look their module up
spec.loader.exec_module(repro)

LABELS = {
    "zero3_s1": "zero3", "zero3_s2": "zero3", "zeropp_qwz_qgz": "zeropp (INT8 weights, INT4 grads)",
    "zero_topo_int8_int4": "zero_topo (INT8 weights, INT4 grads)",
    "zero_topo_int8_int4_ef": "zero_topo (INT8 weights, INT4 grads, error feedback)",
}


def run_config(run, layout="configs/sim-2x2x2.yml", steps=None):
    cmd = repro.run_command(run, REPO / "runs" / "x", steps or 160, layout)
    files = [str(REPO / c) for c in cmd[3:6]]
    sets = [cmd[i + 1] for i in range(6, len(cmd), 2)]
    return load_config(files, sets, env={}, notices=[])


@pytest.mark.parametrize("layout,world", [("configs/sim-2x2x2.yml", 8), ("configs/sim-2x2.yml", 4)])
@pytest.mark.parametrize("run", repro.RUNS, ids=lambda r: r.name)
def test_every_run_is_the_small_20B_shape_with_its_preset(run, layout, world):
    cfg = run_config(run, layout)
    big = load_config([str(REPO / "configs/20B.yml")], env={}, notices=[]).model
    m = cfg.model
    assert 10e6 <= parameter_count(m, 4096) <= 30e6
    assert m.hidden_size // m.num_attention_heads == big.hidden_size // big.num_attention_heads == 96
    for key in ("rotary_pct", "gpt_j_residual", "no_weight_tying", "pos_emb", "norm", "init_method",
                "output_layer_init_method", "hidden_dropout", "attention_dropout"):
        assert getattr(m, key) == getattr(big, key), key
    assert cfg.topology.world_size == world and cfg.training.train_batch_size == 32
    assert preset_label(config_to_dict(cfg)) == LABELS[run.name]
    assert cfg.data.seed == run.seed and cfg.checkpoint.save == cfg.checkpoint.load


def test_the_seeds_differ_only_for_the_noise_run():
    assert {r.name: r.seed for r in repro.RUNS if r.seed != 1234} == {"zero3_s2": 4321}
    assert repro.BASELINE == "zero3_s1" and set(repro.NOISE_RUNS) == {"zero3_s1", "zero3_s2"}


def test_the_model_config_holds_the_full_recipes_cadence():
    """configs/repro/model.yml run by hand is the full recipe's run: the driver's --set values for
    its train_iters are the file's own."""
    cfg = load_config([str(REPO / repro.MODEL)], env={}, notices=[])
    steps = cfg.training.train_iters
    sets = dict(s.split("=") for s in repro.run_settings(steps))
    assert int(sets["eval_interval"]) == cfg.training.eval_interval
    assert int(sets["checkpoint_factor"]) == cfg.checkpoint.checkpoint_factor
    short = dict(s.split("=") for s in repro.run_settings(20))
    assert (short["eval_interval"], short["checkpoint_factor"]) == ("2", "5")


def test_finished_runs_are_skipped_and_partial_ones_resume(tmp_path):
    def log(folder, steps, valid_at):  # in the trainer's order: a step, then its evaluation
        folder.mkdir(parents=True)
        lines = []
        for i in range(1, steps + 1):
            lines += [{"iteration": i, "train/lm_loss": 5.0}] + ([{"iteration": i, "validation/lm_loss": 5.0}]
                                                                  if i in valid_at else [])
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))

    log(tmp_path / "done", 20, [10, 20])
    log(tmp_path / "partial", 12, [10])
    log(tmp_path / "no_final_eval", 20, [10])  # killed between the last step and its evaluation
    assert repro.finished(tmp_path / "done", 20)
    assert not repro.finished(tmp_path / "partial", 20) and repro.logged_steps(tmp_path / "partial") == 12
    assert not repro.finished(tmp_path / "no_final_eval", 20)
    assert not repro.finished(tmp_path / "missing", 20) and repro.logged_steps(tmp_path / "missing") == 0


def test_a_failed_run_stops_the_recipe_with_its_code(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(repro, "build_data", lambda model: None)
    monkeypatch.setattr(repro, "POLL_S", 0.05)
    monkeypatch.setattr(repro, "run_command", lambda run, folder, steps, layout: [
        sys.executable, "-c", f"print('training {run.name}'); raise SystemExit(3)"])
    code = repro.main(["--steps", "2", "--runs", "zero3_s1", "zero3_s2", "--root", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 3
    assert "training zero3_s1" in err  # the log's tail
    assert err.strip().splitlines()[-1] == (f"repro: error: zero3_s1 exited with code 3; its output: "
                                            f"{tmp_path / 'zero3_s1' / 'train.log'}; run the same command again "
                                            f"to resume it")
    assert not (tmp_path / "zero3_s2").exists()  # the recipe stopped at the first failure


def test_a_recipe_whose_runs_all_finished_only_redraws(tmp_path, monkeypatch, capsys):
    for name in ("zero3_s1", "zero3_s2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            '{"iteration": 2, "train/lm_loss": 5.0}\n{"iteration": 2, "validation/lm_loss": 5.1}\n')
    drawn = []
    monkeypatch.setattr(repro, "build_data", lambda model: None)
    monkeypatch.setattr(repro, "run_command", lambda *args: pytest.fail("a finished run was started again"))
    monkeypatch.setattr(repro, "compare", lambda root, runs, steps, layout, publish: drawn.append(
        ([r.name for r in runs], steps)) or 0)
    assert repro.main(["--steps", "2", "--runs", "zero3_s1", "zero3_s2", "--root", str(tmp_path)]) == 0
    assert drawn == [(["zero3_s1", "zero3_s2"], 2)]
    assert "zero3_s1: finished earlier" in capsys.readouterr().out


def test_the_comparison_groups_the_seeds(tmp_path):
    """compare() runs tools/loss_curves.py for real: the noise pair and the seed groups' tables."""
    for name, valid in (("zero3_s1", 5.1), ("zero3_s2", 5.3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            f'{{"iteration": 2, "train/lm_loss": 5.0}}\n{{"iteration": 2, "validation/lm_loss": {valid}}}\n')
    runs = [run for run in repro.RUNS if run.name in ("zero3_s1", "zero3_s2")]
    assert repro.compare(tmp_path, runs, 2, repro.LAYOUT, None) == 0
    table = (tmp_path / "loss_curves.md").read_text()
    assert "noise (spread of the seed runs' final validation loss): 0.2000" in table
    # two seeds of one setup: sigma = sqrt((0.1^2 + 0.1^2) / 1)
    assert "seed sigma (pooled standard deviation of the final validation loss, 1 degrees of freedom): 0.1414" in table
    assert "| zero3 (baseline) | ? | 2 | 5.1000, 5.3000 | 5.2000 | +0.00 | s1 +0.00, s2 +0.00 | - |" in table
    assert "% above the baseline group" not in table  # no setup but the baseline's: no gaps by evaluation
