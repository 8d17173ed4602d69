"""Decoding with the KV cache: the same logits and greedy tokens as the full-prefix forward and as
transformers' own cached GPTNeoX generation; sampling filters against hand-computed cases; the
unconditional and interactive modes on an in-process model (generate.py's runs: test_generate_eval.py)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from megatron.config import load_config
from megatron.config.schema import ModelConfig
from megatron.data.tokenizers import CharLevelTokenizer
from megatron.inference.loading import InferenceModel
from megatron.inference.sampling import Sampling, filter_logits, next_token
from megatron.inference.text_generation import generate_tokens, run_generation
from megatron.model import GPTNeoX, KVCache

VOCAB = 512  # CharLevelTokenizer's


def model_cfg(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, rotary_pct=0.5,
                  gpt_j_residual=True, no_weight_tying=True)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_model(seed: int = 0, **overrides) -> GPTNeoX:
    torch.manual_seed(seed)
    model = GPTNeoX(model_cfg(**overrides), VOCAB).eval()
    with torch.no_grad():  # NeoX's init leaves biases at zero and norms at one: make every weight count
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def inference_model(model: GPTNeoX, tmp_path: Path, **keys) -> InferenceModel:
    overrides = [f"{k}={v}" for k, v in {"tokenizer_type": "CharLevelTokenizer", "log_dir": str(tmp_path / "logs"),
                                         "seq_length": model.config.seq_length, **keys}.items()]
    cfg = load_config([], overrides, env={}, notices=[])
    return InferenceModel(cfg=cfg, model=model, tokenizer=CharLevelTokenizer(), device=torch.device("cpu"),
                          step_dir=tmp_path, iteration=0)


@pytest.mark.parametrize("parallel", [True, False])
def test_cached_logits_equal_the_full_forward(parallel):
    model = random_model(gpt_j_residual=parallel)
    tokens = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache.for_model(model, batch=2, max_len=30)
        # a prompt, then a chunk of 5 after cached positions (the masked path), then one at a time
        pieces = [model(tokens[:, :9], cache=cache), model(tokens[:, 9:14], cache=cache)]
        pieces += [model(tokens[:, i:i + 1], cache=cache) for i in range(14, 30)]
    assert cache.length == 30
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-5


def test_greedy_tokens_with_and_without_cache_and_as_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megatron.checkpointing.hf import hf_config_from_model_config, to_hf_state_dict

    model = random_model(seed=3)
    im = inference_model(model, tmp_path)
    prompt = list(b"def main():\n    ")
    greedy = Sampling(temperature=0.0)
    cached = generate_tokens(im, prompt, 40, greedy, use_cache=True, stop_at_eod=False)
    recomputed = generate_tokens(im, prompt, 40, greedy, use_cache=False, stop_at_eod=False)
    assert cached.tokens == recomputed.tokens and len(cached.tokens) == 40

    hf = transformers.GPTNeoXForCausalLM(hf_config_from_model_config(model.config, VOCAB)).eval()
    hf_sd = to_hf_state_dict(model.state_dict(), model.config)
    hf_sd["lm_head.weight"] = hf_sd.pop("embed_out.weight")  # its in-memory name (files say embed_out)
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert not unexpected and not [name for name in missing if "rotary" not in name], missing
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                          use_cache=True, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == cached.tokens  # CharLevel: the tokenizer covers all 512 rows


@pytest.mark.parametrize("window", [None, 4])
def test_generation_runs_past_seq_length_up_to_max_position_embeddings(tmp_path, window):
    """The rotary table covers max_position_embeddings (GPT-NeoX's meaning), not seq_length: generation
    goes on past the training context, with or without the cache (a sliding window's bounded to 4
    positions per layer), to the same greedy tokens, and stops at max_position_embeddings."""
    model = random_model(seq_length=16, max_position_embeddings=40, sliding_window_width=window)
    im = inference_model(model, tmp_path)
    greedy = Sampling(temperature=0.0)
    cached = generate_tokens(im, list(b"abcd"), 100, greedy, use_cache=True, stop_at_eod=False)
    recomputed = generate_tokens(im, list(b"abcd"), 100, greedy, use_cache=False, stop_at_eod=False)
    assert cached.tokens == recomputed.tokens and len(cached.tokens) == 36  # 4 + 36 = 40 positions
    assert "stopped after 36 tokens at max_position_embeddings (40)" in cached.message


def test_prompt_longer_than_the_context_keeps_its_end(tmp_path):
    im = inference_model(random_model(seq_length=16), tmp_path)
    done = generate_tokens(im, list(range(40)), 5, Sampling(), stop_at_eod=False)
    assert len(done.tokens) == 1 and "cut to its last 15 tokens" in done.message


def test_top_k_and_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=0.0)).tolist() == [[False, False, True, True, True]]
    # nucleus 0.6: 0.5 alone does not exceed it, 0.5 + 0.2 does -> the first two stay
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.6)).tolist() == [[False, False, True, True, True]]
    # 0.9 is passed only after four tokens (0.5+0.2+0.15 = 0.85)
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.9)).tolist() == [[False, False, False, False, True]]
    # top_p below the first probability still keeps the most likely token
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.1)).tolist() == [[False, True, True, True, True]]
    assert next_token(logits, Sampling(temperature=0.0)).tolist() == [0]
    # top_k 1 samples the argmax whatever the temperature
    assert next_token(logits, Sampling(temperature=5.0, top_k=1), torch.Generator().manual_seed(0)).tolist() == [0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([next_token(probs.log()[None], Sampling(temperature=1.0), gen) for _ in range(3000)])
    freq = torch.bincount(draws.flatten(), minlength=3).float() / 3000
    assert (freq - probs).abs().max() < 0.03  # 3000 draws: std of each frequency <= 0.009


def test_unconditional_writes_neox_records(tmp_path):
    im = inference_model(random_model(), tmp_path, text_gen_type="unconditional", num_samples=3,
                         maximum_tokens=8, temperature=1.0)
    path = run_generation(im, stdout=io.StringIO())
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert path == tmp_path / "logs" / "samples.jsonl" and len(records) == 3
    for record in records:
        assert set(record) == {"context", "text", "length", "finished", "message", "duration_seconds"}
        assert record["context"] == "" and 0 <= record["length"] <= 8


def test_interactive_reads_prompts_until_an_empty_line(tmp_path):
    im = inference_model(random_model(), tmp_path, text_gen_type="interactive", maximum_tokens=4)
    out = io.StringIO()
    assert run_generation(im, stdin=io.StringIO("hello\nworld\n\nnever read\n"), stdout=out) is None
    assert out.getvalue().count("prompt (empty line or Ctrl-D to quit):") == 3
