"""Everything that sizes a model follows the Llama-family block: parameter counts against the built
model's own, FLOPs and parameters against hand counts, activation bytes against what autograd keeps,
GPT-NeoX's held Llama-family configs and ours loaded and dry-run on 48 Frontier nodes."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from megatron.config import ConfigError, load_config
from megatron.config.schema import ModelConfig
from megatron.model import GPTNeoX, num_parameters, parameter_count, unit_parameter_counts
from megatron.model.sizes import (backward_activation_bytes, head_activation_bytes, model_flops_per_token,
                                  unit_parameter_shapes)

REPO = Path(__file__).resolve().parents[1]
NEOX = REPO.parent / "shared" / "external" / "gpt-neox" / "configs"
needs_neox = pytest.mark.skipif(not NEOX.is_dir(), reason=f"GPT-NeoX configs not found at {NEOX}")
VOCAB = 96


def llama(**over) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, norm="rmsnorm",
                activation="swiglu", intermediate_size=144, mlp_multiple_of=8, use_bias_in_attn_linear=False,
                use_bias_in_mlp=False, rotary_pct=1.0, no_weight_tying=True, padded_vocab_size=VOCAB)
    base.update(over)
    return ModelConfig(**base)


SHAPES = [dict(), dict(num_kv_heads=2), dict(num_kv_heads=1, no_weight_tying=False),
          dict(use_bias_in_mlp=True), dict(use_bias_in_attn_linear=True, num_kv_heads=2, sliding_window_width=4),
          dict(norm="layernorm", activation="gelu", intermediate_size=None, num_kv_heads=2)]


@pytest.mark.parametrize("over", SHAPES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "mha")
def test_counts_and_shapes_equal_the_built_models(over):
    cfg = llama(**over)
    torch.manual_seed(0)
    model = GPTNeoX(cfg)
    embed_ids = {id(p) for p in model.embed.parameters()}
    measured = [sum(p.numel() for p in u.parameters() if u is model.embed or id(p) not in embed_ids) for u in model.units()]
    assert unit_parameter_counts(cfg, VOCAB) == measured
    assert parameter_count(cfg, VOCAB) == num_parameters(model)
    built = [[(n, tuple(p.shape)) for n, p in u.named_parameters() if u is model.embed or id(p) not in embed_ids]
             for u in model.units()]  # a tied output weight is the embedding's: listed once
    assert unit_parameter_shapes(cfg, VOCAB) == built


def test_flops_by_hand():
    """h = 64, 4 heads of 16, 2 K/V heads, SwiGLU inner 48 (in rows 96), V = 96, L = 2, s = 16:
    matmul weights per block: QKV 64 x (64 + 2 x 2 x 16 = 128) = 8192, attention out 4096,
    MLP in 64 x 96 = 6144, MLP out 48 x 64 = 3072: 21504. Forward per token: 2 x 21504 + 2 x 2 x 16 x 64
    (QK^T and attention x V) = 47104 per block; head 2 x 64 x 96 = 12288. Training x 3:
    3 x (2 x 47104 + 12288) = 319488. With a window of 4 the span is 5 keys, not 16."""
    cfg = llama(num_kv_heads=2)
    assert model_flops_per_token(cfg, VOCAB) == 319488.0
    windowed = llama(num_kv_heads=2, sliding_window_width=4)
    assert model_flops_per_token(windowed, VOCAB) == 319488.0 - 3 * 2 * 2 * 2 * (16 - 5) * 64


@pytest.mark.parametrize("over", [dict(num_kv_heads=2), dict(num_kv_heads=1, sliding_window_width=4), dict()],
                         ids=["gqa", "mqa_window", "mha"])
def test_activation_bytes_equal_what_autograd_keeps(over):
    """A Llama block's share of backward_activation_bytes (fp32, no checkpointing) is, within 12%, the
    bytes of the distinct tensors autograd saves for backward over the block (saved-tensor hooks)."""
    cfg = llama(num_layers=1, **over)
    torch.manual_seed(0)
    model = GPTNeoX(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randint(0, VOCAB, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = model.embed(x)
        rope = (model.rope_cos[:cfg.seq_length], model.rope_sin[:cfg.seq_length])
        model.layers[0](h, rope)
    tokens = 2 * cfg.seq_length
    block = backward_activation_bytes(cfg, VOCAB, 2, 4).start - head_activation_bytes(tokens, 64, VOCAB, 4, False)
    # The model neglects the [T, 1] RMS factors, SDPA's log-sum-exp, the token ids and rotary tables,
    # and counts rotary's inputs as tensors of their own where some are views: an estimate within
    # 12% (the NeoX-shaped block's own formula is 7.7% above what autograd keeps at this size; which
    # copies SDPA keeps depends on its kernel).
    assert block == pytest.approx(sum(saved.values()), rel=0.12)


def _neox(name: str, vocab: int):
    return load_config([str(NEOX / name)], [f"vocab_size={vocab}"], env={}, notices=[])


@needs_neox
@pytest.mark.parametrize("name,vocab,inner,mlp_bias,expected", [
    # Hand counts: V h (embedding) + L x block + h + V h (final RMSNorm, untied head); a block is two
    # RMSNorms (2h), Q K V and out (4h^2), MLP in (2 inner x h) and out (inner x h), + MLP biases
    # (2 inner + h) where the config keeps them (use_bias_in_mlp defaults to true in GPT-NeoX).
    ("llama/7B.yml", 32000, 11008, False, 6_738_415_616),   # = Llama-7B's published count
    ("llama2/7B.yml", 32000, 11008, True, 6_739_251_200),   # Llama-2-7B's 6,738,415,616 + 835,584 MLP biases
    ("llama2/codellama_7B.yml", 32016, 5632, True, 4_625_108_992),  # no intermediate_size: 4h -> 5632
])
def test_gpt_neox_llama_configs_load_with_the_right_shape(name, vocab, inner, mlp_bias, expected):
    cfg = _neox(name, vocab)
    h, layers = 4096, 32
    block = 2 * h + 4 * h * h + 3 * inner * h + ((2 * inner + h) if mlp_bias else 0)
    hand = vocab * h + layers * block + h + vocab * h
    assert hand == expected
    assert parameter_count(cfg.model, cfg.model.padded_vocab_size) == expected
    m = cfg.model
    assert (m.norm, m.activation, m.gpt_j_residual, m.no_weight_tying, m.use_bias_in_attn_linear) == \
        ("rmsnorm", "swiglu", False, True, False)


@needs_neox
def test_gpt_neox_mistral_config_is_refused_naming_the_key_and_ours_runs():
    with pytest.raises(ConfigError) as err:
        _neox("mistral/7B.yml", 32000)
    line = str(err.value)
    assert "\n" not in line and line.startswith("intermediate_size: 14336") and "43008" in line
    ours = load_config([str(REPO / "configs" / "mistral-7B.yml")], env={}, notices=[])
    m = ours.model
    assert (m.num_kv_heads, m.sliding_window_width) == (8, 4096)
    # Mistral-7B-v0.1 (HF mistralai/Mistral-7B-v0.1): 7,241,732,096 = 2 V h + h + 32 x (2h + h^2 x (1 + 2/4 + 1)
    # + 3 x 14336 h)
    h = 4096
    assert parameter_count(m, 32000) == 2 * 32000 * h + h + 32 * (2 * h + 2 * h * h + 2 * h * 1024 + 3 * 14336 * h) \
        == 7_241_732_096


def test_our_llama2_7b_is_llama2_7b():
    cfg = load_config([str(REPO / "configs" / "llama2-7B.yml")], env={}, notices=[])
    assert parameter_count(cfg.model, cfg.model.padded_vocab_size) == 6_738_415_616  # HF meta-llama/Llama-2-7b-hf


def _dry_run(*configs: str):
    from test_dry_run import deepy, slurm_job
    return deepy("--dry-run", *configs, "configs/frontier.yml", "--set", "zero_optimization.plan=auto",
                 env_extra=slurm_job(48, gpus=8))


@needs_neox
def test_dry_run_of_gpt_neox_llama2_7b_on_48_frontier_nodes():
    proc = _dry_run(str(NEOX / "llama2" / "7B.yml"), "--set", "vocab_size=32000", "--set", "bf16.enabled=true")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "srun --nodes=48 --ntasks=384" in out
    assert "32 layers, hidden 4096, 32 heads, rmsnorm, swiglu MLP 11008, seq 4096" in out
    assert "6,739,251,200 parameters (6.74B)" in out
    assert re.search(r"chosen by zero_optimization.plan auto: .* peak [\d.]+ GB of 64 GB", out)
    assert re.search(r"model states per device .*: [\d.]+ GB", out)


@pytest.mark.slow  # a second deepy dry run (the planner's search): ~5 s, more on a loaded machine
def test_dry_run_of_our_mistral_on_48_frontier_nodes():
    proc = _dry_run("configs/mistral-7B.yml")
    assert proc.returncode == 0, proc.stderr
    assert "32 heads (8 K/V heads), rmsnorm, swiglu MLP 14336, sliding window 4096, seq 8192" in proc.stdout
    assert "7,241,732,096 parameters (7.24B)" in proc.stdout
    assert math.isfinite(float(re.search(r"predicted optimizer step .*?: ([\d.]+) s", proc.stdout).group(1)))
