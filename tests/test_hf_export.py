"""Checkpoint -> Hugging Face folder -> transformers logits equal ours; and the folder back into ours."""
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_deepy, run_together, tiny_run_config

transformers = pytest.importorskip("transformers")
# slow: the mapping's logits against transformers are tests/test_hf.py's; the sharded load's, test_sharded_build.py's
pytestmark = pytest.mark.slow


SHAPES = [(0.25, True), (0.5, False)]  # (rotary_pct, gpt_j_residual)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_corpus) -> dict:
    """Per SHAPES entry: (its folder, the 3-step training run, tools/convert_to_hf.py's run on the
    checkpoint into <folder>/hf, or None when training failed); the shapes' runs at once."""
    from megatron.checkpointing.folders import latest_step_dir

    def train_then_convert(folder, rotary_pct, parallel):
        cfg = tiny_run_config(folder, tiny_corpus, train_iters=3, eval_iters=0, save=str(folder / "ck"),
                              rotary_pct=rotary_pct, gpt_j_residual=parallel)
        trained = run_deepy("train.py", str(cfg))
        if trained.returncode != 0:
            return folder, trained, None
        done = subprocess.run([sys.executable, str(REPO / "tools/convert_to_hf.py"), "--input_dir",
                               str(latest_step_dir(folder / "ck")), "--output_dir", str(folder / "hf")],
                              capture_output=True, text=True)
        return folder, trained, done

    folders = [tmp_path_factory.mktemp(f"rotary{r}_parallel{p}") for r, p in SHAPES]
    runs = run_together(*(lambda f=f, shape=shape: train_then_convert(f, *shape) for f, shape in zip(folders, SHAPES)))
    return dict(zip(SHAPES, runs))


@pytest.mark.parametrize("rotary_pct,parallel", SHAPES)
def test_export_logits_match_transformers(converted, rotary_pct, parallel):
    from megatron.checkpointing.folders import latest_step_dir
    from megatron.checkpointing.rank_files import load_meta
    from megatron.checkpointing.hf_io import import_hf
    from megatron.checkpointing.param_slices import assemble_full_state
    from megatron.config import config_from_dict
    from megatron.model import GPTNeoX

    tmp_path, trained, done = converted[(rotary_pct, parallel)]
    assert trained.returncode == 0
    step = latest_step_dir(tmp_path / "ck")
    out = tmp_path / "hf"
    assert done.returncode == 0, done.stderr
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()

    run_cfg = config_from_dict(load_meta(step)["config"])
    ours = GPTNeoX(run_cfg.model, run_cfg.model.padded_vocab_size)
    ours.load_state_dict(assemble_full_state(step)["params"], strict=False)
    hf = transformers.GPTNeoXForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    print(f"max |logits diff| = {diff:.3e}")
    assert diff < 1e-4

    model_cfg, state = import_hf(out)
    assert model_cfg.rotary_pct == rotary_pct and model_cfg.gpt_j_residual == parallel
    for name, value in assemble_full_state(step)["params"].items():
        assert torch.equal(state[name], value), name


def test_load_hf_initialises_training(tmp_path, tiny_corpus, tiny_trained_step):
    from megatron.checkpointing.hf_io import export_hf
    out = export_hf(tiny_trained_step, tmp_path / "hf")  # 3 trained steps (conftest)
    second = tmp_path / "b"
    second.mkdir()
    cfg2 = tiny_run_config(second, tiny_corpus, train_iters=1, eval_iters=0, log_interval=1, load_hf=str(out))
    fresh = tiny_run_config(tmp_path, tiny_corpus, train_iters=1, eval_iters=0, log_interval=1)
    import json
    bad_folder = tmp_path / "c"
    bad_folder.mkdir()
    bad = tiny_run_config(bad_folder, tiny_corpus, train_iters=1, hidden_size=32, load_hf=str(out))
    from_hf, from_scratch, result = run_together(*(lambda c=c: run_deepy("train.py", str(c)) for c in (cfg2, fresh, bad)))
    losses = []
    for run, d in ((from_hf, second), (from_scratch, tmp_path)):
        assert run.returncode == 0
        losses.append(json.loads((d / "logs" / "metrics.jsonl").read_text().splitlines()[0])["train/lm_loss"])
    assert losses[0] < losses[1] - 0.3  # trained weights start lower than a fresh init
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "the model shapes differ" in result.stderr
