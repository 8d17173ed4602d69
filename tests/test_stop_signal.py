"""Slurm's warning signal (SIGTERM/SIGUSR1) -> every rank saves at the same step and exits cleanly."""
import signal
import subprocess
import sys

import pytest

from conftest import REPO, tiny_run_config


@pytest.mark.parametrize("sig", [signal.SIGUSR1])
def test_signal_saves_then_exits_on_all_ranks(tmp_path, tiny_corpus, sig):
    from megatron.checkpointing.checkpointer import latest_step_dir, load_meta
    save = tmp_path / "ck"
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=5000, eval_iters=0, log_interval=1,
                          train_batch_size=16, train_micro_batch_size_per_gpu=2, save=str(save))
    proc = subprocess.Popen([sys.executable, str(REPO / "deepy.py"), "train.py", str(cfg),
                             str(REPO / "configs/sim-2x2.yml"), str(REPO / "configs/zero_topo.yml")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step 3/"):
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=300)
    seen.append(out)
    assert proc.returncode == 0, err[-3000:]
    text = "".join(seen)
    assert "stop signal received" in text
    step_dir = latest_step_dir(save)
    assert step_dir is not None and 3 <= load_meta(step_dir)["iteration"] < 5000
    assert load_meta(step_dir)["world_size"] == 4
