"""A diverging run stops, says why, exits non-zero, and keeps its last good checkpoint.

lr = 1e6 makes the loss non-finite from the second step on. The loop must skip those steps on
every rank (``train/skipped_steps`` counts them, the learning-rate schedule does not advance),
refuse to save them, and stop after ``max_consecutive_skipped_steps`` with exit code 2 and one line;
`latest` stays the last step whose loss was finite.
"""
from __future__ import annotations

import json
import math

from conftest import run_deepy, tiny_run_config
from megatron.checkpointing.checkpointer import latest_step_dir


def test_a_diverging_run_stops_non_zero_and_keeps_the_last_good_checkpoint(tmp_path, tiny_corpus):
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=40, eval_iters=0, log_interval=1,
                          optimizer={"type": "Adam", "params": {"lr": 1.0e6, "betas": [0.9, 0.95], "eps": 1.0e-8}},
                          min_lr=1.0e5, warmup=0.5, max_consecutive_skipped_steps=5,
                          save=str(tmp_path / "ck"), checkpoint_factor=1, topology={"simulate": [1, 2]})
    done = run_deepy("train.py", str(cfg))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "5 steps in a row were skipped" in done.stderr and "diverged" in done.stderr
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = {r["iteration"]: r for r in records if "train/lm_loss" in r}
    skipped_at = [it for it, r in sorted(train.items()) if r["train/skipped_steps"] > train.get(it - 1, {}).get("train/skipped_steps", 0)]
    assert len(skipped_at) == 5 and skipped_at == list(range(skipped_at[0], skipped_at[0] + 5))
    first_bad = skipped_at[0]
    assert all(math.isfinite(train[it]["train/lm_loss"]) for it in range(1, first_bad))
    # The schedule stands still while steps are skipped: every skipped step ran at the first one's lr.
    assert len({train[it]["train/learning_rate"] for it in skipped_at}) == 1
    assert train[first_bad]["train/learning_rate"] > train[first_bad - 1]["train/learning_rate"]  # warmup
    # The last saved step is the last finite one; nothing later was written.
    latest = latest_step_dir(str(tmp_path / "ck"))
    assert latest is not None and latest.name == f"global_step{first_bad - 1}", latest
    assert "not saving step" in done.stdout + done.stderr
