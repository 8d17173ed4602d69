"""fp16 with dynamic loss scaling: natural overflows, multi-rank against a single process.

No NaN is injected: the loss scale starts at 2**28, far too high for the tiny model, and halves on
each overflow (DeepSpeed's defaults otherwise: window 1000, hysteresis 2) until the gradients fit.
The single-process reference is SingleProcessEngine on the same global batch (micro-batch N x m, A
micro-batches): its per-sample gradient factor is scale / (A N m). The ZeRO-topo engine's default
``gradient_predivide_factor`` (N) gives each rank the same factor, so the same steps overflow and
the scale follows the same trajectory; before, the rank's backward ran on loss x scale, N x A times
larger, and the run settled 3-4 halvings lower (2**15 for zero_topo, 2**16 for stage3, against the
single process's 2**19).

Measured here (4 ranks on 2x2, A = 2): single process and both presets skip steps 0-9 and settle
at 2**19. Beyond this test, with a short window the scale climbs back to the edge and a step at 2**20
overflows in the single process (its fp16 gradient of all N m samples reaches 80,718) but not in the
ranks (with fp32_allreduce, the config's default under fp16, only node sums of at most 56,978 are
fp16): which sums are rounded to fp16 differs there, by design (docs/numerics.md).

DeepSpeed ZeRO-3 fp16 is compared too where its accelerator supports fp16 (not its CPU one).
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import REPO_ROOT, TESTS_DIR, run_ranks
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.engine import SingleProcessEngine, adamw_param_groups, lm_loss
from megatron.loss_scale import LossScaleSettings
from megatron.topology import ProcessGroups, ShardFactors, Topology
from megatron.engine import Communicator, EngineError, ZeroTopoEngine
from test_engine import LR, MICRO_BSZ, OPT, build_model, global_batch, make_batch

LAYOUT, WORLD, ACCUM, STEPS = [2, 2], 4, 2, 14
POWER, WINDOW, HYSTERESIS = 28, 1000, 2
SCALING = LossScaleSettings(enabled=True, initial_scale_power=POWER, window=WINDOW, hysteresis=HYSTERESIS)


def _trajectory(engine, batches) -> dict:
    """Per step: the loss scale it used and whether it was skipped."""
    scales, skipped = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            engine.forward_backward(batches(step, micro))
        stats = engine.optimizer_step(LR)
        scales.append(stats["loss_scale"])
        skipped.append(bool(stats["skipped_step"]))
    return {"scales": scales, "skipped": skipped}


def _worker(rank: int, world_size: int) -> dict:
    topology = Topology.simulated(LAYOUT)
    out = {}
    for name, preset, predivide in (("zero_topo", "zero_topo", None), ("stage3", "stage3", None),
                                    ("zero_topo-predivide1", "zero_topo", 1.0)):
        groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset=preset), rank)
        model = build_model()
        engine = ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="fp16", accumulation_steps=ACCUM, fp32_allreduce=True, loss_scaling=SCALING, gradient_predivide_factor=predivide))
        out[name] = _trajectory(engine, lambda step, micro: make_batch(step, micro, rank))
    return out


@pytest.fixture(scope="module")
def single() -> dict:
    engine = SingleProcessEngine(build_model(), lm_loss, OPT, "fp16", ACCUM, torch.device("cpu"), loss_scaling=SCALING)
    return _trajectory(engine, lambda step, micro: global_batch(step, micro, WORLD))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_ranks("test_fp16_trajectory:_worker", WORLD, tmp_path_factory.mktemp("fp16"))


def test_the_reference_overflows_naturally(single):
    """The comparison means something: several overflows, then clean steps at a lower scale."""
    assert 5 <= sum(single["skipped"]) < STEPS and not single["skipped"][-1]
    assert single["scales"][-1] < 2.0 ** POWER


@pytest.mark.parametrize("name", ["zero_topo", "stage3"])
def test_multi_rank_fp16_skips_the_steps_a_single_process_skips(four, single, name):
    for rank, result in enumerate(four):
        assert result[name]["skipped"] == single["skipped"], (name, rank)
        assert result[name]["scales"] == single["scales"], (name, rank)


def test_deepspeeds_default_predivide_overflows_at_lower_scales(four, single):
    """gradient_predivide_factor 1.0 (DeepSpeed's default): the ranks sum undivided gradients, N
    times a single process's, so they overflow at scales up to N times lower."""
    got = four[0]["zero_topo-predivide1"]
    assert sum(got["skipped"]) > sum(single["skipped"])
    assert single["scales"][-1] / WORLD <= got["scales"][-1] < single["scales"][-1]


def test_a_bad_predivide_factor_is_refused():
    groups = ProcessGroups(Topology.single_node(1), ShardLayout.from_topology(Topology.single_node(1), ShardFactors(1, 1, 1)), 0)
    model = build_model()
    for bad in (0.0, -2.0, float("inf")):
        with pytest.raises(EngineError, match="gradient_predivide_factor must be a finite number > 0"):
            ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="fp16", accumulation_steps=1, gradient_predivide_factor=bad))


# ------------------------------------------------------------------------------ DeepSpeed ZeRO-3 fp16

def _deepspeed_fp16_unsupported() -> str | None:
    """Why DeepSpeed cannot run fp16 here (None when it can)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install deepspeed: the `baselines` extra)"
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    supported = accelerator.is_fp16_supported()
    if not supported:
        return (f"DeepSpeed {deepspeed.__version__}'s {accelerator.device_name().upper()} accelerator does not "
                f"support fp16 (is_fp16_supported() is falsy: {supported!r})")
    return None


def deepspeed_main(out: str) -> None:
    """One rank of DeepSpeed ZeRO-3 fp16 on the accelerator: the reference's model, batches, optimizer
    and fp16 block; writes {scales, skipped} to ``out``. Run by the test in its own process."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    device = torch.device(get_accelerator().device_name(), 0)
    model = build_model()
    config = {"train_micro_batch_size_per_gpu": MICRO_BSZ * WORLD, "gradient_accumulation_steps": ACCUM,
              "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(OPT.betas), "eps": OPT.eps,
                                                        "weight_decay": OPT.weight_decay, "torch_adam": True}},
              "gradient_clipping": OPT.gradient_clipping,
              "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": POWER,
                       "loss_scale_window": WINDOW, "hysteresis": HYSTERESIS, "min_loss_scale": 1},
              "steps_per_print": 10_000}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=adamw_param_groups(model, OPT.weight_decay))
    scales, skipped = [], []
    for step in range(STEPS):
        scales.append(float(engine.optimizer.loss_scale))
        before = engine.skipped_steps
        for micro in range(ACCUM):
            batch = {k: v.to(device) for k, v in global_batch(step, micro, WORLD).items()}
            engine.backward(lm_loss(engine, batch))  # DeepSpeed divides by the accumulation itself
            engine.step()
        skipped.append(engine.skipped_steps > before)
    Path(out).write_text(json.dumps({"scales": scales, "skipped": skipped}))


def test_deepspeed_zero3_fp16_skips_the_same_steps(single, tmp_path):
    reason = _deepspeed_fp16_unsupported()
    if reason:
        pytest.skip(reason)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "deepspeed.json"
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    code = f"import test_fp16_trajectory as t; t.deepspeed_main({str(out)!r})"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["skipped"] == single["skipped"] and got["scales"] == single["scales"], got
