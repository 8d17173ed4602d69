"""A Llama- and a Mistral-shaped run's checkpoint -> tools/convert_to_hf.py -> a folder transformers
loads offline as LlamaForCausalLM / MistralForCausalLM, with our logits (fp32)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_deepy, run_together, tiny_run_config

transformers = pytest.importorskip("transformers")

LLAMA = dict(num_attention_heads=4, num_kv_heads=2, norm="rmsnorm", rms_norm_epsilon=1e-5, activation="swiglu",
             intermediate_size=384, use_bias_in_attn_linear=False, use_bias_in_mlp=False, rotary_pct=1,
             gpt_j_residual=False)
SHAPES = {"llama": (dict(LLAMA, use_bias_in_mlp=True, no_weight_tying=False), "LlamaForCausalLM"),
          "mistral": (dict(LLAMA, num_kv_heads=1, sliding_window_width=8), "MistralForCausalLM")}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_corpus) -> dict:
    from megatron.checkpointing.folders import latest_step_dir

    def train_then_convert(name):
        folder = tmp_path_factory.mktemp(name)
        cfg = tiny_run_config(folder, tiny_corpus, train_iters=2, eval_iters=0, save=str(folder / "ck"), **SHAPES[name][0])
        trained = run_deepy("train.py", str(cfg))
        assert trained.returncode == 0, trained.stderr[-3000:]
        done = subprocess.run([sys.executable, str(REPO / "tools/convert_to_hf.py"), "--input_dir",
                               str(latest_step_dir(folder / "ck")), "--output_dir", str(folder / "hf"), "--no-progress"],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return folder
    return dict(zip(SHAPES, run_together(*(lambda n=n: train_then_convert(n) for n in SHAPES))))


@pytest.mark.slow  # two deepy trainings (~40 s); the mapping's own parity is tests/test_llama_parity.py
@pytest.mark.parametrize("name", list(SHAPES))
def test_export_loads_offline_with_our_logits(converted, name):
    from megatron.checkpointing.folders import latest_step_dir
    from megatron.checkpointing.param_slices import assemble_full_state
    from megatron.checkpointing.rank_files import load_meta
    from megatron.config import config_from_dict
    from megatron.model import GPTNeoX

    folder = converted[name]
    step = latest_step_dir(folder / "ck")
    config = json.loads((folder / "hf" / "config.json").read_text())
    assert config["architectures"] == [SHAPES[name][1]]
    run_cfg = config_from_dict(load_meta(step)["config"])
    ours = GPTNeoX(run_cfg.model, run_cfg.model.padded_vocab_size).eval()
    ours.load_state_dict(assemble_full_state(step)["params"], strict=False)
    cls = getattr(transformers, SHAPES[name][1])
    hf = cls.from_pretrained(str(folder / "hf"), local_files_only=True, attn_implementation="eager").eval()
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    assert diff < 1e-4, diff
