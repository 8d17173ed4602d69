"""Non-finite gradients skip the step everywhere, and fp16 loss scaling follows NeoX's fp16 block.

- DeepSpeed's dynamic rule (hysteresis, window, min scale) and a static scale, against a trajectory
  worked out by hand.
- The fp16 block is read and checked (a bad value is refused with the key named).
- A NaN put into ONE rank's gradient (4 simulated ranks, ZeRO-topo) skips the step on every rank:
  parameters unchanged, the same step count and the same loss-scale trajectory on all ranks, and
  the same trajectory as a single-process fp16 run given the same NaN steps. In bf16 (no loss
  scale) a NaN gradient is skipped by both engines too (the single-process engine used to apply it).
"""
from __future__ import annotations

import math

import pytest
import torch

from dist_harness import run_ranks
from megatron.engine import LocalEngine, lm_loss
from megatron.loss_scale import DynamicLossScale, LossScaleSettings
from megatron.topology import ProcessGroups, Topology, preset_factors
from megatron.zero_topo import Communicator, ZeroTopoEngine
from test_engine import OPT, build_model, make_batch

SCALING = LossScaleSettings(enabled=True, initial_scale_power=10, window=3, hysteresis=2)
NAN_STEPS = (1, 2, 6)         # steps whose gradient gets a NaN (on rank 1 only, when distributed)
STEPS = 8
# By hand, DeepSpeed's rule from 1024 with window 3, hysteresis 2: step 0 clean; 1 NaN (hysteresis
# 2 -> 1, scale kept); 2 NaN (halve: 512); 3, 4, 5 clean (the third clean step doubles: 1024 and
# hysteresis refills); 6 NaN (2 -> 1); 7 clean. The scale each step USED:
EXPECTED_SCALES = [1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]


def test_dynamic_rule_by_hand():
    scale = DynamicLossScale(LossScaleSettings(enabled=True, initial_scale_power=4, window=3, hysteresis=2))
    after = []
    for finite in (False, False, True, True, True, False, True):
        scale.update(finite)
        after.append(scale.scale)
    assert after == [16, 8, 8, 8, 16, 16, 16]
    floor = DynamicLossScale(LossScaleSettings(enabled=True, initial_scale_power=1, hysteresis=1,
                                                        min_scale=1.0))
    for _ in range(3):
        floor.update(False)
    assert floor.scale == 1.0
    static = DynamicLossScale(LossScaleSettings.from_precision("fp16", {"loss_scale": 128}))
    for finite in (False, True, True):
        static.update(finite)
    assert static.scale == 128 and not static.dynamic
    assert DynamicLossScale(LossScaleSettings.from_precision("bfloat16", {"loss_scale": 128})).scale == 1.0


def test_fp16_block_is_read_and_checked():
    block = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 3, "min_loss_scale": 2, "consecutive_hysteresis": True}
    s = LossScaleSettings.from_precision("fp16", block)
    assert (s.enabled, s.static_scale, s.initial_scale_power, s.window, s.hysteresis, s.min_scale,
            s.consecutive_hysteresis) == (True, 0.0, 12, 500, 3, 2.0, True)
    assert DynamicLossScale(s).scale == 4096
    with pytest.raises(ValueError, match="loss_scale_window must be >= 1"):
        LossScaleSettings.from_precision("fp16", {"loss_scale_window": 0})


def _poison_local(engine: LocalEngine) -> None:
    next(engine.model.parameters()).grad.view(-1)[0] = float("nan")


def _local_run(precision: str) -> dict:
    engine = LocalEngine(build_model(), lm_loss, OPT, precision, 1, torch.device("cpu"),
                         loss_scaling=SCALING if precision == "fp16" else None)
    return _drive(engine, lambda: _poison_local(engine), batch_rank=None)


def _drive(engine, poison, batch_rank) -> dict:
    """STEPS steps on the same batches, a NaN gradient at NAN_STEPS; per step: the scale used,
    whether it was skipped, whether the parameters stayed as they were."""
    scales, skipped, unchanged = [], [], []
    for step in range(STEPS):
        before = {k: v.clone() for k, v in engine.full_state_dict().items()}
        batch = make_batch(step, 0, 0) if batch_rank is None else make_batch(step, 0, batch_rank)
        engine.forward_backward(batch)
        if step in NAN_STEPS:
            poison()
        stats = engine.optimizer_step(1e-3)
        after = engine.full_state_dict()
        scales.append(stats["loss_scale"])
        skipped.append(stats["skipped_step"])
        unchanged.append(all(torch.equal(before[k], after[k]) for k in before))
    finite = all(bool(torch.isfinite(v).all()) for v in engine.full_state_dict().values())
    return {"scales": scales, "skipped": skipped, "unchanged": unchanged, "finite": finite}


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    topology = Topology.simulated([2, 2])
    for precision in ("fp16", "bfloat16"):
        groups = ProcessGroups(topology, preset_factors("zero_topo", topology), rank)
        model = build_model()
        engine = ZeroTopoEngine(model, model.units(), lm_loss, OPT, precision, groups, Communicator(groups), 1,
                                "zero_topo", loss_scaling=SCALING if precision == "fp16" else None)

        def poison(engine=engine):
            if rank == 1:  # one rank only: the others must learn of it through the norm
                engine.units[1].grad_accum[0] = float("nan")

        out[precision] = _drive(engine, poison, batch_rank=rank)
        out[precision]["steps"] = engine.step_count
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_ranks("test_numerics:_worker", 4, tmp_path_factory.mktemp("numerics"))


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(four):
    want_skipped = [float(s in NAN_STEPS) for s in range(STEPS)]
    for precision in ("fp16", "bfloat16"):
        for rank, result in enumerate(four):
            got = result[precision]
            assert got["skipped"] == want_skipped, (precision, rank)
            assert [u for s, u in enumerate(got["unchanged"]) if s in NAN_STEPS] == [True] * len(NAN_STEPS)
            assert not any(u for s, u in enumerate(got["unchanged"]) if s not in NAN_STEPS), (precision, rank)
            assert got["finite"] and got["steps"] == STEPS - len(NAN_STEPS), (precision, rank)
        assert four[0]["fp16"]["scales"] == EXPECTED_SCALES
        assert all(r[precision]["scales"] == four[0][precision]["scales"] for r in four)
    assert four[0]["bfloat16"]["scales"] == [1.0] * STEPS


@pytest.mark.parametrize("precision", ["fp16", "bfloat16"])
def test_the_single_process_engine_skips_the_same_steps(precision):
    got = _local_run(precision)
    assert got["skipped"] == [float(s in NAN_STEPS) for s in range(STEPS)]
    assert got["finite"] and all(got["unchanged"][s] for s in NAN_STEPS)
    assert got["scales"] == (EXPECTED_SCALES if precision == "fp16" else [1.0] * STEPS)
    assert not math.isnan(sum(got["scales"]))
