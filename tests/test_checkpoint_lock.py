"""The save folder's lock: a second run refused in one line naming the holder, a stale lock taken
over with one line, and the committing rank of a multi-rank run holding it (megatron/checkpointing/lock.py)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_deepy, run_together, tiny_run_config
from megatron.checkpointing import lock as lock_module
from megatron.checkpointing.checkpointer import Checkpointer
from megatron.checkpointing.folders import save_folder_conflict
from megatron.checkpointing.lock import LOCK, FolderInUse, SaveFolderLock, _pid_start
from megatron.checkpointing.rank_files import CheckpointError, load_meta
from megatron.launch.exit_codes import STOPPED_SAVED, SUCCESS, USAGE_ERROR

HOST = socket.gethostname()
BUSY = re.compile(r"(deepy: )?error: the save folder (?P<folder>\S+) is in use by another run \(host (?P<host>\S+), "
                  r"pid (?P<pid>\d+)(, Slurm job \S+)?, since [0-9-]+ [0-9:]+ UTC\); two runs saving into one folder "
                  r"mix their steps: wait for that run to end, or set `save` to another folder")
ALREADY = re.compile(r"(deepy: )?error: the save folder \S+ already holds checkpoints of another run \(newest "
                     r"global_step\d\); to continue that run set `load: \S+`, or to replace its steps as this run "
                     r"saves them set `overwrite_checkpoints: true`")


def _write_lock(folder: Path, **holder) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    content = {"host": HOST, "pid": 1, "pid_start": None, "job": None, "since": time.time(), **holder}
    (folder / LOCK).write_text(json.dumps(content))
    return content


@pytest.fixture
def live_process():
    """Another process on this host, alive while the test runs (the holder of a live lock)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_holder_on_this_host_is_refused_in_one_line_naming_it(tmp_path, live_process):
    folder = tmp_path / "ck"
    _write_lock(folder, pid=live_process.pid, pid_start=_pid_start(live_process.pid), job="4242")
    with pytest.raises(FolderInUse) as err:
        SaveFolderLock(folder).acquire()
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"the save folder {folder} is in use by another run (host "
                                                      f"{HOST}, pid {live_process.pid}, Slurm job 4242, since ")
    # deepy says the same before any rank starts, whatever `load` and `overwrite_checkpoints` say
    for load, overwrite in ((None, False), (str(folder), False), (None, True)):
        assert save_folder_conflict(str(folder), load, overwrite) == message


def test_a_dead_holder_on_this_host_is_taken_over_with_one_line(tmp_path):
    folder = tmp_path / "ck"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(folder, pid=gone.pid)
    lock = SaveFolderLock(folder)
    notice = lock.acquire()
    assert notice.startswith(f"taking over the lock of the save folder {folder} from host {HOST}, pid {gone.pid}, "
                             "since ") and notice.endswith(": its process is gone")
    assert json.loads((folder / LOCK).read_text())["pid"] == os.getpid()
    assert save_folder_conflict(str(folder), None, False) is None  # this process holds it
    lock.release()
    assert not (folder / LOCK).exists()


def test_a_reused_pid_is_not_the_holder(tmp_path, live_process):
    folder = tmp_path / "ck"
    _write_lock(folder, pid=live_process.pid, pid_start=_pid_start(live_process.pid) + 1)
    assert SaveFolderLock(folder).acquire().endswith("its pid now belongs to another process")


def test_other_hosts_the_same_job_and_the_heartbeat(tmp_path, monkeypatch):
    folder = tmp_path / "ck"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    _write_lock(folder, host="node-b", pid=123, job="76")
    beat = (folder / LOCK).stat().st_mtime
    free_at = time.strftime("%H:%M:%S UTC", time.gmtime(beat + lock_module.STALE_AFTER_S))
    with pytest.raises(FolderInUse, match=re.escape(f"host node-b, pid 123, Slurm job 76, since ")) as err:
        SaveFolderLock(folder).acquire()  # fresh: its heartbeat is recent
    assert f"(if that run is gone, its lock is free from {free_at}, 10 min after its last heartbeat); " in str(err.value)
    old = time.time() - lock_module.STALE_AFTER_S - 60
    os.utime(folder / LOCK, (old, old))
    assert re.search(r": no heartbeat for \d+ s", SaveFolderLock(folder).acquire())

    _write_lock(folder, host="node-c", pid=9, job="77", restart=0)  # another step of this very start: alive
    with pytest.raises(FolderInUse, match="host node-c, pid 9, Slurm job 77"):
        SaveFolderLock(folder).acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # this job requeued: the lock is its first start's
    assert SaveFolderLock(folder).acquire().endswith("it was taken by an earlier start of this Slurm job (requeued)")
    (folder / LOCK).write_bytes(b"\x00\xffnot json")
    assert SaveFolderLock(folder).acquire().endswith("the lock file cannot be read (not written by this trainer)")


def test_the_holder_touches_the_lock_while_it_holds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.05)
    lock = SaveFolderLock(tmp_path / "ck")
    lock.acquire()
    os.utime(lock.path, (1, 1))
    deadline = time.time() + 10
    while lock.path.stat().st_mtime < 1000 and time.time() < deadline:
        time.sleep(0.02)
    lock.release()
    assert time.time() < deadline


def test_a_takeover_that_lost_the_race_puts_the_winners_lock_back(tmp_path):
    """Two runs judged the same stale lock; the other one replaced it first. Renaming aside what is
    there now would steal a live lock: it is put back and this run does not take over."""
    folder = tmp_path / "ck"
    stale = _write_lock(folder, host="node-b", pid=5, since=1.0)
    winner = _write_lock(folder, host="node-c", pid=6)
    assert SaveFolderLock(folder)._remove_stale(stale) is False
    assert json.loads((folder / LOCK).read_text()) == winner


def test_a_save_after_another_run_took_the_lock_fails_and_commits_nothing(tmp_path):
    folder = tmp_path / "ck"
    ck = Checkpointer(str(folder), rank=0, world_size=1, barrier=lambda: None)
    ck.lock()
    ck.save(1, {"w": torch.ones(3)}, {})
    _write_lock(folder, host="node-b", pid=99)  # wrongly judged stale elsewhere and taken
    with pytest.raises(CheckpointError, match=rf"could not save checkpoint {re.escape(str(folder))}/global_step2: "
                                              rf"the lock of the save folder .* is now held by host node-b, pid 99"):
        ck.save(2, {"w": torch.ones(3)}, {})
    assert (folder / "latest").read_text() == "global_step1" and not (folder / ".global_step2.partial").exists()
    ck.unlock()
    assert json.loads((folder / LOCK).read_text())["host"] == "node-b"  # not ours: left in place


def test_a_lock_left_by_a_killed_run_is_taken_over_by_the_next_one(tmp_path, tiny_corpus):
    folder = tmp_path / "ck"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(folder, pid=gone.pid)
    assert save_folder_conflict(str(folder), None, False) is None  # deepy: stale, so no refusal
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=1, eval_iters=0, save=str(folder))
    proc = run_deepy("train.py", str(cfg))
    assert proc.returncode == SUCCESS, proc.stderr[-3000:]
    taken = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(taken) == 1, proc.stderr[-3000:]
    assert taken[0].startswith(f"warning: taking over the lock of the save folder {folder} from host {HOST}, "
                               f"pid {gone.pid}, since ") and taken[0].endswith(": its process is gone")
    assert not (folder / LOCK).exists()  # released when the run ended


def test_two_runs_started_at_once_into_one_folder_one_is_refused_and_nothing_mixes(tmp_path, tiny_corpus):
    """The probe of issue 39: both passed deepy's look at the empty folder, and one step ended with
    one run's rank files and the other's meta.json."""
    folder = tmp_path / "ck"
    for seed in (11, 12):
        (tmp_path / f"run{seed}").mkdir()
    cfgs = [tiny_run_config(tmp_path / f"run{seed}", tiny_corpus, train_iters=4, eval_iters=0, log_interval=1,
                            save=str(folder), checkpoint_factor=1, seed=seed) for seed in (11, 12)]
    procs = run_together(*(lambda cfg=cfg: run_deepy("train.py", str(cfg)) for cfg in cfgs))
    codes = sorted(p.returncode for p in procs)
    assert codes == [SUCCESS, USAGE_ERROR], [p.stderr[-2000:] for p in procs]
    winner = next(i for i, p in enumerate(procs) if p.returncode == SUCCESS)
    loser = procs[1 - winner]
    refusal = [line for line in loser.stderr.splitlines() if "error:" in line][0]
    # the lock, or (the other run already saved a step when this one looked) its steps
    assert BUSY.fullmatch(refusal) or ALREADY.fullmatch(refusal), refusal
    assert "step 1/" not in loser.stdout
    seeds = {load_meta(step)["config"]["data"]["seed"] for step in folder.glob("global_step*")}
    assert seeds == {(11, 12)[winner]} and len(list(folder.glob("global_step*"))) == 4


def test_on_four_ranks_rank_0_holds_the_lock_until_the_stop_saves(tmp_path, tiny_corpus):
    """Only the committing rank takes the lock; a second run is refused by deepy naming that process;
    Slurm's warning signal then saves every rank's file (each with its checksum) and frees the folder."""
    from megatron.checkpointing.folders import latest_step_dir
    from megatron.checkpointing.rank_files import load_rank_state
    folder = tmp_path / "ck"
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=5000, eval_iters=0, log_interval=1,
                          train_batch_size=16, train_micro_batch_size_per_gpu=2, save=str(folder))
    layout = [str(REPO / "configs/sim-2x2.yml"), str(REPO / "configs/zero_topo.yml")]
    proc = subprocess.Popen([sys.executable, str(REPO / "deepy.py"), "train.py", str(cfg), *layout], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 2/"):
                break
        holder = json.loads((folder / LOCK).read_text())
        environ = Path(f"/proc/{holder['pid']}/environ").read_bytes().split(b"\0")
        assert b"RANK=0" in environ and holder["host"] == HOST
        second = run_deepy("train.py", str(cfg), *layout, "--set", "overwrite_checkpoints=true",
                           "--set", f"log_dir={tmp_path / 'second'}")
        assert second.returncode == USAGE_ERROR, second.stderr[-3000:]
        refusal = second.stderr.strip().splitlines()
        assert len(refusal) == 1 and BUSY.fullmatch(refusal[0]).group("pid") == str(holder["pid"]), refusal
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == STOPPED_SAVED, err[-3000:]
    assert not (folder / LOCK).exists()
    step = latest_step_dir(folder)
    assert sorted(load_meta(step)["rank_files"]) == [f"rank_{r:05d}.pt" for r in range(4)]
    for rank in range(4):
        load_rank_state(step, rank)  # each file checked against the checksum its rank computed
