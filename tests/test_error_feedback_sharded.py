"""Error feedback sharded like the state it corrects, in unscaled units, reset on skipped steps.

- Only the reduction hop across nodes keeps a residual, of this rank's input to it: the ladder's
  cross hop S/g (as large as the rank's gradient accumulator), zeropp's rail hop S/R. The memory
  model predicts exactly the bytes the engines hold (4 simulated ranks, 2 nodes x 2).
- Residuals are kept in unscaled units: a loss scale that changes between steps (fp16's dynamic
  scale) changes nothing in what is paid back. Checked on both code paths (the plain encode of a
  first hop and the fused reduce-requantize of a later hop) against a run at scale 1, bit for bit.
- A skipped step (fp16 overflow) leaves every residual zero, not the quantization error of a
  sanitised inf, and training goes on with finite residuals.
"""
from __future__ import annotations

import math

import torch

from dist_harness import run_ranks
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.config.schema import OptimizerConfig
from megatron.engine import lm_loss
from megatron.topology import ProcessGroups, RankGroup, Topology
from megatron.engine import Communicator, ZeroTopoEngine
from megatron.analytic.comm_model import CommSpec
from megatron.config.quant_spec import QuantSpec
from megatron.analytic.memory_model import predict_model_state_bytes
from megatron.engine.comm import Pending
from megatron.engine.quantized import QuantizedCollectives
from test_engine import build_model, make_batch

BLOCK = 64
LAYOUT = [2, 2]
OPT = OptimizerConfig(lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0, gradient_clipping=1.0)
LADDER_EF = QuantSpec(grad_reduce_bits=4, cross_node_grad_bits=4, block_size=BLOCK, impl="reference", error_feedback=True)
QGZ_EF = QuantSpec(grad_reduce_bits=4, block_size=BLOCK, impl="reference", error_feedback=True)


# ------------------------------------------------------------------ unscaled units (one process)

class _LoopbackComm:
    """An all-to-all that hands every message back to the sender: over a "group" of k it makes this
    rank the receiver of all k chunks, so a first hop sums k different chunks (whose requantization,
    unlike that of a single dequantized chunk, loses something)."""

    def start_all_to_all(self, received, send, group, phase):
        received.copy_(send)
        return {}, Pending(None)


def _collectives() -> QuantizedCollectives:
    return QuantizedCollectives(_LoopbackComm(), QuantSpec(grad_reduce_bits=4, block_size=BLOCK, impl="reference"),
                                torch.device("cpu"))


def _gradients(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(4 * BLOCK, generator=gen) / torch.rand(4 * BLOCK, generator=gen).add(0.05)
            for _ in range(steps)]


def _run(scales: list[float], two_hops: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Reduce step t's gradient times scales[t] through one or two loopback hops with the residual
    on the last; returns each step's result divided by its scale and the final residual."""
    qc, solo, pair = _collectives(), RankGroup("rail", (0,)), RankGroup("node", (0, 1))
    residual = torch.zeros(2 * BLOCK if two_hops else 4 * BLOCK)
    outs = []
    for grad, scale in zip(_gradients(len(scales)), scales):
        hops = [(pair, None), (solo, residual)] if two_hops else [(solo, residual)]
        outs.append(qc.reduce(grad * scale, hops, "checkpoint", 4, residual_scale=scale) / scale)
    return outs, residual


def test_residuals_are_unscaled_so_a_changing_loss_scale_changes_nothing():
    scales = [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 17, 2.0 ** 10]
    for two_hops in (False, True):  # encode (first hop) and the fused reduce-requantize (later hop)
        want, want_residual = _run([1.0] * len(scales), two_hops)
        got, got_residual = _run(scales, two_hops)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), two_hops
        assert torch.equal(got_residual, want_residual) and want_residual.abs().max() > 0, two_hops


def test_error_feedback_pays_back_within_half_a_step_across_scale_changes():
    """An independent check of what the bit-for-bit test compares: sum_t q_t - sum_t g_t equals
    minus the last residual, which is under half an INT4 step of the largest block."""
    scales = [2.0 ** 16, 2.0 ** 14, 2.0 ** 18, 2.0 ** 12]
    outs, residual = _run(scales, two_hops=False)
    grads = _gradients(len(scales))
    drift = sum(o.double() for o in outs) - sum(g.double() for g in grads)
    assert torch.allclose(drift, -residual.double(), atol=1e-4)
    step = max(float(g.abs().max()) for g in grads) / 7
    assert residual.abs().max() <= step  # a compensated input can exceed one gradient's amax


# --------------------------------------------------------------- the engines (4 simulated ranks)

def _engine(rank: int, preset: str, quant: QuantSpec, precision: str) -> ZeroTopoEngine:
    topology = Topology.simulated(LAYOUT)
    groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset=preset), rank)
    model = build_model(hidden_size=32, num_attention_heads=4)
    return ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision=precision, accumulation_steps=1, quant=quant))


def _step(engine: ZeroTopoEngine, rank: int, step: int) -> dict:
    engine.forward_backward(make_batch(step, 0, rank))
    return engine.optimizer_step(1e-3)


def _residual_stats(engine: ZeroTopoEngine) -> dict:
    values = [r for u in engine.units for r in u.residuals.values()]
    return {"max": max(float(r.abs().max()) for r in values),
            "finite": all(bool(torch.isfinite(r).all()) for r in values)}


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for preset, quant in (("zero_topo", LADDER_EF), ("zeropp", QGZ_EF)):
        engine = _engine(rank, preset, quant, "fp32")
        _step(engine, rank, 0)
        out[preset] = {"memory": engine.model_state_bytes(),
                       "residual_sizes": [{h: r.numel() for h, r in u.residuals.items()} for u in engine.units],
                       "unit_sizes": [u.size for u in engine.units], "after_step": _residual_stats(engine)}
    fp16 = _engine(rank, "zero_topo", LADDER_EF, "fp16")
    _step(fp16, rank, 0)
    before = _residual_stats(fp16)
    fp16.loss_scale.scale = 2.0 ** 60  # the scaled loss overflows fp16: the step must be skipped
    skipped = _step(fp16, rank, 1)
    at_skip = _residual_stats(fp16)
    fp16.loss_scale.scale = 2.0 ** 16  # back to a scale that fits (halving from 2^60 would take 44 steps)
    resumed = _step(fp16, rank, 2)
    out["fp16"] = {"before": before, "skipped": skipped, "at_skip": at_skip, "resumed": resumed,
                   "after": _residual_stats(fp16)}
    return out


def test_engines_hold_one_residual_per_unit_on_the_cross_node_hop(tmp_path):
    results = run_ranks("test_error_feedback_sharded:_worker", 4, tmp_path)
    for preset, hop, divisor in (("zero_topo", "cross", 2), ("zeropp", "rail", 2)):
        r0 = results[0][preset]
        sizes = r0["unit_sizes"]
        # zero_topo on 2 x 2: (w, g, os) = (2, 2, 4), the cross hop's input is S/g = S/2;
        # zeropp: R = 2, the rail hop's input is S/R = S/2. Nothing else keeps a residual.
        assert r0["residual_sizes"] == [{hop: s // divisor} for s in sizes], preset
        assert r0["after_step"]["max"] > 0 and r0["after_step"]["finite"], preset
        quant = QuantSpec(grad_reduce_bits=4, cross_node_grad_bits=4 if preset == "zero_topo" else 0,
                          block_size=BLOCK, error_feedback=True)
        spec = CommSpec([s for s in sizes], ShardLayout.resolve(tuple(LAYOUT), preset=preset), quant=quant)
        predicted = predict_model_state_bytes(spec)["per_rank"]
        for rank, res in enumerate(results):
            assert res[preset]["memory"]["error_feedback"] == predicted["error_feedback"] \
                == 4 * sum(s // divisor for s in sizes), (preset, rank)
    for rank, res in enumerate(results):
        fp16 = res["fp16"]
        assert fp16["before"]["max"] > 0 and fp16["before"]["finite"], rank
        assert fp16["skipped"]["skipped_step"] == 1.0 and not math.isfinite(fp16["skipped"]["grad_norm"]), rank
        assert fp16["at_skip"]["max"] == 0.0, rank           # reset, not the error of a sanitised inf
        assert fp16["resumed"]["skipped_step"] == 0.0 and math.isfinite(fp16["resumed"]["grad_norm"]), rank
        assert fp16["after"]["finite"] and fp16["after"]["max"] > 0, rank
