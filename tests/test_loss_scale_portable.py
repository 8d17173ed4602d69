"""An fp16 checkpoint resumes on either engine: the loss scale travels in one portable form.

The single-process engine used torch's GradScaler, the ZeRO-topo engine its own loss scale; each
saved its own state dict and the other could not read it. Both now use megatron.loss_scale, save
``{"scale", "clean_steps", "hysteresis_left"}`` and also read GradScaler's dict (older
single-process checkpoints). A bf16 run resuming an fp16 checkpoint keeps a scale of 1: its loss
is not scaled, so a loaded scale would divide every gradient.
"""
from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.param_slices import assemble
from megatron.engine import SingleProcessEngine, lm_loss
from megatron.loss_scale import DynamicLossScale, LossScaleSettings, portable_loss_scale
from test_engine import OPT, build_model, make_batch, single_rank_engine


def _local(precision: str) -> SingleProcessEngine:
    return SingleProcessEngine(build_model(), lm_loss, OPT, precision, 1, torch.device("cpu"))


def _trained_local() -> SingleProcessEngine:
    engine = _local("fp16")
    engine.loss_scale.scale = 1024.0             # a scale that differs from every default
    engine.forward_backward(make_batch(0, 0, 0))
    engine.optimizer_step(1e-3)                  # one clean step
    return engine


def test_single_process_fp16_checkpoint_resumes_on_the_zero_topo_engine():
    local = _trained_local()
    saved = local.checkpoint_state()["loss_scaler"]
    assert saved == {"scale": 1024.0, "clean_steps": 1, "hysteresis_left": 2}
    engine = single_rank_engine(build_model(), precision="fp16", accum=1)
    engine.load_full_state(assemble([local.checkpoint_state()]))
    assert engine.loss_scale.state_dict() == saved


def test_zero_topo_fp16_checkpoint_resumes_on_the_single_process_engine():
    engine = single_rank_engine(build_model(), precision="fp16", accum=1)
    engine.loss_scale.scale, engine.loss_scale.clean_steps = 512.0, 7
    local = _local("fp16")
    local.load_full_state(assemble([engine.checkpoint_state()]))
    assert local.loss_scale.state_dict() == {"scale": 512.0, "clean_steps": 7, "hysteresis_left": 2}


def test_older_gradscaler_state_and_bf16_resumes():
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    dynamic = DynamicLossScale(LossScaleSettings(enabled=True))
    dynamic.load_state_dict(scaler.state_dict())  # what the single-process engine used to save
    assert (dynamic.scale, dynamic.clean_steps) == (256.0, 0)
    bf16 = DynamicLossScale(LossScaleSettings(enabled=False))
    bf16.load_state_dict({"scale": 4096.0, "clean_steps": 3})
    assert bf16.scale == 1.0
    local_bf16 = _local("bfloat16")
    local_bf16.loss_scale.load_state_dict({"scale": 4096.0, "clean_steps": 3})
    assert local_bf16.loss_scale.scale == 1.0
    assert portable_loss_scale({}) is None
    with pytest.raises(ValueError, match="unknown loss-scale state"):
        portable_loss_scale({"factor": 2})
