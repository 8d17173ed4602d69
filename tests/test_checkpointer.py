import json
import warnings

import pytest
import torch

from megatron.checkpointing.checkpointer import Checkpointer
from megatron.checkpointing.folders import committed_steps, latest_step_dir
from megatron.checkpointing.rank_files import CheckpointError, load_meta, load_rank_state


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


def test_saving_an_existing_step_replaces_it(tmp_path):
    path = _save(tmp_path, 10, value=1.0)
    assert _save(tmp_path, 10, value=2.0) == path
    assert torch.equal(load_rank_state(path, 0)["w"], torch.full((3,), 2.0))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["global_step10", "latest"]


class Crash(BaseException):
    """A process dying at this point: nothing after it runs, no except clause cleans up."""


@pytest.mark.parametrize("crash_at", ["aside", "in", "latest"])
def test_a_crash_while_replacing_a_step_leaves_one_complete_copy(tmp_path, monkeypatch, crash_at):
    """The three renames of a replacement: old step aside, new step in, `latest`; dying before any
    of them leaves step 10 complete (old or new), readable and resumable, and the next save of it
    tidies up."""
    from megatron.checkpointing import checkpointer
    _save(tmp_path, 10, value=1.0)
    real_rename = checkpointer.rename_durably
    renames = []

    def rename(src, dst):
        renames.append(dst.name)
        if {"aside": ".global_step10.old", "in": "global_step10", "latest": "latest"}[crash_at] == dst.name:
            raise Crash
        real_rename(src, dst)

    monkeypatch.setattr(checkpointer, "rename_durably", rename)
    with pytest.raises(Crash):
        _save(tmp_path, 10, value=2.0)
    monkeypatch.setattr(checkpointer, "rename_durably", real_rename)
    expect = 2.0 if crash_at == "latest" else 1.0  # the new copy counts once it is renamed in
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert committed_steps(tmp_path / "ck") == [10]
        step = latest_step_dir(tmp_path / "ck")
    assert (step.name == ".global_step10.old") == (crash_at == "in")
    assert torch.equal(load_rank_state(step, 0)["w"], torch.full((3,), expect))
    assert load_meta(step)["iteration"] == 10
    _save(tmp_path, 10, value=3.0)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["global_step10", "latest"]
    assert torch.equal(load_rank_state(latest_step_dir(tmp_path / "ck"), 0)["w"], torch.full((3,), 3.0))


def test_a_full_disk_is_one_error_and_keeps_the_previous_step(tmp_path):
    """A file-size limit (what a full disk looks like to the writer) under the rank file's size."""
    import resource
    _save(tmp_path, 1, value=1.0)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    ck = Checkpointer(str(tmp_path / "ck"), rank=0, world_size=1, barrier=lambda: None)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))  # Python ignores SIGXFSZ: writes fail
    try:
        with pytest.raises(CheckpointError) as err:
            ck.save(2, {"w": torch.zeros(100_000)}, {"consumed_samples": 8})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(err.value)
    assert "\n" not in message and "global_step2" in message and "File too large" in message
    assert "`latest` still names global_step1" in message
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["global_step1", "latest"]
    assert torch.equal(load_rank_state(latest_step_dir(tmp_path / "ck"), 0)["w"], torch.ones(3))


def test_a_new_run_may_not_save_among_another_runs_steps(tmp_path, monkeypatch):
    from megatron.checkpointing.folders import save_folder_conflict
    folder = tmp_path / "ck"
    assert save_folder_conflict(str(folder), None, False) is None  # nothing there yet
    _save(tmp_path, 10)
    problem = save_folder_conflict(str(folder), None, False)
    assert "\n" not in problem and str(folder) in problem and "global_step10" in problem
    assert f"`load: {folder}`" in problem and "`overwrite_checkpoints: true`" in problem
    assert save_folder_conflict(str(folder), str(tmp_path / "elsewhere"), False) == problem
    monkeypatch.chdir(tmp_path)
    assert save_folder_conflict(str(folder), "ck/", False) is None  # resuming it, however spelled
    assert save_folder_conflict(str(folder), None, True) is None


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


class _NotPlainData:
    """Something only a full unpickle could rebuild (and so could run code on load)."""


def test_rank_files_load_with_weights_only(tmp_path):
    """Rank files hold only dicts, lists, tensors, strings and numbers, and load with
    weights_only=True; a file holding anything else is refused in one line, not unpickled."""
    from megatron.checkpointing.rank_files import rank_file, read_rank_file
    state = {"engine": {"format": "x", "step": 2, "shapes": {"w": [3]}, "preset": None, "factors": [1, 1, 1],
                        "loss_scaler": {"scale": 1.0, "clean_steps": 0}, "pieces": [{"name": "w", "offset": 0}]},
             "rng": {"torch": torch.get_rng_state()}}
    path = _save(tmp_path, 1).parent / "global_step2"
    Checkpointer(str(tmp_path / "ck"), rank=0, world_size=1, barrier=lambda: None).save(2, state, {})
    loaded = read_rank_file(rank_file(path, 0), mmap=True)
    assert loaded["engine"]["loss_scaler"] == {"scale": 1.0, "clean_steps": 0}
    assert torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])
    torch.save({"engine": _NotPlainData()}, rank_file(path, 0))
    with pytest.raises(CheckpointError, match="is damaged"):  # not the bytes its save wrote: refused unread
        load_rank_state(path, 0)
    meta = json.loads((path / "meta.json").read_text())
    del meta["rank_files"]  # as a step saved before checksums: the file is unpickled, weights_only
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as err:
        load_rank_state(path, 0)
    assert "\n" not in str(err.value) and "holds objects other than tensors" in str(err.value)
