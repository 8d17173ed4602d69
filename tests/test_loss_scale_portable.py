"""An fp16 checkpoint resumes on either engine: the loss scale travels in one portable form.

The single-process engine scales with torch's GradScaler, the ZeRO-topo engine with its own
DynamicLossScale; each used to save its own state dict and the other could not read it. Both now
save ``{"scale", "clean_steps"}`` and read either form (also GradScaler's own state dict, as older
checkpoints of the single-process engine hold). A bf16 run resuming an fp16 checkpoint keeps a
scale of 1: its loss is not scaled, so a loaded scale would divide every gradient.
"""
from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.param_slices import assemble
from megatron.engine import LocalEngine, lm_loss
from megatron.zero_topo.optimizer import DynamicLossScale, portable_loss_scale
from test_engine import OPT, build_model, make_batch, single_rank_engine


def _local(precision: str) -> LocalEngine:
    return LocalEngine(build_model(), lm_loss, OPT, precision, 1, torch.device("cpu"))


def _trained_local() -> LocalEngine:
    engine = _local("fp16")
    engine.forward_backward(make_batch(0, 0, 0))
    engine.optimizer_step(1e-3)                  # one clean step: growth tracker 1
    engine.scaler.update(new_scale=1024.0)       # a scale that differs from every default
    return engine


def test_single_process_fp16_checkpoint_resumes_on_the_zero_topo_engine():
    local = _trained_local()
    saved = local.checkpoint_state()["loss_scaler"]
    assert saved == {"scale": local.scaler.get_scale(), "clean_steps": 1}
    engine = single_rank_engine(build_model(), precision="fp16", accum=1)
    engine.load_full_state(assemble([local.checkpoint_state()]))
    assert (engine.loss_scale.scale, engine.loss_scale.clean_steps) == (local.scaler.get_scale(), 1)


def test_zero_topo_fp16_checkpoint_resumes_on_the_single_process_engine():
    engine = single_rank_engine(build_model(), precision="fp16", accum=1)
    engine.loss_scale.scale, engine.loss_scale.clean_steps = 512.0, 7
    local = _local("fp16")
    local.load_full_state(assemble([engine.checkpoint_state()]))
    assert local.scaler.get_scale() == 512.0
    assert local.checkpoint_state()["loss_scaler"] == {"scale": 512.0, "clean_steps": 7}


def test_older_gradscaler_state_and_bf16_resumes():
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    dynamic = DynamicLossScale(enabled=True)
    dynamic.load_state_dict(scaler.state_dict())  # what the single-process engine used to save
    assert (dynamic.scale, dynamic.clean_steps) == (256.0, 0)
    bf16 = DynamicLossScale(enabled=False)
    bf16.load_state_dict({"scale": 4096.0, "clean_steps": 3})
    assert bf16.scale == 1.0
    local_bf16 = _local("bfloat16")
    local_bf16._load_loss_scale({"scale": 4096.0, "clean_steps": 3})
    assert not local_bf16.scaler.is_enabled()
    assert portable_loss_scale({}) is None
    with pytest.raises(ValueError, match="unknown loss-scale state"):
        portable_loss_scale({"factor": 2})
