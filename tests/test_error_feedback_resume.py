"""Error-feedback residuals resumed through the training path (``engine.load_checkpoint`` with a
``CheckpointReader``), across layouts; 4 simulated ranks (2 nodes x 2), INT4 gradients with error
feedback on the cross hop.

- Same layout: every rank gets its own residuals back bit for bit, and two more steps give the same
  losses, gradient norms, weights, moments and residuals as the run that never stopped.
- Other factors on the same 4 ranks (zeropp, whose residual sits on the rail hop) and another world
  size (2 ranks): the residuals start from zero, with one notice line naming the layout change, and
  training goes on.
"""
from __future__ import annotations

import math

import torch

from dist_harness import run_ranks
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.config.quant_spec import QuantSpec
from test_engine import LR, OPT, build_model, make_batch

QUANT = QuantSpec(grad_reduce_bits=4, cross_node_grad_bits=4, block_size=64, impl="reference", error_feedback=True)
SAVED_AT, MORE = 2, (2, 3)  # two steps before the save, two after
NOTICE = "error-feedback residuals reset to zero: the layout changed"


def _engine(rank: int, layout: list, preset: str):
    from megatron.engine import Communicator, ZeroTopoEngine, lm_loss
    from megatron.topology import ProcessGroups, Topology

    topology = Topology.simulated(layout)
    groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset=preset), rank)
    model = build_model(hidden_size=32, num_attention_heads=4)
    return ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="fp32", accumulation_steps=1, quant=QUANT))


def _steps(engine, rank: int, steps) -> list[tuple[float, float]]:
    out = []
    for step in steps:
        loss = float(engine.forward_backward(make_batch(step, 0, rank)))
        out.append((loss, float(engine.optimizer_step(LR)["grad_norm"])))
    return out


def _residuals(engine) -> list[dict[str, torch.Tensor]]:
    return [{hop: r.clone() for hop, r in unit.residuals.items()} for unit in engine.units]


def _state(engine) -> dict:
    return {"units": [{k: getattr(u, k).clone() for k in ("shard", "master", "exp_avg", "exp_avg_sq")}
                      for u in engine.units], "residuals": _residuals(engine), "step": engine.step_count}


def _train_and_save_worker(rank: int, world_size: int, save_dir: str) -> dict:
    import torch.distributed as dist
    from megatron.checkpointing.checkpointer import Checkpointer

    engine = _engine(rank, [2, 2], "zero_topo")
    _steps(engine, rank, range(SAVED_AT))
    checkpointer = Checkpointer(save_dir, rank=rank, world_size=world_size, barrier=dist.barrier)
    path = checkpointer.save(SAVED_AT, {"engine": engine.checkpoint_state(), "rng": {"torch": torch.get_rng_state()}},
                             {"consumed_samples": 0}, gather=engine.gather_objects)
    at_save = _residuals(engine)
    return {"step_dir": str(path), "at_save": at_save, "metrics": _steps(engine, rank, MORE), "end": _state(engine)}


def _resume_worker(rank: int, world_size: int, step_dir: str, layout: list, preset: str) -> dict:
    from megatron.checkpointing.reader import CheckpointReader

    engine = _engine(rank, layout, preset)
    reader = CheckpointReader(step_dir, rank, share=engine.broadcast_object)
    engine.load_checkpoint(reader)
    reader.close()
    loaded = _residuals(engine)
    return {"loaded": loaded, "metrics": _steps(engine, rank, MORE), "end": _state(engine)}


RESUME_MARK = "--- the next resume: "


def _resumes_worker(rank: int, world_size: int, step_dir: str, layout: list, presets: list) -> dict:
    """One resume per preset in one launch (fresh engines and readers each), in order; each announced
    by a RESUME_MARK line so that the test can cut the rank's log by resume."""
    out = {}
    for preset in presets:
        print(f"{RESUME_MARK}{preset}", flush=True)
        out[preset] = _resume_worker(rank, world_size, step_dir, layout, preset)
    return out


def _log_by_resume(log: str) -> dict[str, str]:
    """The lines of a _resumes_worker log after each RESUME_MARK, by preset."""
    return dict(part.split("\n", 1) for part in log.split(RESUME_MARK)[1:])  # each mark ends its line


def _equal(a, b) -> bool:
    """Nested lists/dicts of tensors and numbers equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _nonzero(residuals) -> bool:
    return any(bool(r.abs().max() > 0) for unit in residuals for r in unit.values())


def test_error_feedback_residuals_resume_exactly_in_the_same_layout_and_reset_in_another(tmp_path):
    saved = run_ranks("test_error_feedback_resume:_train_and_save_worker", 4, tmp_path / "save",
                      save_dir=str(tmp_path / "ck"))
    step_dir = saved[0]["step_dir"]
    assert all(_nonzero(r["at_save"]) for r in saved)  # there is something to restore on every rank

    # Same layout first, on ranks that never saved; then, in the same launch (4 ranks cost seconds to
    # start), other factors on the same 4 ranks (zeropp).
    on_four = run_ranks("test_error_feedback_resume:_resumes_worker", 4, tmp_path / "on_four",
                        step_dir=step_dir, layout=[2, 2], presets=["zero_topo", "zeropp"])
    logs = _log_by_resume((tmp_path / "on_four" / "rank0.log").read_text())
    assert list(logs) == ["zero_topo", "zeropp"]
    same = [r["zero_topo"] for r in on_four]
    for rank, (before, after) in enumerate(zip(saved, same)):
        assert _equal(after["loaded"], before["at_save"]), rank          # this rank's own residuals
        assert after["metrics"] == before["metrics"], (rank, after["metrics"], before["metrics"])
        assert _equal(after["end"], before["end"]), rank                 # as if it had never stopped
    assert "error-feedback residuals" not in logs["zero_topo"]

    other_world = run_ranks("test_error_feedback_resume:_resume_worker", 2, tmp_path / "other_world",
                            step_dir=step_dir, layout=[2, 1], preset="zero_topo")
    for name, other, log in (("other_factors", [r["zeropp"] for r in on_four], logs["zeropp"]),
                             ("other_world", other_world, (tmp_path / "other_world" / "rank0.log").read_text())):
        for rank, result in enumerate(other):
            assert result["loaded"] and all(result["loaded"]), (name, rank)  # this layout keeps residuals...
            assert not _nonzero(result["loaded"]), (name, rank)              # ...and they start from zero
            assert all(math.isfinite(loss) and math.isfinite(norm) for loss, norm in result["metrics"]), name
            assert result["end"]["step"] == SAVED_AT + len(MORE) and _nonzero(result["end"]["residuals"]), name
        notices = [line for line in log.splitlines() if "error-feedback residuals" in line]
        assert len(notices) == 1 and notices[0].startswith(NOTICE), (name, notices)
