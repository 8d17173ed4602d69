"""A second run into a `save` folder that holds another run's checkpoints: refused at start-up
unless it resumes from there or sets overwrite_checkpoints, which replaces each step it saves; a
save that cannot be written (full disk) is one error, and the previous step stays `latest`."""
import hashlib
import json
import resource
import shutil

import torch

from conftest import run_deepy, tiny_run_config


def _first_run(tmp_path, tiny_corpus, tiny_two_step_save):
    """The first run's config and save folder: its 2 steps are trained once for every test (conftest)."""
    save = tmp_path / "ck"
    shutil.copytree(tiny_two_step_save, save)
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=2, eval_iters=0, log_interval=1, save=str(save))
    return cfg, save


def _digests(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _embedding(step_dir):
    from megatron.checkpointing.reader import CheckpointReader
    reader = CheckpointReader(step_dir)
    name = "embed.embed_in.weight"
    master = reader.read(name, 0, reader.numel(name), keys=("master",))["master"].clone()
    reader.close()
    return master


def test_second_run_into_the_same_save_folder_is_refused_before_training(tmp_path, tiny_corpus, tiny_two_step_save):
    cfg, save = _first_run(tmp_path, tiny_corpus, tiny_two_step_save)
    before = _digests(save)
    second = run_deepy("train.py", str(cfg), "--set", "seed=7", "--set", "lr=1e-3")
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepy: error: "), second.stderr
    assert str(save) in lines[0] and "load" in lines[0] and "overwrite_checkpoints: true" in lines[0]
    assert second.stdout == ""  # no rank started, nothing trained
    assert _digests(save) == before


def test_overwrite_replaces_the_step_with_the_new_runs_state(tmp_path, tiny_corpus, tiny_two_step_save):
    cfg, save = _first_run(tmp_path, tiny_corpus, tiny_two_step_save)
    first_weights = _embedding(save / "global_step2")
    second = run_deepy("train.py", str(cfg), "--set", "seed=7", "--set", "overwrite_checkpoints=true")
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"saved checkpoint {save / 'global_step2'}" in second.stdout
    meta = json.loads((save / "global_step2" / "meta.json").read_text())
    assert meta["config"]["data"]["seed"] == 7 and meta["config"]["checkpoint"]["overwrite_checkpoints"]
    assert not torch.equal(_embedding(save / "global_step2"), first_weights)  # another seed's weights
    assert sorted(p.name for p in save.iterdir()) == ["global_step2", "latest"]


def test_a_full_disk_during_save_is_one_error_and_keeps_latest(tmp_path, tiny_corpus, tiny_two_step_save):
    cfg, save = _first_run(tmp_path, tiny_corpus, tiny_two_step_save)
    before = _digests(save)
    rank_file = (save / "global_step2" / "rank_00000.pt").stat().st_size

    def small_files():  # in deepy and its ranks: any file written past the limit fails (EFBIG)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (rank_file // 4, hard))

    second = run_deepy("train.py", str(cfg), "--set", f"load={save}", "--set", "train_iters=4",
                       preexec_fn=small_files)
    assert second.returncode == 2, second.stderr[-2000:]
    errors = [line for line in second.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-2000:]
    assert "could not save checkpoint" in errors[0] and "global_step4" in errors[0]
    assert "File too large" in errors[0] and "`latest` still names global_step2" in errors[0]
    assert "step 4/4" in second.stdout and "saved checkpoint" not in second.stdout
    assert _digests(save) == before  # the previous step intact, still `latest`, nothing half-written
