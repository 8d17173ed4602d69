"""The layout-free checkpoint format: each rank saves the pieces of parameters it owns, as 1-D
ranges of the flattened parameter, with the fp32 master value and both Adam moments.

A piece is `(name, offset, length)` into `param.flatten()`. Any engine, any (w, g, os), any world
size writes the same vocabulary, so loading is: reassemble full tensors from every rank's pieces,
then let the new engine cut its own slices. Replicas save identical pieces; they are checked equal.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatron.checkpointing.rank_files import CheckpointError, load_meta, rank_file, read_rank_file

FORMAT = "neox_topo/param_slices/1"
STATES = ("master", "exp_avg", "exp_avg_sq")
# Pieces of a weight-delta run (zero_quantized_weights_delta) also hold the weights the ranks held,
# which the deltas were taken against, so a resume on any layout continues from the same weights.
HELD_WEIGHTS = "weights"
PER_RANK = "error_feedback"  # an engine-state entry that belongs to one rank, not to the parameters


def make_engine_state(pieces: list[dict], shapes: dict[str, tuple], step: int, extra: dict | None = None) -> dict:
    """`pieces`: dicts with name, offset, length and one tensor per STATES key."""
    return {"format": FORMAT, "step": step, "shapes": {k: list(v) for k, v in shapes.items()},
            "pieces": pieces, **(extra or {})}


def assemble_full_state(step_dir: Path) -> dict:
    """Every parameter and both moments as full fp32 tensors, from all ranks' files of a step."""
    world = load_meta(step_dir)["world_size"]

    def states():
        for rank in range(world):
            path = rank_file(step_dir, rank)
            if not path.is_file():
                raise CheckpointError(f"{path} is missing: the checkpoint in {step_dir} is incomplete")
            yield read_rank_file(path, mmap=True)["engine"]

    return assemble(states(), str(step_dir))


def assemble(states, where: str = "the checkpoint") -> dict:
    """Full tensors from the engine states of every rank (an iterable of `make_engine_state` dicts)."""
    shapes: dict[str, list] | None = None
    full: dict[str, dict[str, torch.Tensor]] = {}
    covered: dict[str, torch.Tensor] = {}
    step, extra = None, {}
    for state in states:
        if state.get("format") != FORMAT:
            raise CheckpointError(f"{where} has format {state.get('format')!r}, expected {FORMAT}")
        if shapes is None:
            shapes, step = state["shapes"], state["step"]
            extra = {k: v for k, v in state.items() if k not in ("format", "step", "shapes", "pieces", PER_RANK)}
            for name, shape in shapes.items():
                numel = int(torch.Size(shape).numel())
                full[name] = {key: torch.zeros(numel, dtype=torch.float32) for key in STATES}
                covered[name] = torch.zeros(numel, dtype=torch.bool)
        if PER_RANK in state:  # rank-local state (error-feedback residuals): kept per rank, in rank order
            extra.setdefault(PER_RANK, []).append(state[PER_RANK])
        for piece in state["pieces"]:
            name, lo, n = piece["name"], piece["offset"], piece["length"]
            hi = lo + n
            already = covered[name][lo:hi]
            for key in STATES:
                values = piece[key].float()
                target = full[name][key][lo:hi]
                if already.any() and not torch.equal(target[already], values[already]):
                    raise CheckpointError(f"replicas disagree on {name}[{lo}:{hi}] ({key}) in {where}")
                target.copy_(values)
            covered[name][lo:hi] = True
    if shapes is None:
        raise CheckpointError(f"{where} holds no rank state")
    missing = [name for name, mask in covered.items() if not bool(mask.all())]
    if missing:
        raise CheckpointError(f"{where} does not cover {missing[:3]}: it is incomplete")
    return {"step": step, "shapes": shapes, **extra,
            "params": {n: full[n]["master"].view(shapes[n]) for n in full},
            "exp_avg": {n: full[n]["exp_avg"].view(shapes[n]) for n in full},
            "exp_avg_sq": {n: full[n]["exp_avg_sq"].view(shapes[n]) for n in full}}


def check_shapes(saved: dict[str, list], expected: dict[str, tuple], where: str) -> None:
    """Refuse a checkpoint of another model shape, naming the first mismatch."""
    for name, shape in expected.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {where} has no parameter {name}: it is of a different model")
        if list(saved[name]) != list(shape):
            raise CheckpointError(f"checkpoint {where} has {name} of shape {tuple(saved[name])}, this model "
                                  f"has {tuple(shape)}: the model shapes differ (check num_layers, "
                                  "hidden_size, vocab)")
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint {where} has parameters this model lacks, e.g. {extra[0]}")
