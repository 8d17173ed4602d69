"""Checksums per rank file, pruning that never drops the last good step, and a `latest` that cannot
be used (docs/checkpoints.md, "Checkpoints a scheduler can trust")."""
from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from conftest import run_deepy, tiny_run_config
from dist_harness import run_ranks
from megatron.checkpointing.checkpointer import Checkpointer
from megatron.checkpointing.folders import CheckpointWarning, latest_step_dir
from megatron.checkpointing.rank_files import (CheckpointError, file_checksum, load_rank_state, rank_file,
                                               write_rank_state)
from megatron.launch.exit_codes import SUCCESS, USAGE_ERROR


def flip(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``path``: its length stays, its content does not."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def _save(folder: Path, step: int, keep=None, value: float = 1.0) -> Path:
    ck = Checkpointer(str(folder), rank=0, world_size=1, barrier=lambda: None, keep_last_n=keep)
    return ck.save(step, {"w": torch.full((4096,), value)}, {})


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --- the checksum --------------------------------------------------------------------------------

def test_the_checksum_made_while_writing_is_the_files(tmp_path):
    """torch.save writes front to back through the checksumming file, so what it sums is the file."""
    state = {"engine": {"pieces": [{"name": "a", "master": torch.randn(300_000)}]}, "rng": torch.get_rng_state()}
    written = write_rank_state(tmp_path / "r.pt", state)
    assert written == file_checksum(tmp_path / "r.pt")
    assert written["bytes"] == (tmp_path / "r.pt").stat().st_size > 1_200_000


def test_flipped_bytes_are_refused_in_one_line_naming_the_file_and_both_sums(tmp_path):
    step = _save(tmp_path / "ck", 1)
    _save(tmp_path / "ck", 2)
    recorded = json.loads((step.parent / "global_step2" / "meta.json").read_text())["rank_files"]["rank_00000.pt"]
    path = rank_file(step.parent / "global_step2", 0)
    flip(path)
    found = file_checksum(path)["crc32"]
    assert found != recorded["crc32"]
    with pytest.raises(CheckpointError) as err:
        load_rank_state(step.parent / "global_step2", 0)
    assert str(err.value) == (f"{path} is damaged: crc32 {found}, its save recorded {recorded['crc32']}; to "
                              f"resume from the step before it write global_step1 into {step.parent / 'latest'}")
    assert torch.equal(load_rank_state(step, 0)["w"], torch.ones(4096))  # the good step still loads


def test_a_cut_file_is_refused_by_its_length(tmp_path):
    step = _save(tmp_path / "ck", 1)
    path = rank_file(step, 0)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"is damaged: it holds \d+ bytes, its save wrote \d+; no earlier "
                                              r"step is complete"):
        load_rank_state(step, 0)


def _save_worker(rank: int, world_size: int, save_dir: str) -> dict:
    """Four ranks of zero_topo save one step through the trainer's path (the gather brings every
    rank's checksum to rank 0 with its piece list); each returns what it wrote."""
    import torch.distributed as dist
    from test_checkpoint_shared_index import _engine
    from test_engine import LR, make_batch

    engine = _engine(rank, [2, 2])
    engine.forward_backward(make_batch(0, 0, rank))
    engine.optimizer_step(LR)
    state = {"engine": engine.checkpoint_state(), "rng": {"torch": torch.get_rng_state()}}
    step = Checkpointer(save_dir, rank=rank, world_size=world_size, barrier=dist.barrier).save(
        1, state, {"consumed_samples": 0}, gather=engine.gather_objects)
    return {"step": str(step), "mine": file_checksum(rank_file(Path(step), rank))}


def test_four_ranks_record_every_files_checksum_and_a_reader_refuses_the_damaged_one(tmp_path):
    from megatron.checkpointing.reader import CheckpointReader, read_master_weights

    results = run_ranks("test_checkpoint_integrity:_save_worker", 4, tmp_path / "save", save_dir=str(tmp_path / "ck"))
    step = Path(results[0]["step"])
    recorded = json.loads((step / "meta.json").read_text())["rank_files"]
    assert recorded == {rank_file(step, r).name: results[r]["mine"] for r in range(4)}  # each rank's own sum
    clean = read_master_weights(step)  # the HF export's read: every file checked, all pass

    flip(rank_file(step, 2))
    reader = CheckpointReader(step)
    damaged = {name for name in reader.shapes if 2 in reader.files_for(name, 0, reader.numel(name))}
    intact = [name for name in reader.shapes if name not in damaged]
    assert damaged and intact
    for name in intact:  # files 0, 1 and 3 still read, to the same values
        assert torch.equal(reader.read(name, 0, reader.numel(name), ("master",))["master"], clean[name].flatten())
    with pytest.raises(CheckpointError, match=re.escape(f"{rank_file(step, 2)} is damaged: crc32 ")):
        reader.read(sorted(damaged)[0], 0, reader.numel(sorted(damaged)[0]))
    with pytest.raises(CheckpointError, match="rank_00002.pt is damaged"):
        read_master_weights(step)  # nor exported


# --- pruning -------------------------------------------------------------------------------------

def test_pruning_does_not_count_a_damaged_step_and_keeps_the_good_one_before_it(tmp_path):
    folder = tmp_path / "ck"
    for step in (1, 2, 3):
        _save(folder, step, keep=2)
    assert sorted(p.name for p in folder.glob("global_step*")) == ["global_step2", "global_step3"]
    path = rank_file(folder / "global_step3", 0)
    path.write_bytes(path.read_bytes()[:100])  # step 3 damaged after its save
    with pytest.warns(CheckpointWarning, match=r"keeping .*global_step3 out of keep_last_n_checkpoints' count: "
                                               r"rank_00000.pt holds 100 bytes"):
        _save(folder, 4, keep=2)
    assert sorted(p.name for p in folder.glob("global_step*")) == ["global_step2", "global_step3", "global_step4"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _save(folder, 5, keep=2)  # two intact steps newer than 3: the damaged one and the older go
    assert sorted(p.name for p in folder.glob("global_step*")) == ["global_step4", "global_step5"]


def test_a_resume_from_a_damaged_step_is_refused_and_prunes_nothing(tmp_path, tiny_corpus):
    """The probe of issue 39: 64 bytes flipped in the newest step's rank file resumed silently with
    wrong weights and the pruning deleted the good step before it. Now: refused in one line, exit
    2, both steps kept; the step the line names resumes."""
    folder = tmp_path / "ck"
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=3, eval_iters=0, log_interval=1, save=str(folder),
                          checkpoint_factor=1, keep_last_n_checkpoints=2)
    first = run_deepy("train.py", str(cfg))
    assert first.returncode == SUCCESS, first.stderr[-3000:]
    flip(rank_file(folder / "global_step3", 0))
    resumed = run_deepy("train.py", str(cfg), "--set", "train_iters=5", "--set", f"load={folder}")
    assert resumed.returncode == USAGE_ERROR, resumed.stderr[-3000:]
    error = [line for line in resumed.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and re.fullmatch(
        rf"error: {re.escape(str(folder / 'global_step3' / 'rank_00000.pt'))} is damaged: crc32 [0-9a-f]{{8}}, its save "
        rf"recorded [0-9a-f]{{8}}; to resume from the step before it write global_step2 into "
        rf"{re.escape(str(folder / 'latest'))}", error[0]), error
    assert "Traceback" not in resumed.stderr and "step 4/" not in resumed.stdout
    assert sorted(p.name for p in folder.glob("global_step*")) == ["global_step2", "global_step3"]
    assert not (folder / ".lock").exists()  # a refused resume does not keep the folder locked

    (folder / "latest").write_text("global_step2")  # what the line says to do
    again = run_deepy("train.py", str(cfg), "--set", "train_iters=4", "--set", f"load={folder}")
    assert again.returncode == SUCCESS, again.stderr[-3000:]
    assert f"resumed from {folder / 'global_step2'} at step 2" in again.stdout
    assert sorted(p.name for p in folder.glob("global_step*")) == ["global_step3", "global_step4"]
    load_rank_state(folder / "global_step3", 0)  # rewritten by this run: it verifies


# --- `latest` ------------------------------------------------------------------------------------

BAD_LATEST = {
    "binary": (bytes(range(128, 256)) * 2, "is not text (binary data)"),
    "empty": (b"", "is empty"),
    "not-a-step": (b"checkpoint 7\n", "holds 'checkpoint 7', not a step name (global_stepN)"),
    "too-long": (b"global_step1" + b"0" * 300, "not a step name (global_stepN)"),
    "missing-step": (b"global_step9\n", "names global_step9, which is not there"),
    "incomplete-step": (b"global_step3", "names global_step3, which is incomplete"),
}


@pytest.mark.parametrize("case", list(BAD_LATEST))
def test_a_bad_latest_is_read_as_a_missing_one_with_one_warning(tmp_path, case):
    folder = tmp_path / "ck"
    _save(folder, 1)
    _save(folder, 2)
    (folder / "global_step3").mkdir()  # no meta.json: not complete
    content, problem = BAD_LATEST[case]
    (folder / "latest").write_bytes(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_step_dir(folder) == folder / "global_step2"
    ours = [w for w in caught if "`latest`" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, CheckpointWarning)
    assert problem in str(ours[0].message) and str(ours[0].message).endswith("using the newest complete step, global_step2")
    shown = warnings.formatwarning(ours[0].message, ours[0].category, ours[0].filename, ours[0].lineno)
    assert shown == f"warning: {ours[0].message}\n"  # one line, not Python's file:line + source line


def test_a_bad_latest_passes_over_a_step_that_is_not_intact(tmp_path):
    folder = tmp_path / "ck"
    for step in (1, 2):
        _save(folder, step)
    cut = rank_file(folder / "global_step2", 0)
    cut.write_bytes(cut.read_bytes()[:50])
    (folder / "latest").write_bytes(b"")
    with pytest.warns(CheckpointWarning) as caught:
        assert latest_step_dir(folder) == folder / "global_step1"
    assert [str(w.message) for w in caught] == [
        f"`latest` in {folder} is empty: using the newest complete step, global_step1 (global_step2 is not intact: "
        f"rank_00000.pt holds 50 bytes, its save wrote {json.loads((folder / 'global_step2' / 'meta.json').read_text())['rank_files']['rank_00000.pt']['bytes']})"]


@pytest.mark.slow  # the library-level test_a_bad_latest_is_read_as_a_missing_one_with_one_warning stays default
def test_garbage_in_latest_resumes_the_newest_step_with_one_line(tmp_path, tiny_corpus, tiny_two_step_save):
    """The probe of issue 39: binary garbage in `latest` crashed the resume with a UnicodeDecodeError."""
    folder = tmp_path / "ck"
    shutil.copytree(tiny_two_step_save, folder)
    (folder / "latest").write_bytes(bytes(range(256)))
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=3, eval_iters=0, log_interval=1, save=str(folder))
    proc = run_deepy("train.py", str(cfg), "--set", f"load={folder}")
    assert proc.returncode == SUCCESS, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: `latest` in {folder} is not text (binary data): using the newest complete step, "
                      "global_step2"], proc.stderr[-3000:]
    assert f"resumed from {folder / 'global_step2'} at step 2" in proc.stdout
    assert (folder / "latest").read_text() == "global_step3"  # the next save writes a good pointer
    assert "Traceback" not in proc.stderr
