"""The GPT-NeoX model: shapes, causality, an independent reference block, init, units, FLOPs."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.config.schema import ModelConfig
from megatron.model import (
    GPTNeoX, ModelConfigError, model_flops_per_token, num_parameters, parameter_count, unit_parameter_counts,
)
from megatron.model.gpt_neox import init_std

VOCAB = 128


def tiny_cfg(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                  padded_vocab_size=VOCAB, no_weight_tying=True)
    fields.update(overrides)
    return ModelConfig(**fields)


def build(seed: int = 0, **overrides) -> GPTNeoX:
    torch.manual_seed(seed)
    return GPTNeoX(tiny_cfg(**overrides))


def perturb(model: torch.nn.Module, seed: int = 1, scale: float = 0.05) -> None:
    """Move every parameter off its init (non-zero biases, LayerNorm weights != 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def tokens(batch: int = 2, seq: int = 16, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- shapes

def test_forward_shape_and_vocab_override():
    logits = build()(tokens())
    assert logits.shape == (2, 16, VOCAB) and logits.dtype == torch.float32
    torch.manual_seed(0)
    other = GPTNeoX(tiny_cfg(), vocab_size=96)
    assert other(tokens() % 96).shape == (2, 16, 96)


def test_defaults_for_unset_sizes():
    model = build(intermediate_size=None, max_position_embeddings=None, seq_length=12)
    assert model.layers[0].mlp.dense_h_to_4h.out_features == 4 * 64
    assert model.rope_cos.shape == (12, 16)  # seq_length positions x head_dim 16
    with pytest.raises(ModelConfigError, match="max_position_embeddings"):
        model(tokens(seq=13))


@pytest.mark.parametrize("rotary_pct,parallel", [(0.25, True), (1.0, False), (0.5, False)])
def test_causality(rotary_pct, parallel):
    model = build(rotary_pct=rotary_pct, gpt_j_residual=parallel).eval()
    perturb(model)
    t = 6
    a = tokens(seq=12)
    b = a.clone()
    b[:, t + 1] = (b[:, t + 1] + 1) % VOCAB
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, : t + 1], lb[:, : t + 1], rtol=0, atol=1e-6)
    assert (la[:, t + 1] - lb[:, t + 1]).abs().max() > 1e-3  # the changed position itself does change


# ------------------------------------------------------------------ block vs independent reference

def reference_block(block, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The NeoX block written out longhand: explicit pairwise rotation, masked softmax attention."""
    B, T, H = x.shape
    nh = cfg.num_attention_heads
    hd = H // nh
    rot = int(hd * cfg.rotary_pct)

    def ln(mod, v):
        mu = v.mean(-1, keepdim=True)
        var = ((v - mu) ** 2).mean(-1, keepdim=True)
        return (v - mu) / torch.sqrt(var + cfg.layernorm_epsilon) * mod.weight + mod.bias

    def rotate(v):  # v [B, nh, T, hd]; dim i pairs with dim i + rot/2, angle pos * base^(-2i/rot)
        out = v.clone()
        half = rot // 2
        for i in range(half):
            theta = torch.arange(T, dtype=torch.float64) * cfg.rotary_emb_base ** (-2.0 * i / rot)
            c, s = torch.cos(theta).to(v.dtype), torch.sin(theta).to(v.dtype)
            a, b = v[..., i], v[..., i + half]
            out[..., i] = a * c - b * s
            out[..., i + half] = b * c + a * s
        return out

    def attention(v):
        att = block.attention
        qkv = v @ att.query_key_value.weight.T + att.query_key_value.bias
        qkv = qkv.view(B, T, nh, 3, hd)  # per head: q, k, v one after another
        q, k, val = (qkv[:, :, :, j].transpose(1, 2) for j in range(3))
        q, k = rotate(q), rotate(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        y = (probs @ val).transpose(1, 2).reshape(B, T, H)
        return y @ att.dense.weight.T + att.dense.bias

    def mlp(v):
        m = block.mlp
        u = v @ m.dense_h_to_4h.weight.T + m.dense_h_to_4h.bias
        u = 0.5 * u * (1.0 + torch.erf(u / math.sqrt(2.0)))
        return u @ m.dense_4h_to_h.weight.T + m.dense_4h_to_h.bias

    if cfg.gpt_j_residual:
        return x + attention(ln(block.input_layernorm, x)) + mlp(ln(block.post_attention_layernorm, x))
    y = x + attention(ln(block.input_layernorm, x))
    return y + mlp(ln(block.post_attention_layernorm, y))


@pytest.mark.parametrize("rotary_pct,parallel", [(0.25, True), (0.25, False), (1.0, True), (1.0, False)])
def test_block_matches_reference(rotary_pct, parallel):
    model = build(rotary_pct=rotary_pct, gpt_j_residual=parallel, rotary_emb_base=100).eval()
    perturb(model)
    cfg = model.config
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(5))
    rope = (model.rope_cos[:10], model.rope_sin[:10])
    with torch.no_grad():
        ours = model.layers[0](x, rope)
        ref = reference_block(model.layers[0], x, cfg)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_parallel_residual_changes_the_function():
    seq, par = build(gpt_j_residual=False).eval(), build(gpt_j_residual=True).eval()
    par.load_state_dict(seq.state_dict())
    perturb(seq), perturb(par)
    with torch.no_grad():
        assert (seq(tokens()) - par(tokens())).abs().max() > 1e-3


# --------------------------------------------------------------------------------------- init

def test_init_std_golden_values():
    cfg = tiny_cfg(init_method_std=0.02)
    assert init_std("small_init", cfg) == pytest.approx(0.07905694150420949)  # sqrt(2 / (5 * 64))
    assert init_std("wang_init", cfg) == pytest.approx(0.125)  # 2 / (2 * sqrt(64))
    assert init_std("normal", cfg) == pytest.approx(0.02)
    assert init_std("scaled_normal", cfg) == pytest.approx(0.01)  # 0.02 / sqrt(2 * 2)
    assert init_std("xavier_normal", cfg) is None


def test_init_applies_methods_by_role():
    model = build(init_method="small_init", output_layer_init_method="wang_init")
    block = model.layers[1]

    def std(t):
        return t.detach().std().item()

    # Each matrix has >= 8192 entries: the sample std is within ~1% of the true one; 5% leaves margin.
    for w in (model.embed.embed_in.weight, block.attention.query_key_value.weight,
              block.mlp.dense_h_to_4h.weight, model.final.embed_out.weight):
        assert std(w) == pytest.approx(0.0790569, rel=0.05)
    for w in (block.attention.dense.weight, block.mlp.dense_4h_to_h.weight):
        assert std(w) == pytest.approx(0.125, rel=0.05)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "norm" in name:
            assert torch.all(p == 1), name


def test_init_normal_and_xavier():
    model = build(init_method="xavier_normal", output_layer_init_method="normal", init_method_std=0.05)
    qkv = model.layers[0].attention.query_key_value.weight
    assert qkv.std().item() == pytest.approx(math.sqrt(2.0 / (64 + 192)), rel=0.05)
    assert model.layers[0].mlp.dense_4h_to_h.weight.std().item() == pytest.approx(0.05, rel=0.05)


def test_init_deterministic_under_seed():
    a, b, c = build(seed=7), build(seed=7), build(seed=8)
    for (n, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.layers[0].attention.query_key_value.weight, c.layers[0].attention.query_key_value.weight)


@pytest.mark.parametrize("overrides,match", [
    (dict(init_method="orthogonal_ish"), "init_method"),
    (dict(output_layer_init_method="bogus"), "output_layer_init_method"),
    (dict(num_attention_heads=5), "divide"),
    (dict(rotary_pct=0.1), "rotates"),
    (dict(rotary_pct=0.0), "rotary_pct"),
    (dict(activation="relu"), "activation"),
    (dict(padded_vocab_size=None), "vocabulary"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ModelConfigError, match=match):
        GPTNeoX(tiny_cfg(**overrides))


# --------------------------------------------------------------------------------- units and tying

def test_units_order_and_ownership():
    model = build()
    units = model.units()
    assert units[0] is model.embed and units[-1] is model.final
    assert units[1:-1] == list(model.layers) and len(units) == 2 + 2
    owned = [id(p) for u in units for p in u.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())  # each parameter in exactly one unit
    assert all(len(list(u.buffers())) == 0 for u in units)
    assert not model.has_tied_embeddings


@pytest.mark.parametrize("checkpointing", [False, True])
def test_forward_calls_each_unit_once_in_order(checkpointing):
    model = build(checkpoint_activations=checkpointing)
    calls = []
    for i, unit in enumerate(model.units()):
        unit.register_forward_pre_hook(lambda mod, args, i=i: calls.append(("pre", i)))
        unit.register_forward_hook(lambda mod, args, out, i=i: calls.append(("post", i)))
    model(tokens())
    assert calls == [(kind, i) for i in range(4) for kind in ("pre", "post")]


def test_tied_embeddings():
    model = build(no_weight_tying=False)
    assert model.has_tied_embeddings
    assert model.final.embed_out.weight is model.embed.embed_in.weight
    assert num_parameters(model) == num_parameters(build()) - VOCAB * 64
    rope = (model.rope_cos[:16], model.rope_sin[:16])
    h = model.embed(tokens())
    for block in model.layers:
        h = block(h, rope)
    expected = model.final.final_layer_norm(h) @ model.embed.embed_in.weight.T
    torch.testing.assert_close(model(tokens()), expected)


# --------------------------------------------------------------------- activation checkpointing

def test_activation_checkpointing_same_gradients():
    plain = build(seed=4)
    perturb(plain)
    ckpt = build(seed=4, checkpoint_activations=True)
    ckpt.load_state_dict(plain.state_dict())
    calls = []
    for i, unit in enumerate(ckpt.units()):
        unit.register_forward_pre_hook(lambda mod, args, i=i: calls.append(("pre", i)))
        unit.register_forward_hook(lambda mod, args, out, i=i: calls.append(("post", i)))
    x, y = tokens(), tokens(seed=9)
    for model in (plain, ckpt):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    # Forward runs every unit once; backward recomputes each block whole (both hooks), last first.
    forward = [(kind, i) for i in range(4) for kind in ("pre", "post")]
    assert calls == forward + [("pre", 2), ("post", 2), ("pre", 1), ("post", 1)]
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------- dtype and dropout

def test_bf16_forward_close_to_fp32():
    model = build().eval()
    perturb(model)
    with torch.no_grad():
        ref = model(tokens())
        low = model.to(torch.bfloat16)(tokens())
    assert low.dtype == torch.bfloat16 and model.rope_cos.dtype == torch.bfloat16
    assert (low.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_dropout_only_in_training():
    model = build(hidden_dropout=0.5, attention_dropout=0.5)
    plain = build(hidden_dropout=0.0, attention_dropout=0.0)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens()), plain.eval()(tokens()))
        assert (model.train()(tokens()) - plain(tokens())).abs().max() > 1e-3


def test_meta_device_build_then_init():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPTNeoX(tiny_cfg())
    model = model.to_empty(device="cpu")
    model.init_weights()
    reference = build()
    torch.testing.assert_close(model.rope_cos, reference.rope_cos, rtol=0, atol=0)
    assert model(tokens()).isfinite().all()


# ---------------------------------------------------------------------------- sizes and FLOPs

@pytest.mark.parametrize("untied", [True, False])
def test_unit_parameter_counts_match_model(untied):
    cfg = tiny_cfg(no_weight_tying=untied, intermediate_size=96)
    torch.manual_seed(0)
    model = GPTNeoX(cfg)
    embed_ids = {id(p) for p in model.embed.parameters()}
    measured = [sum(p.numel() for p in u.parameters() if u is model.embed or id(p) not in embed_ids)
                for u in model.units()]
    assert unit_parameter_counts(cfg, VOCAB) == measured
    assert parameter_count(cfg, VOCAB) == num_parameters(model)


def test_unit_parameter_shapes_match_the_built_model():
    """What the DeepSpeed model counts per parameter (deepspeed_model.py): names and shapes unit by unit."""
    from megatron.model.sizes import unit_parameter_shapes
    cfg = tiny_cfg(no_weight_tying=True, intermediate_size=96)
    model = GPTNeoX(cfg)
    built = [[(name, tuple(p.shape)) for name, p in unit.named_parameters()] for unit in model.units()]
    assert unit_parameter_shapes(cfg, VOCAB) == built
    assert [sum(math.prod(s) for _, s in unit) for unit in built] == unit_parameter_counts(cfg, VOCAB)


def test_model_flops_per_token_golden():
    cfg = tiny_cfg()  # L=2, h=64, f=256, V=128, s=16
    # matmul weights: 2 * (3*64*64 + 64*64 + 2*64*256) + 64*128 = 2 * 49152 + 8192 = 106496
    # forward: 2 * 106496 + 2 layers * 2 * (2 * 16 * 64) = 212992 + 8192 = 221184; training: x3
    assert model_flops_per_token(cfg, VOCAB, 16) == 663552.0
    # Attention term grows with sequence: +2 layers * 4 * 64 * 3 per extra token of context.
    assert model_flops_per_token(cfg, VOCAB, 17) - model_flops_per_token(cfg, VOCAB, 16) == 1536.0


def test_parameter_count_of_neox_20b():
    """GPT-NeoX-20B (44 x 6144, vocab 50432, untied), the ~20.55B of the NeoX-20B paper.

    By hand: 44 blocks x (12h^2 + 13h) = 19,934,846,976; embedding Vh = 309,854,208;
    final LayerNorm + untied head 2h + Vh = 309,866,496; total 20,554,567,680.
    """
    cfg = ModelConfig(num_layers=44, hidden_size=6144, num_attention_heads=64, seq_length=2048,
                      rotary_pct=0.25, gpt_j_residual=True, no_weight_tying=True, padded_vocab_size=50432)
    assert parameter_count(cfg, 50432) == 20_554_567_680
