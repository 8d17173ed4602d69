"""The Frontier loss-curve scripts on the fake Slurm of test_slurm_jobs.py: loss_curves.sbatch trains a
run through the slurm launcher with the budget's step count and draws the curves; bad arguments and
dry runs stop early; submit_loss_curves.sh submits the four runs (and a noise run) with matching sizes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, tiny_run_config, train_losses
from megatron.launch.launcher import free_port
from test_slurm_jobs import fake_slurm, sbatch_like, srun_calls  # noqa: F401  (fake_slurm: a fixture)

SCRIPT = REPO / "tools/slurm/frontier/loss_curves.sbatch"
SUBMIT = REPO / "tools/slurm/frontier/submit_loss_curves.sh"


def test_a_run_trains_its_token_budget_and_draws_the_curves(tmp_path, tiny_corpus, fake_slurm):
    # One task (test_slurm_jobs.py trains on 2 x 2 through the same srun path): the budget's steps.
    run_cfg = tiny_run_config(tmp_path, tiny_corpus, launcher="slurm", device="cpu", eval_iters=1, log_interval=1,
                              zero_optimization={"stage": 3})
    runs = tmp_path / "runs"
    # 5 steps of 8 sequences of the run's 32 tokens (the banner and the step count read seq_length from the configs)
    proc = sbatch_like(fake_slurm, SCRIPT, ["20B", "zero3"], nodes=1,
                       extra_env={"NEOX_CONFIGS": str(run_cfg), "SLURM_NTASKS_PER_NODE": "1",
                                  "MASTER_PORT": str(free_port()), "LOSS_CURVES_DIR": str(runs),
                                  "TOKENS": str(5 * 8 * 32), "GLOBAL_BATCH": "8", "SEED": "7"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "20B zero3 seed 7: 5 steps x 8 x 32 tokens" in proc.stderr
    run = runs / "20B_zero3_s7"
    written = json.loads(sorted((run / "logs").glob("neox_config_*.json"))[-1].read_text())
    assert (written["training"]["train_iters"], written["lr_schedule"]["lr_decay_iters"]) == (5, 5)
    assert (written["data"]["seed"], written["training"]["eval_interval"]) == (7, 1)
    assert written["checkpoint"]["save"] == written["checkpoint"]["load"] == str(run / "checkpoints")
    assert sorted(train_losses(run / "logs")) == [1, 2, 3, 4, 5]
    # the training step (env.sh's exit trap runs a clean-up srun after it)
    train_calls = [call for call in srun_calls(fake_slurm) if "train.py" in call]
    assert len(train_calls) == 1 and train_calls[0][5:7] == [str(Path(sys.prefix) / "bin" / "python"), "train.py"]
    # The curves of every 20B run so far, this one the baseline.
    for suffix in (".png", ".csv", ".md"):
        assert (runs / f"20B_loss_curves{suffix}").stat().st_size > 0
    assert "| 20B_zero3_s7 (baseline) | zero3 | 5 |" in (runs / "20B_loss_curves.md").read_text()


def test_bad_arguments_and_dry_runs_stop_before_training(tmp_path, fake_slurm):
    proc = sbatch_like(fake_slurm, SCRIPT, ["30B"], nodes=1, extra_env={"LOSS_CURVES_DIR": str(tmp_path)})
    assert proc.returncode == 2 and proc.stderr.strip() == "unknown MODEL 30B: use 10B or 20B"
    proc = sbatch_like(fake_slurm, SCRIPT, ["10B", "zero2"], nodes=1, extra_env={"LOSS_CURVES_DIR": str(tmp_path)})
    assert proc.returncode == 2 and "unknown PRESET zero2" in proc.stderr
    assert not fake_slurm["srun_log"].exists()  # refused before env.sh started anything
    proc = sbatch_like(fake_slurm, SCRIPT, ["10B", "zero_topo", "--dry-run"], nodes=32,
                       extra_env={"LOSS_CURVES_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "sharding: zero_topo, (w, g, os) = (2, 8, 256) on N = 256" in proc.stdout
    assert "10B zero_topo seed 1234: 954 steps x 1024 x 2048 tokens" in proc.stderr  # 2e9 tokens
    assert not list(tmp_path.glob("*_loss_curves.*"))  # a dry run draws nothing


def test_submit_script_sends_four_runs_with_one_batch_per_model(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sbatch.log"
    (bin_dir / "sbatch").write_text('#!/bin/sh\necho "GLOBAL_BATCH=$GLOBAL_BATCH SEED=${SEED:-} $*" >> "$SBATCH_LOG"\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SBATCH_LOG": str(log),
           "ACCOUNT": "abc123", "NOISE_SEED": "4321"}
    env.pop("SEED", None)
    done = subprocess.run(["bash", str(SUBMIT), "--set", "log_interval=5"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    script = "tools/slurm/frontier/loss_curves.sbatch"
    assert log.read_text().splitlines() == [
        f"GLOBAL_BATCH=1024 SEED= -A abc123 -N 32 -J loss-curves-10B-zero3 {script} 10B zero3 --set log_interval=5",
        f"GLOBAL_BATCH=1024 SEED= -A abc123 -N 32 -J loss-curves-10B-zero_topo {script} 10B zero_topo --set log_interval=5",
        f"GLOBAL_BATCH=1024 SEED=4321 -A abc123 -N 32 -J loss-curves-10B-zero3-s4321 {script} 10B zero3 --set log_interval=5",
        f"GLOBAL_BATCH=1536 SEED= -A abc123 -N 48 -J loss-curves-20B-zero3 {script} 20B zero3 --set log_interval=5",
        f"GLOBAL_BATCH=1536 SEED= -A abc123 -N 48 -J loss-curves-20B-zero_topo {script} 20B zero_topo --set log_interval=5",
        f"GLOBAL_BATCH=1536 SEED=4321 -A abc123 -N 48 -J loss-curves-20B-zero3-s4321 {script} 20B zero3 --set log_interval=5",
    ]
    env.pop("ACCOUNT")
    done = subprocess.run(["bash", str(SUBMIT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "set ACCOUNT" in done.stderr
