"""Slurm's warning signal (SIGTERM/SIGUSR1) -> every rank saves at the same step and exits with the
code that tells the job script to requeue (megatron/launch/exit_codes.py), and deepy exits with it too."""
import signal
import subprocess
import sys

import pytest

from conftest import REPO, tiny_run_config
from megatron.launch.exit_codes import STOPPED_SAVED, STOPPED_UNSAVED

SIMULATED_4 = [str(REPO / "configs/sim-2x2.yml"), str(REPO / "configs/zero_topo.yml")]


@pytest.mark.parametrize("sig, layout, save, code", [
    # slow: test_checkpoint_lock.py's 4-rank USR1 stop checks the same exit 75 and every rank's file
    pytest.param(signal.SIGUSR1, SIMULATED_4, True, STOPPED_SAVED, marks=pytest.mark.slow),
    (signal.SIGTERM, [], True, STOPPED_SAVED),
    (signal.SIGTERM, [], False, STOPPED_UNSAVED),
], ids=["usr1-4-ranks", "term-1-rank", "term-no-save"])
def test_signal_saves_then_exits_with_the_stop_code(tmp_path, tiny_corpus, sig, layout, save, code):
    from megatron.checkpointing.folders import latest_step_dir
    from megatron.checkpointing.rank_files import load_meta
    folder = tmp_path / "ck"
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=5000, eval_iters=0, log_interval=1,
                          train_batch_size=16, train_micro_batch_size_per_gpu=2,
                          **({"save": str(folder)} if save else {}))
    proc = subprocess.Popen([sys.executable, str(REPO / "deepy.py"), "train.py", str(cfg), *layout],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step 3/"):
            proc.send_signal(sig)  # to deepy, as Slurm's scancel does; deepy forwards it to the ranks
            break
    out, err = proc.communicate(timeout=300)
    seen.append(out)
    assert proc.returncode == code, err[-3000:]
    assert "exited with code" not in err  # a stop is not reported as a failed rank
    text = "".join(seen)
    assert "stop signal received" in text
    if not save:
        assert "saved checkpoint" not in text
        return
    step_dir = latest_step_dir(folder)
    assert step_dir is not None and 3 <= load_meta(step_dir)["iteration"] < 5000
    assert load_meta(step_dir)["world_size"] == (4 if layout else 1)
    assert f"saved checkpoint {step_dir}" in text
