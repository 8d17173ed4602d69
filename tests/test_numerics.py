"""Non-finite gradients skip the step everywhere, and fp16 loss scaling follows NeoX's fp16 block.

- DeepSpeed's dynamic rule (hysteresis, window, min scale) and a static scale, against a trajectory
  worked out by hand.
- The fp16 block is read and checked (a bad value is refused with the key named).
- A NaN put into ONE rank's gradient (4 simulated ranks, ZeRO-topo) skips the step on every rank:
  parameters and Adam moments unchanged, the same step count and the same loss-scale trajectory on
  all ranks, and the same trajectory as a single-process fp16 run given the same NaN steps. The
  steps run through the trainer's own ``train_step``, whose warmup schedule does not advance on a
  skipped step (checked against the learning rates worked out by hand). In bf16 (no loss scale) a
  NaN gradient is skipped by both engines too (the single-process engine used to apply it).
- The loss-spike detector logs a spike after its warm-up and never stops the run.
- ``train/loss_scale`` and ``train/skipped_steps`` reach metrics.jsonl after every step, whatever
  log_interval says.
"""
from __future__ import annotations

import dataclasses
import json
import math
import tempfile

import pytest
import torch

from dist_harness import run_ranks
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.config.schema import NeoXConfig
from megatron.engine import SingleProcessEngine, lm_loss
from megatron.loss_scale import DynamicLossScale, LossScaleSettings
from megatron.numerics import SPIKE_WARMUP_STEPS, NumericsWatch
from megatron.runtime import Runtime
from megatron.topology import ProcessGroups, Topology
from megatron.training import Trainer
from megatron.engine import Communicator, ZeroTopoEngine
from test_engine import MICRO_BSZ, OPT, SEQ, VOCAB, build_model, tiny_cfg

SCALING = LossScaleSettings(enabled=True, initial_scale_power=10, window=3, hysteresis=2)
NAN_STEPS = (1, 2, 6)         # steps whose gradient gets a NaN (on rank 1 only, when distributed)
STEPS = 8
# By hand, DeepSpeed's rule from 1024 with window 3, hysteresis 2: step 0 clean; 1 NaN (hysteresis
# 2 -> 1, scale kept); 2 NaN (halve: 512); 3, 4, 5 clean (the third clean step doubles: 1024 and
# hysteresis refills); 6 NaN (2 -> 1); 7 clean. The scale each step USED:
EXPECTED_SCALES = [1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
# The trainer's warmup: lr = 1e-3 x k / 10 at schedule position k (1-based), and the position
# advances only on a clean step. Step 0 runs at k = 1; 1 (NaN) at 2; 2 (NaN) at 2 again; 3 at 2
# (the position the skipped steps never used); 4, 5, 6 (NaN) at 3, 4, 5; 7 at 5 again.
PEAK_LR, WARMUP = 1e-3, 10
EXPECTED_LRS = [PEAK_LR * k / WARMUP for k in (1, 2, 2, 2, 3, 4, 5, 5)]


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


def _poison_local(engine: SingleProcessEngine) -> None:
    next(engine.model.parameters()).grad.view(-1)[0] = float("nan")


def _moments(engine) -> torch.Tensor:
    """This rank's Adam moments, flat (the ZeRO-topo engine's slices; torch AdamW's state)."""
    if isinstance(engine, ZeroTopoEngine):
        return torch.cat([t for u in engine.units for t in (u.exp_avg, u.exp_avg_sq)])
    state = [engine.optimizer.state.get(p, {}) for p in engine.model.parameters()]
    return torch.cat([s[k].flatten() for s in state for k in ("exp_avg", "exp_avg_sq") if k in s] or [torch.zeros(0)])


class _Samples:
    """Sample i of a deterministic token stream (what the trainer's batching indexes)."""

    def __getitem__(self, i: int) -> dict:
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(7_000 + i))
        return {"tokens": tokens[:-1], "labels": tokens[1:]}


class _Watched:
    """The engine as the trainer sees it: before the optimizer step of NAN_STEPS a NaN goes into a
    gradient; per step it records the lr the trainer passed, the scale used, whether the step was
    skipped, and whether the parameters and the Adam moments stayed as they were."""

    def __init__(self, engine, poison):
        self.engine, self.poison = engine, poison
        self.record = {k: [] for k in ("lrs", "scales", "skipped", "unchanged", "moments_unchanged")}

    def forward_backward(self, batch: dict) -> torch.Tensor:
        return self.engine.forward_backward(batch)

    def all_reduce_sum(self, values: list[float], sync_ledger: bool = False) -> list[float]:
        return self.engine.all_reduce_sum(values, sync_ledger)

    def optimizer_step(self, lr: float) -> dict:
        step = len(self.record["lrs"])
        before, moments = self.engine.full_state_dict(), _moments(self.engine).clone()
        if step in NAN_STEPS:
            self.poison()
        stats = self.engine.optimizer_step(lr)
        after = self.engine.full_state_dict()
        r = self.record
        r["lrs"].append(lr)
        r["scales"].append(stats["loss_scale"])
        r["skipped"].append(stats["skipped_step"])
        r["unchanged"].append(all(torch.equal(before[k], after[k]) for k in before))
        now = _moments(self.engine)
        r["moments_unchanged"].append(moments.shape == now.shape and torch.equal(moments, now))
        return stats


def _config(log_dir: str, log_interval: int = 1, train_iters: int = STEPS) -> NeoXConfig:
    cfg = NeoXConfig()
    cfg.model = dataclasses.replace(tiny_cfg(), padded_vocab_size=VOCAB)  # the engines' model (the log's FLOPs)
    cfg.training.train_micro_batch_size_per_gpu, cfg.training.gradient_accumulation_steps = MICRO_BSZ, 1
    cfg.training.train_iters, cfg.training.eval_iters = train_iters, 0
    cfg.optimizer.lr, cfg.lr_schedule.warmup_iters, cfg.lr_schedule.lr_decay_iters = PEAK_LR, WARMUP, 100
    cfg.logging.log_dir, cfg.logging.log_interval = log_dir, log_interval
    return cfg


def _train(engine, poison, rank: int, world_size: int, log_dir: str) -> dict:
    """STEPS steps through the trainer's own train_step (its schedule, its skipped-step count)."""
    watched = _Watched(engine, poison)
    trainer = Trainer(_config(log_dir), Runtime(rank, world_size, rank, torch.device("cpu")), watched,
                      _Samples(), None)
    for _ in range(STEPS):
        trainer.train_step()
    trainer.metrics.close()
    finite = all(bool(torch.isfinite(v).all()) for v in engine.full_state_dict().values())
    return {**watched.record, "finite": finite, "skipped_steps": trainer.numerics.skipped_steps}


def _local_run(precision: str, log_dir: str) -> dict:
    engine = SingleProcessEngine(build_model(), lm_loss, OPT, precision, 1, torch.device("cpu"),
                         loss_scaling=SCALING if precision == "fp16" else None)
    return _train(engine, lambda: _poison_local(engine), 0, 1, log_dir)


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    topology = Topology.simulated([2, 2])
    for precision in ("fp16", "bfloat16"):
        groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset="zero_topo"), rank)
        model = build_model()
        engine = ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision=precision, accumulation_steps=1, loss_scaling=SCALING if precision == "fp16" else None))

        def poison(engine=engine):
            if rank == 1:  # one rank only: the others must learn of it through the norm
                engine.units[1].grad_accum[0] = float("nan")

        out[precision] = _train(engine, poison, rank, world_size, tempfile.mkdtemp())
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
            # Adam's moments stay on a skipped step (and move on a clean one: the check can fail)
            assert [m for s, m in enumerate(got["moments_unchanged"]) if s in NAN_STEPS] == [True] * len(NAN_STEPS)
            assert not any(m for s, m in enumerate(got["moments_unchanged"]) if s not in NAN_STEPS)
            # the schedule does not advance on a skipped step (warmup: the lr changes every clean one)
            assert got["lrs"] == pytest.approx(EXPECTED_LRS, rel=1e-12) and got["skipped_steps"] == len(NAN_STEPS)
        assert four[0]["fp16"]["scales"] == EXPECTED_SCALES
        assert all(r[precision]["scales"] == four[0][precision]["scales"] for r in four)
    assert four[0]["bfloat16"]["scales"] == [1.0] * STEPS


@pytest.mark.parametrize("precision", ["fp16", "bfloat16"])
def test_the_single_process_engine_skips_the_same_steps(precision, tmp_path):
    got = _local_run(precision, str(tmp_path))
    assert got["skipped"] == [float(s in NAN_STEPS) for s in range(STEPS)]
    assert got["finite"] and all(got["unchanged"][s] for s in NAN_STEPS)
    assert all(got["moments_unchanged"][s] for s in NAN_STEPS) and got["lrs"] == pytest.approx(EXPECTED_LRS)
    assert got["scales"] == (EXPECTED_SCALES if precision == "fp16" else [1.0] * STEPS)
    assert not math.isnan(sum(got["scales"]))


def test_a_loss_spike_is_logged_after_the_warm_up_and_never_stops_the_run(capsys):
    watch = NumericsWatch(max_consecutive_skips=3, spike_factor=3.0)
    watch.observe(1, 2.0, skipped=False, rank=0)
    watch.observe(2, 50.0, skipped=False, rank=0)  # 25x the mean, but inside the warm-up: not a spike
    assert watch.loss_spikes == 0 and "loss spike" not in capsys.readouterr().out
    # After the warm-up, by hand: the running mean of steady 2.0 losses is 2.0.
    watch = NumericsWatch(max_consecutive_skips=3, spike_factor=3.0)
    for it in range(1, SPIKE_WARMUP_STEPS + 1):
        watch.observe(it, 2.0, skipped=False, rank=0)
    watch.observe(11, 5.9, skipped=False, rank=0)  # under 3 x 2.0: no spike; mean -> 0.9 x 2 + 0.59 = 2.39
    assert watch.loss_spikes == 0
    watch.observe(12, 7.2, skipped=False, rank=0)  # over 3 x 2.39 = 7.17: a spike, logged
    out = capsys.readouterr().out
    assert watch.loss_spikes == 1 and "loss spike at step 12: 7.2000 is 3.0x the running mean 2.3900" in out
    assert "not stopping" in out
    watch.raise_if_diverged(12)  # a spike never stops the run
    assert watch.consecutive_skips == 0


def test_loss_scale_and_skipped_steps_reach_the_metrics_every_step(tmp_path):
    """log_interval 5 over 12 steps: the full record at 1, 5, 10 and 12, the numerics at every step;
    fp16 from 2**22 overflows naturally, so the scale halves exactly after each skipped step
    (hysteresis 1) until it fits."""
    scaling = LossScaleSettings(enabled=True, initial_scale_power=22, window=1000, hysteresis=1)
    engine = SingleProcessEngine(build_model(), lm_loss, OPT, "fp16", 1, torch.device("cpu"), loss_scaling=scaling)
    trainer = Trainer(_config(str(tmp_path), log_interval=5, train_iters=12), Runtime(0, 1, 0, torch.device("cpu")),
                      engine, _Samples(), None)
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    numerics = {r["iteration"]: (r["train/loss_scale"], r["train/skipped_steps"]) for r in records
                if "train/loss_scale" in r}
    assert sorted(numerics) == list(range(1, 13))
    assert [r["iteration"] for r in records if "train/lm_loss" in r] == [1, 5, 10, 12]
    scales, skipped = zip(*(numerics[i] for i in range(1, 13)))
    assert scales[0] == 2.0 ** 22 and 0 < skipped[-1] < 12  # some steps skipped, some not
    before = (0,) + skipped[:-1]  # the count before each step: step i was skipped iff it grew
    assert all(scales[i + 1] == scales[i] / (2 if skipped[i] > before[i] else 1) for i in range(11))


def test_a_gradient_norm_beyond_fp32_skips_the_step_in_both_engines():
    """Finite gradients whose sum of squares passes fp32's range (a diverging run's 1e20s): torch's
    fp32 norm is inf there, so the single-process engine skips the step; the ZeRO-topo engine used
    to crash putting that sum into its fp32 norm vector (exit 1 mid-run) and now skips it too."""
    from megatron.topology import ShardFactors
    local = SingleProcessEngine(build_model(), lm_loss, OPT, "fp32", 1, torch.device("cpu"))
    groups = ProcessGroups(Topology.single_node(1), ShardLayout.from_topology(Topology.single_node(1), ShardFactors(1, 1, 1)), 0)
    model = build_model()
    sharded = ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="fp32", accumulation_steps=1))
    batch = _Samples()[0]
    batch = {k: v.unsqueeze(0) for k, v in batch.items()}
    for engine in (local, sharded):
        before = engine.full_state_dict()
        engine.forward_backward(batch)
        if engine is local:
            for param in local.model.parameters():
                param.grad.fill_(1e20)
        else:
            for unit in sharded.units:
                unit.grad_accum.fill_(1e20)
        stats = engine.optimizer_step(1e-3)
        assert stats["skipped_step"] == 1.0 and stats["grad_norm"] == math.inf, type(engine).__name__
        assert all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
