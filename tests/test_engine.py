"""ZeRO-topo engine, single process: AdamW slice math, parity with torch on one rank, refusals.

Also holds the helpers the multi-process tests (test_engine_dist.py) share: the tiny model, the
deterministic per-rank batches and the single-process reference (torch.optim.AdamW with decay /
no-decay groups, clip_grad_norm_, the same global batch).
"""
from __future__ import annotations

import copy

import pytest
import torch

from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.config.schema import ModelConfig, OptimizerConfig
from megatron.engine import adamw_param_groups, lm_loss
from megatron.model import GPTNeoX
from megatron.topology import ProcessGroups, ShardFactors, Topology
from megatron.engine import Communicator, EngineError, ZeroTopoEngine
from megatron.engine.optimizer import AdamWHyper, adamw_update

VOCAB, SEQ, MICRO_BSZ, SEED = 32, 8, 2, 1234
# Parity settings: a small lr keeps Adam from amplifying the rounding noise of gradients that cancel to
# ~1e-5 (differences stay ~40x under the 1e-5 tolerance); a large weight decay keeps a wrong decay
# mask visible (lr x wd = 1e-3 per step). Clipping at 0.5 is active (norms are ~0.6-1.3).
OPT = OptimizerConfig(lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=1.0, gradient_clipping=0.5)
LR = 1e-3
TRAIN_LR = 1e-2  # for the "loss falls" checks


def tiny_cfg(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=SEQ, no_weight_tying=True)
    fields.update(overrides)
    return ModelConfig(**fields)


def build_model(**overrides) -> GPTNeoX:
    torch.manual_seed(SEED)
    return GPTNeoX(tiny_cfg(**overrides), VOCAB)


def make_batch(step: int, micro: int, rank: int) -> dict:
    """Rank ``rank``'s micro-batch ``micro`` of optimizer step ``step`` (deterministic)."""
    gen = torch.Generator().manual_seed(100_000 * step + 1_000 * micro + rank)
    toks = torch.randint(0, VOCAB, (MICRO_BSZ, SEQ + 1), generator=gen)
    return {"tokens": toks[:, :-1], "labels": toks[:, 1:]}


def global_batch(step: int, micro: int, world_size: int) -> dict:
    parts = [make_batch(step, micro, r) for r in range(world_size)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def reference_run(world_size: int, steps: int, accum: int, **model_overrides) -> dict:
    """Single-process training on the same global batches: per-step mean loss, grad norm, final params."""
    model = build_model(**model_overrides)
    opt = torch.optim.AdamW(adamw_param_groups(model, OPT.weight_decay), lr=LR, betas=tuple(OPT.betas),
                            eps=OPT.eps, **({"fused": True} if OPT.fused else {"foreach": False}))
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            loss = lm_loss(model, global_batch(step, micro, world_size))
            (loss / accum).backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.gradient_clipping)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / accum)
    return {"losses": losses, "norms": norms,
            "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def max_param_diff(params: dict, reference: dict) -> float:
    assert set(params) == set(reference), set(params) ^ set(reference)
    return max((params[k] - reference[k]).abs().max().item() for k in reference)


def single_rank_engine(model, precision="fp32", accum=2, preset=None) -> ZeroTopoEngine:
    one = Topology.single_node(1)
    layout = ShardLayout.from_topology(one, preset=preset) if preset else ShardLayout.from_topology(one, ShardFactors(1, 1, 1))
    groups = ProcessGroups(one, layout, 0)
    return ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision=precision, accumulation_steps=accum))


# ------------------------------------------------------------------------------------------ AdamW math

def test_adamw_slice_equals_torch_adamw_elementwise():
    """One flat slice with a decay mask == torch AdamW on separate decay / no-decay tensors."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 5), (5,), (3, 4), (7,)]  # matrices decay, vectors do not
    params = [torch.randn(s, generator=gen) for s in shapes]
    torch_params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW([{"params": [p for p in torch_params if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in torch_params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=3e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    flat = torch.cat([p.reshape(-1) for p in params])
    exp_avg, exp_avg_sq = torch.zeros_like(flat), torch.zeros_like(flat)
    offsets, runs, start = [], [], 0
    for p in params:
        offsets.append(start)
        if p.ndim >= 2:
            runs.append((start, start + p.numel()))
        start += p.numel()
    hyper = AdamWHyper(0.9, 0.95, 1e-8, 0.1)
    for step in range(1, 4):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(torch_params, grads):
            p.grad = g.clone()
        opt.step()
        adamw_update(flat, torch.cat([g.reshape(-1) for g in grads]), exp_avg, exp_avg_sq, runs,
                     lr=3e-2, step=step, hyper=hyper)
    for p, off in zip(torch_params, offsets):
        torch.testing.assert_close(flat[off: off + p.numel()].view(p.shape), p.detach(), rtol=0, atol=0)


def test_fused_adamw_slices_equal_torch_fused_adamw_bitwise():
    """fused_adamw_update on flat slices cut anywhere (several units, decay runs, padding) ==
    torch.optim.AdamW(fused=True) on the separate parameters, bit for bit."""
    from megatron.engine.optimizer import fused_adamw_update, plain_ranges
    gen = torch.Generator().manual_seed(1)
    shapes = [(6, 5), (5,), (3, 4), (7,), (17, 3), (2,)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    torch_params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW([{"params": [p for p in torch_params if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in torch_params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=3e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    flat = torch.cat([p.reshape(-1) for p in params] + [torch.zeros(3)])  # 3 elements of padding
    exp_avg, exp_avg_sq = torch.zeros_like(flat), torch.zeros_like(flat)
    offsets, start = [], 0
    for p in params:
        offsets.append(start)
        start += p.numel()
    cuts = [0, 11, 30, 31, flat.numel()]  # "units" cut inside parameters
    def runs_in(a, b):  # the decay runs of flat[a:b], relative to a
        out = []
        for p, off in zip(params, offsets):
            lo, hi = max(a, off), min(b, off + p.numel())
            if p.ndim >= 2 and lo < hi:
                out.append((lo - a, hi - a))
        return out
    assert plain_ranges(10, [(2, 4), (6, 8)]) == [(0, 2), (4, 6), (8, 10)]
    hyper = AdamWHyper(0.9, 0.95, 1e-8, 0.1)
    for step in range(1, 4):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(torch_params, grads):
            p.grad = g.clone()
        opt.step()
        grad = torch.cat([g.reshape(-1) for g in grads] + [torch.zeros(3)])
        fused_adamw_update([(flat[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], runs_in(a, b))
                            for a, b in zip(cuts, cuts[1:])], lr=3e-2, step=step, hyper=hyper)
    for p, off in zip(torch_params, offsets):
        torch.testing.assert_close(flat[off: off + p.numel()].view(p.shape), p.detach(), rtol=0, atol=0)
    assert torch.equal(flat[-3:], torch.zeros(3))  # padding: zero gradient, no decay, stays zero


# ------------------------------------------------------------------------------- one rank vs torch

@pytest.mark.parametrize("checkpoint_activations", [False, True])
def test_one_rank_matches_reference(checkpoint_activations):
    steps, accum = 3, 2
    ref = reference_run(1, steps, accum, checkpoint_activations=checkpoint_activations)
    model = build_model(checkpoint_activations=checkpoint_activations)
    engine = single_rank_engine(model, accum=accum)
    for step in range(steps):
        losses = [engine.forward_backward(make_batch(step, m, 0)).item() for m in range(accum)]
        out = engine.optimizer_step(LR)
        assert sum(losses) / accum == pytest.approx(ref["losses"][step], abs=1e-5)
        assert out["grad_norm"] == pytest.approx(ref["norms"][step], rel=1e-5)
    state = engine.full_state_dict()
    assert max_param_diff(state, ref["params"]) < 1e-5
    # No collective on one rank: the ledger stays empty.
    assert all(v == 0 for v in engine.ledger.snapshot().values())
    assert engine.eval_loss(make_batch(9, 0, 0)).item() == pytest.approx(
        lm_loss(_model_with(ref["params"], checkpoint_activations), make_batch(9, 0, 0)).item(), abs=1e-5)


def _model_with(params: dict, checkpoint_activations: bool) -> GPTNeoX:
    model = build_model(checkpoint_activations=checkpoint_activations)
    model.load_state_dict(params, strict=False)
    return model.eval()


def test_model_state_bytes_one_rank():
    model = build_model()
    numel = sum(p.numel() for p in model.parameters())
    engine = single_rank_engine(model)
    mem = engine.model_state_bytes()
    # One rank: the whole (unpadded, N = 1) model four bytes per element in each category.
    assert mem == {"weights": 4 * numel, "secondary": 0, "grad_accumulator": 4 * numel, "master": 4 * numel,
                   "moments": 8 * numel}


def test_bf16_trains_on_one_rank():
    model = build_model()
    engine = single_rank_engine(model, precision="bfloat16", accum=1)
    batch = make_batch(0, 0, 0)
    losses = []
    for _ in range(5):
        losses.append(engine.forward_backward(batch).item())
        engine.optimizer_step(TRAIN_LR)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1
    assert engine.units[0].flat.dtype == torch.bfloat16


def test_fp16_loss_scale_trains_on_one_rank():
    engine = single_rank_engine(build_model(), precision="fp16", accum=1)
    batch = make_batch(0, 0, 0)
    losses = [engine.forward_backward(batch).item() for _ in range(1)]
    out = engine.optimizer_step(TRAIN_LR)
    for _ in range(4):
        losses.append(engine.forward_backward(batch).item())
        out = engine.optimizer_step(TRAIN_LR)
    assert out["loss_scale"] > 1 and losses[-1] < losses[0]


def test_checkpoint_state_round_trip_one_rank():
    from megatron.checkpointing.param_slices import assemble
    engine = single_rank_engine(build_model(), accum=1)
    engine.forward_backward(make_batch(0, 0, 0))
    engine.optimizer_step(LR)
    saved = assemble([copy.deepcopy(engine.checkpoint_state())])
    engine.forward_backward(make_batch(1, 0, 0))
    engine.optimizer_step(LR)
    after_two = engine.full_state_dict()
    engine.load_full_state(saved)
    engine.forward_backward(make_batch(1, 0, 0))
    engine.optimizer_step(LR)
    again = engine.full_state_dict()
    assert all(torch.equal(after_two[k], again[k]) for k in after_two)


# ------------------------------------------------------------------------------------------ refusals

def test_refuses_tied_embeddings():
    torch.manual_seed(0)
    model = GPTNeoX(tiny_cfg(no_weight_tying=False), VOCAB)
    with pytest.raises(EngineError, match="no_weight_tying"):
        single_rank_engine(model)


def test_refuses_parameters_outside_units_and_bad_calls():
    model = build_model()
    with pytest.raises(EngineError, match="outside every unit"):
        groups = ProcessGroups(Topology.single_node(1), ShardLayout.from_topology(Topology.single_node(1), ShardFactors(1, 1, 1)), 0)
        ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="fp32", accumulation_steps=1), units=model.units()[:-1])
    engine = single_rank_engine(build_model(), accum=1)
    with pytest.raises(EngineError, match="after 0 micro-batches"):
        engine.optimizer_step(LR)
    engine.forward_backward(make_batch(0, 0, 0))
    with pytest.raises(EngineError, match="before optimizer_step"):
        engine.forward_backward(make_batch(0, 1, 0))
    with pytest.raises(EngineError, match="precision"):
        single_rank_engine(build_model(), precision="int8")


def test_refuses_an_unknown_or_quantized_cross_node_reduction():
    from megatron.engine.quantized import QuantSpec
    groups = ProcessGroups(Topology.single_node(1), ShardLayout.from_topology(Topology.single_node(1), ShardFactors(1, 1, 1)), 0)
    for how, quant in (("ring", None), ("all_reduce", QuantSpec(cross_node_grad_bits=4))):
        model = build_model()
        with pytest.raises(EngineError, match=r"cross_node_reduction .*all_reduce \(unquantized: cross_node_grad_bits 0"):
            ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="fp32", accumulation_steps=1, quant=quant, cross_node_reduction=how))


def test_engine_from_config_one_process():
    from megatron.config.schema import NeoXConfig
    from megatron.engine.setup import engine_from_config

    cfg = NeoXConfig()
    cfg.zero.stage, cfg.training.gradient_accumulation_steps, cfg.optimizer = 3, 1, OPT
    engine = engine_from_config(cfg, build_model(), lm_loss, world_size=1)
    assert engine.groups.factors.as_tuple() == (1, 1, 1) and engine.preset == "stage3"
    engine.forward_backward(make_batch(0, 0, 0))
    assert engine.optimizer_step(LR)["grad_norm"] > 0
    cfg.zero.zero_quantized_weights = True
    quantized = engine_from_config(cfg, build_model(), lm_loss, world_size=1)
    assert (quantized.quant.weight_gather_bits, quantized.quant.refresh_bits) == (8, 8)


@pytest.mark.parametrize("precision, fused, reads", [
    ("fp32", True, 0), ("bfloat16", True, 0),  # the fused kernel skips a non-finite step on its own
    ("fp16", True, 1),                           # the dynamic loss scale reads the norm
])  # (the for-loop AdamW reads each parameter's step count, which stays on the host on a GPU too)
def test_one_process_host_reads(precision, fused, reads):
    """What would stall a GPU's queue in one process's step, counted (the ops that return a value to
    the host): none in forward and backward; in the optimizer step only where a decision needs it."""
    from megatron.engine import SingleProcessEngine
    from megatron.logging.host_syncs import HostSyncs
    opt = OptimizerConfig(lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.01, gradient_clipping=1.0, fused=fused)
    engine = SingleProcessEngine(build_model(), lm_loss, opt, precision, 1, torch.device("cpu"))
    for step in range(2):
        with HostSyncs() as backward_reads:
            engine.forward_backward(make_batch(step, 0, 0))
        with HostSyncs() as step_reads:
            engine.optimizer_step(1e-3)
        assert (backward_reads.count, step_reads.count) == (0, reads), step
