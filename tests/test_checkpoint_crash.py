"""A process SIGKILLed in the middle of a save leaves the previous step as `latest`; resume loads it."""
import json
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest

from conftest import REPO, run_deepy, tiny_run_config

KILLER = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {repo!r})
    from megatron.checkpointing.checkpointer import Checkpointer
    ck = Checkpointer({save!r}, rank=0, world_size=1, barrier=lambda: None)
    victim = {victim!r}

    def die(*args, **kwargs):
        f = args[1] if len(args) > 1 else None
        if hasattr(f, "write"):
            f.write("half a record" if "b" not in getattr(f, "mode", "b") else b"half a tensor")
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    if victim == "rank_file":
        torch.save = die
    else:
        import json
        json.dump = die
    ck.save({step}, {{"engine": None}}, {{}})
""")


@pytest.mark.parametrize("victim", ["rank_file", "meta"])
def test_sigkill_during_save_keeps_previous_latest(tmp_path, tiny_corpus, tiny_two_step_save, victim):
    from megatron.checkpointing.folders import latest_step_dir
    save = tmp_path / "ck"
    shutil.copytree(tiny_two_step_save, save)  # this config's 2 steps, trained once (conftest)
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=2, eval_iters=0, log_interval=1, save=str(save))
    assert (save / "latest").read_text() == "global_step2"

    script = KILLER.format(repo=str(REPO), save=str(save), victim=victim, step=3)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert (save / ".global_step3.partial").is_dir()
    assert (save / "latest").read_text() == "global_step2"
    with pytest.warns(UserWarning, match="half-written"):
        assert latest_step_dir(save).name == "global_step2"

    resumed = run_deepy("train.py", str(cfg), "--set", "train_iters=3", "--set", f"load={save}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "global_step2" in resumed.stdout
    assert (save / "latest").read_text() == "global_step3"
    assert not (save / ".global_step3.partial").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest_step_dir(save).name == "global_step3"
