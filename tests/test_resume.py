"""Single-process checkpoint round trips through deepy.py: exact resume and shape refusal.
(Multi-rank resume and resharding are in tests/test_reshard.py.)

Both tests judge one set of runs (a deepy run costs a few seconds): the shape refusal loads the
checkpoint the resume test saved."""

import pytest

from conftest import run_deepy, run_together, tiny_run_config, train_losses


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory, tiny_corpus):
    """8 steps straight through, and a run that only knew about 4 steps, saved, then resumed to 8.
    Returns (reference folder, part folder, part's config, resumed run)."""
    tmp_path = tmp_path_factory.mktemp("resume")
    common = dict(lr_decay_iters=8, log_interval=1, eval_interval=100, eval_iters=0)
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    full_dir.mkdir(), part_dir.mkdir()
    full = tiny_run_config(full_dir, tiny_corpus, train_iters=8, **common)
    # the first run only knew about 4 steps; the resumed one asks for 8
    first = tiny_run_config(part_dir, tiny_corpus, train_iters=4, save=str(part_dir / "ck"), **common)
    for result in run_together(lambda: run_deepy("train.py", str(full)), lambda: run_deepy("train.py", str(first))):
        assert result.returncode == 0, result.stderr[-2000:]
    resumed = run_deepy("train.py", str(first), "--set", "train_iters=8", "--set", f"load={part_dir / 'ck'}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return full_dir, part_dir, first, resumed


def test_stop_and_resume_is_bit_exact_even_with_shorter_first_run(stopped_and_resumed):
    full_dir, part_dir, _, resumed = stopped_and_resumed
    assert "resumed from" in resumed.stdout
    reference, parts = train_losses(full_dir / "logs"), train_losses(part_dir / "logs")
    assert sorted(parts) == list(range(1, 9))
    assert all(parts[i] == reference[i] for i in range(1, 9)), (parts, reference)


def test_wrong_model_shape_is_refused(tmp_path, stopped_and_resumed):
    _, part_dir, cfg, _ = stopped_and_resumed
    # its own log and save folders: the refused run leaves the shared runs' files alone
    result = run_deepy("train.py", str(cfg), "--set", "hidden_size=32", "--set", f"load={part_dir / 'ck'}",
                       "--set", "train_iters=9", "--set", f"log_dir={tmp_path / 'logs'}",
                       "--set", f"save={tmp_path / 'ck'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "of shape (384, 64), this model has (384, 32): the model shapes differ" in result.stderr
