import json
import os

import pytest
import torch

from megatron.checkpointing.checkpointer import (Checkpointer, CheckpointError, committed_steps,
                                                 latest_step_dir, load_meta, load_rank_state)


def _save(tmp_path, step, keep=None, value=1.0):
    ck = Checkpointer(str(tmp_path / "ck"), rank=0, world_size=1, barrier=lambda: None, keep_last_n=keep)
    return ck.save(step, {"w": torch.full((3,), value)}, {"consumed_samples": step * 4})


def test_commit_and_latest(tmp_path):
    path = _save(tmp_path, 10)
    assert path.name == "global_step10"
    assert (tmp_path / "ck" / "latest").read_text() == "global_step10"
    assert load_meta(path)["consumed_samples"] == 40
    assert torch.equal(load_rank_state(path, 0)["w"], torch.ones(3))
    assert not any(p.name.endswith(".partial") for p in (tmp_path / "ck").iterdir())


def test_saving_a_committed_step_is_a_noop(tmp_path):
    path = _save(tmp_path, 10, value=1.0)
    mtime = os.stat(path / "rank_00000.pt").st_mtime_ns
    _save(tmp_path, 10, value=2.0)
    assert os.stat(path / "rank_00000.pt").st_mtime_ns == mtime
    assert torch.equal(load_rank_state(path, 0)["w"], torch.ones(3))


def test_keep_last_n_prunes_after_commit(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert committed_steps(tmp_path / "ck") == [3, 4]


def test_incomplete_folder_is_ignored_with_warning(tmp_path):
    _save(tmp_path, 5)
    half = tmp_path / "ck" / "global_step9"
    half.mkdir()
    (half / "rank_00000.pt").write_bytes(b"garbage")
    (tmp_path / "ck" / "latest").write_text("global_step9")
    with pytest.warns(UserWarning, match="incomplete"):
        assert latest_step_dir(tmp_path / "ck").name == "global_step5"


def test_unwritable_folder_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    ck = Checkpointer(str(blocker / "sub"), rank=0, world_size=1, barrier=lambda: None)
    with pytest.raises(CheckpointError, match="cannot write checkpoints"):
        ck.save(1, {}, {})


def test_missing_rank_file_names_layout(tmp_path):
    path = _save(tmp_path, 3)
    with pytest.raises(CheckpointError, match="different layout"):
        load_rank_state(path, 1)
