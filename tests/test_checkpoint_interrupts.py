"""Every interrupt path is one line: Ctrl-C at deepy (the ranks save, then stop), a second Ctrl-C
while they save (stopped at once, nothing half-committed), SIGINT on a rank started by hand or by srun
(saves like SIGTERM; outside the loop, or a second one, one line). docs/checkpoints.md, docs/errors.md."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, tiny_run_config
from megatron.checkpointing.folders import latest_step_dir
from megatron.checkpointing.rank_files import load_meta, load_rank_state
from megatron.launch.exit_codes import STOPPED_SAVED

LAUNCH_LINE = re.compile(r"deepy: \d+ rank\(s\), launcher ")
INTERRUPTED = 130
AGAIN = ("deepy: interrupted again: stopped the ranks without waiting for their save (a step cut short is not "
         "committed: `latest` names the last complete one)")


def _start(argv: list[str]) -> subprocess.Popen:
    # SIGINT at its default, as a terminal starts it (a background shell job starts with it ignored)
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_line(proc: subprocess.Popen, prefix: str) -> None:
    for line in proc.stdout:
        if line.startswith(prefix):
            return
    raise AssertionError(f"no line starting with {prefix!r}: {proc.stderr.read()[-3000:]}")


def _interrupt_at_step_2(argv: list[str]) -> tuple[int, str, str]:
    """Start ``argv``, send one SIGINT once it logs step 2, and wait: (exit code, the rest of stdout, stderr)."""
    proc = _start(argv)
    try:
        _wait_for_line(proc, "step 2/")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out, err


def _no_leftovers(folder: Path) -> Path:
    """The newest step `latest` leads to, every one of its rank files checked against its checksum."""
    step = latest_step_dir(folder)
    assert step is not None and not step.name.endswith(".partial")
    for rank in range(load_meta(step)["world_size"]):
        load_rank_state(step, rank)
    return step


def test_ctrl_c_saves_then_stops_the_ranks(tmp_path, tiny_corpus):
    folder = tmp_path / "ck"
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=5000, eval_iters=0, log_interval=1, save=str(folder))
    code, _, err = _interrupt_at_step_2([sys.executable, str(REPO / "deepy.py"), "train.py", str(cfg)])
    assert code == INTERRUPTED, err[-3000:]
    assert [line for line in err.splitlines() if not LAUNCH_LINE.match(line)] == ["deepy: interrupted; stopped all ranks"]
    assert load_meta(_no_leftovers(folder))["iteration"] >= 2  # the ranks saved the step they were at


def test_a_second_ctrl_c_while_the_ranks_save_is_one_line_and_leaves_no_half_step(tmp_path, tiny_corpus):
    """A model whose save takes a moment (~150 MB), so the second Ctrl-C lands inside it: the test waits
    for the step's .partial folder to appear before sending it."""
    folder = tmp_path / "ck"
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=5000, eval_iters=0, log_interval=1, save=str(folder),
                          hidden_size=512, num_layers=4, num_attention_heads=8, checkpoint_factor=2)
    proc = _start([sys.executable, str(REPO / "deepy.py"), "train.py", str(cfg)])
    try:
        _wait_for_line(proc, "step 3/")  # step 2 saved: a complete step to fall back on
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 120
        while not list(folder.glob(".global_step*.partial")) and time.monotonic() < deadline:
            time.sleep(0.001)
        saving = [p.name for p in folder.glob(".global_step*.partial")]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert saving, "the save was never seen in progress"
    assert proc.returncode == INTERRUPTED, err[-3000:]
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if not LAUNCH_LINE.match(line)] == [AGAIN]
    time.sleep(1)  # the ranks die with deepy (their parent-death signal)
    ranks = subprocess.run(["pgrep", "-f", str(cfg.parent / "logs")], capture_output=True, text=True).stdout.split()
    assert not ranks, ranks
    step = _no_leftovers(folder)  # `latest` (or the newest complete step): whole, and verified
    assert step.name == "global_step2" or load_meta(step)["iteration"] > 2


def _config_json(tmp_path: Path, cfg_yaml: Path) -> Path:
    from megatron.config import load_config, save_config_json
    return save_config_json(load_config([str(cfg_yaml)], env={}, notices=[]), tmp_path / "run.json")


@pytest.fixture
def long_run_json(tmp_path, tiny_corpus) -> tuple[Path, Path]:
    folder = tmp_path / "ck"
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=5000, eval_iters=0, log_interval=1, save=str(folder))
    return _config_json(tmp_path, cfg), folder


def test_sigint_on_a_rank_saves_and_exits_like_sigterm(long_run_json):
    """train.py started by hand (or a Ctrl-C srun passes on to its tasks)."""
    config_json, folder = long_run_json
    code, out, err = _interrupt_at_step_2([sys.executable, str(REPO / "train.py"), "--neox-config-json", str(config_json)])
    assert code == STOPPED_SAVED, err[-3000:]
    assert "Traceback" not in err and "stop signal received" in out
    assert f"saved checkpoint {_no_leftovers(folder)}" in out


def test_a_second_sigint_on_a_rank_is_one_line(long_run_json):
    config_json, _ = long_run_json
    proc = _start([sys.executable, str(REPO / "train.py"), "--neox-config-json", str(config_json)])
    try:
        _wait_for_line(proc, "step 2/")
        proc.send_signal(signal.SIGINT)
        time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = [line for line in err.splitlines() if line.startswith("train.py")]
    if proc.returncode == STOPPED_SAVED:  # the first one's save and exit beat the second signal
        pytest.skip("the rank had saved and left before the second SIGINT arrived")
    assert proc.returncode == INTERRUPTED, err[-3000:]
    assert lines == ["train.py: second stop signal (SIGINT); exiting hard; exit code 130"] and "Traceback" not in err


def test_sigint_before_the_training_loop_is_one_line(long_run_json):
    """Torch's imports and the build take seconds: a Ctrl-C there has nothing to save."""
    config_json, folder = long_run_json
    proc = _start([sys.executable, str(REPO / "train.py"), "--neox-config-json", str(config_json)])
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == INTERRUPTED, err[-3000:]
    assert err.strip().splitlines() == ["train.py: interrupted (SIGINT) while not training: nothing to save; exit code 130"]
    assert "step 1/" not in out and latest_step_dir(folder) is None
