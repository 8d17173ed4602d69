"""Our model in its Llama-family shapes against transformers' LlamaForCausalLM / MistralForCausalLM
(an independent implementation), built offline from a config with random weights: the weights are
copied through megatron/checkpointing/hf_llama.py's one table, both ways, and the logits compared."""
from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.hf_llama import (from_llama_state_dict, llama_config, llama_pieces,
                                             to_llama_state_dict)
from megatron.config.model_shape import head_dim, kv_heads
from megatron.config.schema import ModelConfig
from megatron.model import GPTNeoX
from megatron.model.kv_cache import KVCache

transformers = pytest.importorskip("transformers")

VOCAB = 96
TOL = 2e-5  # fp32: the two implementations order their sums differently


def llama_cfg(**over) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=24, norm="rmsnorm",
                rms_norm_epsilon=1e-5, activation="swiglu", intermediate_size=3 * 48, mlp_multiple_of=16,
                use_bias_in_attn_linear=False, use_bias_in_mlp=False, gpt_j_residual=False, rotary_pct=1.0,
                rotary_emb_base=10000, no_weight_tying=True, init_method="normal", output_layer_init_method="normal",
                padded_vocab_size=VOCAB)
    base.update(over)
    return ModelConfig(**base)


def hf_model(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    config = llama_config(cfg, VOCAB)
    config._attn_implementation = "eager"  # the plain reference, no fused kernels
    cls = transformers.MistralForCausalLM if config.model_type == "mistral" else transformers.LlamaForCausalLM
    model = cls(config).eval()
    with torch.no_grad():  # HF zero-inits biases and ones its norms: make every tensor count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def tokens(seq: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(3))


SHAPES = {  # name: overrides; heads 4
    "mha": dict(),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "gqa_tied": dict(num_kv_heads=2, no_weight_tying=False),
    "mha_tied_biases": dict(no_weight_tying=False, use_bias_in_attn_linear=True, use_bias_in_mlp=True),
    "llama2_mlp_bias": dict(use_bias_in_mlp=True, rotary_emb_base=1000000),
    "mistral_window": dict(num_kv_heads=2, sliding_window_width=5),
    "mistral_window_mqa_tied": dict(num_kv_heads=1, sliding_window_width=7, no_weight_tying=False),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers_both_ways(shape):
    cfg = llama_cfg(**SHAPES[shape])
    hf = hf_model(cfg)
    x = tokens(cfg.seq_length)
    with torch.no_grad():
        want = hf(x).logits
        # HF -> ours
        ours = GPTNeoX(cfg).eval()
        missing, unexpected = ours.load_state_dict(from_llama_state_dict(hf.state_dict(), cfg), strict=True)
        assert not missing and not unexpected
        got = ours(x)
        diff = (got - want).abs().max().item()
        assert diff < TOL, f"{shape}: max |logit diff| {diff:.2e}"
        # ours -> HF: a model of ours with its own random weights, exported, gives HF the same logits
        torch.manual_seed(1)
        mine = GPTNeoX(cfg).eval()
        hf2 = hf_model(cfg, seed=2)
        exported = to_llama_state_dict(mine.state_dict(), cfg)
        hf_keys = {k for k in hf2.state_dict() if not (k == "lm_head.weight" and not cfg.no_weight_tying)}
        assert set(exported) == hf_keys
        hf2.load_state_dict(exported, strict=not hf2.config.tie_word_embeddings)
        diff2 = (hf2(x).logits - mine(x)).abs().max().item()
        assert diff2 < TOL, f"{shape} export: max |logit diff| {diff2:.2e}"
    print(f"{shape}: import {diff:.2e} export {diff2:.2e}")


def test_the_window_changes_the_logits():
    """The window test above is not vacuous: the same weights without the window differ."""
    cfg = llama_cfg(**SHAPES["mistral_window"])
    full = llama_cfg(num_kv_heads=2)
    hf = hf_model(cfg)
    sd = from_llama_state_dict(hf.state_dict(), cfg)
    a, b = GPTNeoX(cfg).eval(), GPTNeoX(full).eval()
    a.load_state_dict(sd), b.load_state_dict(sd)
    x = tokens(cfg.seq_length)
    with torch.no_grad():
        ya, yb = a(x), b(x)
    window = cfg.sliding_window_width
    assert torch.allclose(ya[:, :window + 1], yb[:, :window + 1], atol=1e-6)  # positions the window covers whole
    assert (ya[:, window + 1:] - yb[:, window + 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("shape", ["gqa", "mqa", "mistral_window"])
def test_kv_cache_generation_equals_the_full_forward(shape):
    """Token-by-token decoding with the cache (K/V heads only; the window cut from the cached keys)
    gives the logits of one forward over the whole sequence."""
    cfg = llama_cfg(**SHAPES[shape])
    torch.manual_seed(0)
    model = GPTNeoX(cfg).eval()
    x = tokens(cfg.seq_length)
    cache = KVCache.for_model(model, batch=2, max_len=cfg.seq_length)
    assert cache.layers[0].keys.shape[1] == cfg.num_kv_heads
    assert cache.layers[0].keys.shape[2] == min(cfg.seq_length, cfg.sliding_window_width or cfg.seq_length)
    with torch.no_grad():
        full = model(x)
        steps = [model(x[:, :3], cache=cache)] + [model(x[:, t:t + 1], cache=cache) for t in range(3, cfg.seq_length)]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-5
    chunked = KVCache.for_model(model, batch=2, max_len=cfg.seq_length)  # several new queries after a cache
    with torch.no_grad():
        parts = [model(x[:, a:b], cache=chunked) for a, b in ((0, 10), (10, 15), (15, cfg.seq_length))]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() < 1e-5


def greedy(model: GPTNeoX, prompt: torch.Tensor, steps: int, cache: KVCache | None = None):
    """Greedy decoding: the new tokens [B, steps] and each step's logits [B, steps, V]. With a cache
    each step runs the newest token only; without one, the whole sequence again."""
    sequence, step_input, logits = prompt, prompt, []
    with torch.no_grad():
        for _ in range(steps):
            out = model(step_input, cache=cache) if cache is not None else model(sequence)
            logits.append(out[:, -1])
            step_input = out[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, step_input], dim=1)
    return sequence[:, prompt.shape[1]:], torch.stack(logits, dim=1)


# A window of 4 over a 24-position training context, generating up to 64 positions (past seq_length).
LONG_WINDOW = dict(num_kv_heads=2, sliding_window_width=4, max_position_embeddings=64)


@pytest.mark.parametrize("width", [4, None], ids=["window", "no_window"])
def test_windowed_cache_stays_within_the_window_and_decodes_as_the_recompute(width):
    """Greedy decoding of 40 tokens, ten windows, past seq_length 24 (max_position_embeddings 64): a
    cache of `width` positions per layer gives the tokens and logits of the recompute without a cache
    and of a cache that keeps every position and masks the window (the cache before it was bounded).
    Without a window the cache holds every position, as always."""
    cfg = llama_cfg(**dict(LONG_WINDOW, sliding_window_width=width))
    torch.manual_seed(0)
    model = GPTNeoX(cfg).eval()
    prompt, steps = tokens(6), 40  # a prompt longer than the window: the first forward trims too
    bounded = KVCache.for_model(model, batch=2, max_len=6 + steps)
    assert [layer.keys.shape[2] for layer in bounded.layers] == [width or 6 + steps] * cfg.num_layers
    masked = KVCache(cfg.num_layers, 2, kv_heads(cfg), 6 + steps, head_dim(cfg), torch.float32,
                     torch.device("cpu"))  # no window given: every position kept, the model masks the window
    want_tokens, want_logits = greedy(model, prompt, steps)
    diffs = []
    for cache in (bounded, masked):
        got_tokens, got_logits = greedy(model, prompt, steps, cache)
        assert torch.equal(got_tokens, want_tokens)
        diffs.append((got_logits - want_logits).abs().max().item())
        assert diffs[-1] < 1e-5, diffs
    assert bounded.length == masked.length == 6 + steps - 1 > cfg.seq_length  # the last token is not fed back
    print(f"window {width}: max |logit diff| against the recompute: bounded cache {diffs[0]:.1e}, "
          f"every position kept {diffs[1]:.1e}")


def test_windowed_generation_equals_transformers_mistral_past_the_window():
    """transformers' MistralForCausalLM generates greedily with its own sliding-window cache: the same
    tokens and per-step logits as ours over 44 tokens, eleven windows, past seq_length."""
    cfg = llama_cfg(**LONG_WINDOW)
    hf = hf_model(cfg)
    ours = GPTNeoX(cfg).eval()
    ours.load_state_dict(from_llama_state_dict(hf.state_dict(), cfg))
    prompt, steps = tokens(4), 44
    with torch.no_grad():
        # No end-of-sequence token (its default, 2, would be masked out by min_new_tokens) and an explicit
        # attention mask (without one, a prompt token equal to pad_token_id would count as padding).
        hf.generation_config.eos_token_id = None
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps, do_sample=False,
                          use_cache=True, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    got_tokens, got_logits = greedy(ours, prompt, steps, KVCache.for_model(ours, batch=2, max_len=4 + steps))
    assert torch.equal(out.sequences[:, 4:], got_tokens)
    diff = (torch.stack(out.logits, dim=1) - got_logits).abs().max().item()
    assert diff < TOL, diff
    print(f"mistral generation past the window: max |logit diff| {diff:.1e}")


def test_neox_mlp_widths_by_hand():
    """GPT-NeoX's rule (LLAMA_KEYS.md), counted by hand: Llama-7B's 32768 with multiple 256 -> 11008."""
    from megatron.config.model_shape import mlp_widths
    llama7b = llama_cfg(hidden_size=4096, num_attention_heads=32, intermediate_size=32768, mlp_multiple_of=256)
    assert mlp_widths(llama7b) == (22016, 11008)  # f = 21845 -> 512 x 43; floor(f / 2) = 10922 -> 256 x 43
    code = llama_cfg(hidden_size=4096, num_attention_heads=32, intermediate_size=None, mlp_multiple_of=256)
    assert mlp_widths(code) == (11264, 5632)  # 4h = 16384 -> f = 10922 -> 512 x 22; 5461 -> 256 x 22
    mistral = llama_cfg(hidden_size=4096, num_attention_heads=32, intermediate_size=14336, mlp_multiple_of=1)
    assert mlp_widths(mistral) == (9558, 4778)  # the shape GPT-NeoX's mistral/7B.yml builds: cannot run
    assert mlp_widths(llama_cfg(intermediate_size=43008, mlp_multiple_of=1)) == (28672, 14336)


def test_the_table_covers_every_parameter_once():
    for shape in SHAPES:
        cfg = llama_cfg(**SHAPES[shape])
        names = [n for n, _ in llama_pieces(cfg)]
        model_names = [n for n, _ in GPTNeoX(cfg).named_parameters()]
        assert names == model_names, shape
