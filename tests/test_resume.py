"""Single-process checkpoint round trips through deepy.py: exact resume and shape refusal.
(Multi-rank resume and resharding are in tests/test_reshard_dist.py.)"""

from conftest import run_deepy, tiny_run_config, train_losses




def test_stop_and_resume_is_bit_exact_even_with_shorter_first_run(tmp_path, tiny_corpus):
    common = dict(lr_decay_iters=8, log_interval=1, eval_interval=100, eval_iters=0)
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    full_dir.mkdir(), part_dir.mkdir()
    full = tiny_run_config(full_dir, tiny_corpus, train_iters=8, **common)
    assert run_deepy("train.py", str(full)).returncode == 0
    # the first run only knew about 4 steps; the resumed one asks for 8
    first = tiny_run_config(part_dir, tiny_corpus, train_iters=4, save=str(part_dir / "ck"), **common)
    result = run_deepy("train.py", str(first))
    assert result.returncode == 0, result.stderr[-2000:]
    resumed = run_deepy("train.py", str(first), "--set", "train_iters=8", "--set", f"load={part_dir / 'ck'}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    reference, parts = train_losses(full_dir / "logs"), train_losses(part_dir / "logs")
    assert sorted(parts) == list(range(1, 9))
    assert all(parts[i] == reference[i] for i in range(1, 9)), (parts, reference)


def test_wrong_model_shape_is_refused(tmp_path, tiny_corpus):
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=1, save=str(tmp_path / "ck"), eval_iters=0)
    assert run_deepy("train.py", str(cfg)).returncode == 0
    result = run_deepy("train.py", str(cfg), "--set", "hidden_size=32", "--set", f"load={tmp_path / 'ck'}",
                       "--set", "train_iters=2")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "of shape (384, 64), this model has (384, 32): the model shapes differ" in result.stderr
