"""Checkpoint -> Hugging Face folder -> transformers logits equal ours; and the folder back into ours."""
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_deepy, tiny_run_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("rotary_pct,parallel", [(0.25, True), (0.5, False)])
def test_export_logits_match_transformers(tmp_path, tiny_corpus, rotary_pct, parallel):
    from megatron.checkpointing.folders import latest_step_dir
    from megatron.checkpointing.rank_files import load_meta
    from megatron.checkpointing.hf_io import import_hf
    from megatron.checkpointing.param_slices import assemble_full_state
    from megatron.config import config_from_dict
    from megatron.model import GPTNeoX

    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=3, eval_iters=0, save=str(tmp_path / "ck"),
                          rotary_pct=rotary_pct, gpt_j_residual=parallel)
    assert run_deepy("train.py", str(cfg)).returncode == 0
    step = latest_step_dir(tmp_path / "ck")
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, str(REPO / "tools/convert_to_hf.py"), "--input_dir", str(step),
                           "--output_dir", str(out)], capture_output=True, text=True)
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


def test_load_hf_initialises_training(tmp_path, tiny_corpus):
    from megatron.checkpointing.hf_io import export_hf
    from megatron.checkpointing.folders import latest_step_dir
    first = tmp_path / "a"
    first.mkdir()
    cfg = tiny_run_config(first, tiny_corpus, train_iters=3, eval_iters=0, save=str(first / "ck"))
    assert run_deepy("train.py", str(cfg)).returncode == 0
    out = export_hf(latest_step_dir(first / "ck"), tmp_path / "hf")
    second = tmp_path / "b"
    second.mkdir()
    cfg2 = tiny_run_config(second, tiny_corpus, train_iters=1, eval_iters=0, log_interval=1, load_hf=str(out))
    fresh = tiny_run_config(tmp_path, tiny_corpus, train_iters=1, eval_iters=0, log_interval=1)
    import json
    losses = []
    for c, d in ((cfg2, second), (fresh, tmp_path)):
        assert run_deepy("train.py", str(c)).returncode == 0
        losses.append(json.loads((d / "logs" / "metrics.jsonl").read_text().splitlines()[0])["train/lm_loss"])
    assert losses[0] < losses[1] - 0.3  # trained weights start lower than a fresh init
    bad = tiny_run_config(second, tiny_corpus, train_iters=1, hidden_size=32, load_hf=str(out))
    result = run_deepy("train.py", str(bad))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "the model shapes differ" in result.stderr
