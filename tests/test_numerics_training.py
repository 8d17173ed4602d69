"""A diverging run stops, says why, exits non-zero, and keeps its last good checkpoints.

lr = 1e6 makes the loss non-finite from the second step on; lr = 1e3 keeps the loss finite but
drives the gradient norm past fp32's range after ten steps. The loop must skip those steps on
every rank (``train/skipped_steps`` counts them, the learning-rate schedule does not advance),
refuse to save them, and stop after ``max_consecutive_skipped_steps`` with exit code 2 and one line;
`latest` stays the last clean step, and with ``keep_last_n_checkpoints: 2`` the two last clean
checkpoints survive (a saved non-finite state would have pruned them).
"""
from __future__ import annotations

import json
import math

import pytest

from conftest import run_deepy, tiny_run_config
from megatron.checkpointing.folders import latest_step_dir


# lr 1e6: NaN gradients from step 2 (one clean checkpoint, step 1). lr 1e3: finite losses throughout,
# 10 clean steps, then gradient norms beyond fp32's range (the ZeRO-topo engine used to crash there,
# exit 1) with one more clean step among them: the last two clean checkpoints must survive.
@pytest.mark.parametrize("lr", [pytest.param(1.0e6, marks=pytest.mark.slow), 1.0e3], ids=["nan", "norm-beyond-fp32"])
def test_a_diverging_run_stops_non_zero_and_keeps_the_last_good_checkpoint(tmp_path, tiny_corpus, lr):
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=40, eval_iters=0, log_interval=1,
                          optimizer={"type": "Adam", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1.0e-8}},
                          min_lr=lr / 10, warmup=0.5, max_consecutive_skipped_steps=5,
                          save=str(tmp_path / "ck"), checkpoint_factor=1, keep_last_n_checkpoints=2,
                          topology={"simulate": [1, 2]})
    done = run_deepy("train.py", str(cfg))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "5 steps in a row were skipped" in done.stderr and "diverged" in done.stderr
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = {r["iteration"]: r for r in records if "train/lm_loss" in r}
    skipped_at = [it for it, r in sorted(train.items()) if r["train/skipped_steps"] > train.get(it - 1, {}).get("train/skipped_steps", 0)]
    last = max(train)
    run = list(range(last - 4, last + 1))  # the run ends with its 5 skipped steps in a row
    assert skipped_at[-5:] == run and last - 5 not in skipped_at, skipped_at
    clean = [it for it in sorted(train) if it not in skipped_at]
    assert all(math.isfinite(train[it]["train/lm_loss"]) for it in clean)
    # The schedule stands still while steps are skipped: every step of the run used its first one's lr.
    assert len({train[it]["train/learning_rate"] for it in run}) == 1
    assert train[run[0]]["train/learning_rate"] > train[run[0] - 1]["train/learning_rate"]  # warmup
    # The last saved step is the last clean one; no skipped step was written, so keep_last_n (2) never
    # pruned the last clean checkpoints for states the run could not use.
    latest = latest_step_dir(str(tmp_path / "ck"))
    assert latest is not None and latest.name == f"global_step{clean[-1]}", latest
    kept = sorted(int(d.name.removeprefix("global_step")) for d in (tmp_path / "ck").glob("global_step*"))
    assert kept == clean[-2:], (kept, clean)
    assert "not saving step" in done.stdout + done.stderr
