"""`index.json`: the table of contents of a checkpoint step, so a rank can load without opening
every rank file (docs/checkpoints.md).

For every rank file it lists the parameter pieces the file holds, as `[name, offset, length]`
triples into the flattened parameter (the vocabulary of megatron.checkpointing.param_slices; no
tensors), in the file's own piece order, and the names of the per-rank entries it carries
(`error_feedback`). Beside them: the parameter `shapes`, the optimizer `step`, the world size, and
the engine-state entries every rank saves alike (`shared`: loss scaler, factors, preset).

Who writes it: rank 0, after every rank file is written and before `meta.json` commits the step
(megatron/checkpointing/checkpointer.py). Rank 0 learns the piece lists by an all-gather of each
rank's list through the engine (`Engine.gather_objects`: a few KB per rank, charged to the
ledger phase `checkpoint`), so nothing is reopened; a caller that gives no gather function (tests,
tools) makes rank 0 read each file's piece list once instead (`scan_step`, torch.load with
mmap=True: the pickle, not the tensor bytes). A checkpoint written before index.json existed is
indexed the same way by the reader, on load: by rank 0 alone, which broadcasts the index to the
other ranks (megatron/checkpointing/reader.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional


from megatron.checkpointing.rank_files import CheckpointError, rank_file, read_rank_file
from megatron.checkpointing.param_slices import FORMAT, PER_RANK

INDEX = "index.json"
INDEX_FORMAT = "neox_topo/index/1"
# Engine-state keys that are not "shared" (the same on every rank): the pieces and the per-rank entries.
NOT_SHARED = ("format", "step", "shapes", "pieces", PER_RANK)

# gather(entry) -> every rank's entry in rank order (rank 0 must get the list; others may get None)
Gather = Callable[[Optional[dict]], Optional[list]]


def index_entry(rank_state) -> Optional[dict]:
    """What index.json lists for one rank file: its pieces and per-rank entries. None when the
    state holds no engine state of the param_slices format (then no index is written)."""
    engine = rank_state.get("engine") if isinstance(rank_state, dict) else None
    return entry_of_engine_state(engine)


def entry_of_engine_state(engine) -> Optional[dict]:
    if not isinstance(engine, dict) or engine.get("format") != FORMAT:
        return None
    return {"pieces": [[str(p["name"]), int(p["offset"]), int(p["length"])] for p in engine["pieces"]],
            "per_rank": [key for key in (PER_RANK,) if key in engine]}


def shared_of_engine_state(engine: dict) -> tuple[dict, list[str]]:
    """(JSON-safe shared entries, names of shared entries that only the rank files can hold)."""
    shared, elsewhere = {}, []
    for key, value in engine.items():
        if key in NOT_SHARED:
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            elsewhere.append(key)
        else:
            shared[key] = value
    return shared, elsewhere


def build_index(entries: list[Optional[dict]], first_state: dict, world_size: int) -> Optional[dict]:
    """The index of a step from every rank's entry (rank order) and rank 0's engine state."""
    if len(entries) != world_size or any(e is None for e in entries):
        return None
    shared, elsewhere = shared_of_engine_state(first_state)
    return {"format": INDEX_FORMAT, "pieces_format": FORMAT, "step": int(first_state["step"]),
            "world_size": world_size, "shapes": {k: list(v) for k, v in first_state["shapes"].items()},
            "shared": shared, "shared_in_rank_file": elsewhere,
            "files": [{"file": rank_file(Path("."), r).name, **entries[r]} for r in range(world_size)]}


def write_index(folder: Path, index: dict) -> None:
    text = json.dumps(index, separators=(",", ":"))  # whole text first: a failure leaves no torn file
    with open(folder / INDEX, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_index(step_dir: Path) -> dict:
    try:
        with open(step_dir / INDEX) as f:
            index = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{step_dir / INDEX} cannot be read ({err}): the checkpoint is damaged") from err
    if index.get("format") != INDEX_FORMAT or index.get("pieces_format") != FORMAT:
        raise CheckpointError(f"{step_dir / INDEX} has format {index.get('format')!r}/{index.get('pieces_format')!r}, "
                              f"expected {INDEX_FORMAT}/{FORMAT}")
    return index


def open_rank_file(path: Path, step_dir: Path) -> dict:
    """A rank file memory-mapped: unpickles its dict, reads no tensor bytes until they are touched."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint in {step_dir} is incomplete")
    state = read_rank_file(path, mmap=True)
    engine = state.get("engine") if isinstance(state, dict) else None
    if not isinstance(engine, dict) or engine.get("format") != FORMAT:
        found = engine.get("format") if isinstance(engine, dict) else None
        raise CheckpointError(f"{path} has format {found!r}, expected {FORMAT}")
    return state


def scan_step(step_dir: Path, world_size: int, on_open: Callable[[int], None] = lambda rank: None,
              opener: Optional[Callable[[int], dict]] = None) -> dict:
    """Build the index of a step by reading every rank file's piece list once (old checkpoints,
    or a save without a gather function). ``opener(rank)``: how to open a rank file (the reader's,
    which keeps it mapped for the data reads that follow); by default mapped and dropped."""
    entries, first = [], None
    for rank in range(world_size):
        on_open(rank)
        if opener is not None:
            engine = opener(rank)["engine"]
        else:
            engine = open_rank_file(rank_file(step_dir, rank), step_dir)["engine"]
        entries.append(entry_of_engine_state(engine))
        if first is None:
            first = {k: v for k, v in engine.items() if k not in ("pieces", PER_RANK)}
        del engine
    if first is None:
        raise CheckpointError(f"{step_dir} holds no rank state")
    return build_index(entries, first, world_size)
