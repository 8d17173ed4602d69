"""Sharded, atomic checkpoints in NeoX's layout: `<save>/global_stepN/` plus a `latest` pointer.

Commit protocol (why: a killed job must never leave a half-written step as `latest`):
1. every rank writes its own `rank_XXXXX.pt` into the hidden folder `.global_stepN.partial` and
   fsyncs it; 2. barrier; 3. the ranks' piece lists reach rank 0 (the `gather` callable, or rank 0
   reads each file's list once) and rank 0 writes `index.json` (megatron/checkpointing/index.py),
   fsyncs it; 4. rank 0 writes `meta.json`, fsyncs, renames the folder to `global_stepN` (atomic on
   POSIX), fsyncs the parent, then replaces `latest` by rename; 5. barrier. A folder without
   `meta.json` or a leftover `.partial` is ignored with a warning. Old steps are pruned only after
   the new one is committed. A step without `index.json` (saved before it existed) still loads.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch

STEP_DIR = re.compile(r"^global_step(\d+)$")
META = "meta.json"


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read; the message says what to do."""


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_file(step_dir: Path, rank: int) -> Path:
    return step_dir / f"rank_{rank:05d}.pt"


def committed_steps(save_dir: Path) -> list[int]:
    """Iterations with a complete (committed) step folder, ascending."""
    if not save_dir.is_dir():
        return []
    steps = []
    for entry in save_dir.iterdir():
        if entry.name.endswith(".partial"):
            warnings.warn(f"ignoring half-written checkpoint folder {entry} (a save was interrupted)")
            continue
        match = STEP_DIR.match(entry.name)
        if not match:
            continue
        if (entry / META).is_file():
            steps.append(int(match.group(1)))
        else:
            warnings.warn(f"ignoring incomplete checkpoint folder {entry} (no {META})")
    return sorted(steps)


def latest_step_dir(load_dir: str | os.PathLike) -> Path | None:
    """The step folder `latest` names, falling back to the newest committed one."""
    root = Path(load_dir)
    steps = committed_steps(root)  # also warns about interrupted saves it skips
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / META).is_file():
            return candidate
        warnings.warn(f"`latest` in {root} names {candidate.name}, which is incomplete; using the newest complete step")
    return root / f"global_step{steps[-1]}" if steps else None


class Checkpointer:
    def __init__(self, save_dir: str, *, rank: int, world_size: int,
                 barrier: Callable[[], None], keep_last_n: int | None = None):
        self.save_dir = Path(save_dir)
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.keep_last_n = keep_last_n

    def ensure_writable(self) -> None:
        """Fail before training, not after hours of it, when the folder cannot be written."""
        try:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            probe = self.save_dir / f".write_probe.{self.rank}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise CheckpointError(f"cannot write checkpoints to {self.save_dir}: {err.strerror}; "
                                  "set `save` to a writable folder") from err

    def save(self, iteration: int, rank_state: dict, meta: dict, gather=None) -> Path:
        """Write this rank's state; all ranks call this together. Saving a committed step is a no-op.

        ``gather(obj)`` (optional, collective): every rank's ``obj`` in rank order, at least on rank 0
        (megatron.checkpointing.index.comm_gather); it brings the ranks' piece lists to rank 0 for
        ``index.json`` without reopening their files. Without it rank 0 reads each file's list once.
        """
        final = self.save_dir / f"global_step{iteration}"
        if (final / META).is_file():
            return final
        partial = self.save_dir / f".global_step{iteration}.partial"
        if self.rank == 0:
            self.ensure_writable()
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir()
        self.barrier()
        path = rank_file(partial, self.rank)
        with open(path, "wb") as f:
            torch.save(rank_state, f)
            f.flush()
            os.fsync(f.fileno())
        self.barrier()
        entries = None
        if gather is not None:
            from megatron.checkpointing.index import index_entry
            entries = gather(index_entry(rank_state))
        if self.rank == 0:
            self._write_index(partial, rank_state, entries)
            meta = {**meta, "iteration": iteration, "world_size": self.world_size}
            with open(partial / META, "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_path(partial)
            os.replace(partial, final)
            _fsync_path(self.save_dir)
            tmp_pointer = self.save_dir / ".latest.tmp"
            tmp_pointer.write_text(final.name)
            os.replace(tmp_pointer, self.save_dir / "latest")
            _fsync_path(self.save_dir)
            self._prune(iteration)
        self.barrier()
        return final

    def _write_index(self, partial: Path, rank_state: dict, entries) -> None:
        """index.json for a step of engine states (nothing for other rank states)."""
        from megatron.checkpointing import index as idx
        mine = idx.index_entry(rank_state)
        if mine is None:
            return
        if entries is not None:
            index = idx.build_index(list(entries), rank_state["engine"], self.world_size)
        elif self.world_size == 1:
            index = idx.build_index([mine], rank_state["engine"], 1)
        else:
            index = idx.scan_step(partial, self.world_size)
        if index is not None:
            idx.write_index(partial, index)

    def _prune(self, newest: int) -> None:
        if not self.keep_last_n:
            return
        keep = f"global_step{newest}"
        for step in committed_steps(self.save_dir)[:-self.keep_last_n]:
            if f"global_step{step}" == keep:  # a run saving below older steps never drops its own
                continue
            shutil.rmtree(self.save_dir / f"global_step{step}", ignore_errors=True)


def load_meta(step_dir: Path) -> dict:
    with open(step_dir / META) as f:
        return json.load(f)


def load_rank_state(step_dir: Path, rank: int, mmap: bool = False) -> dict:
    """One rank file; ``mmap``: map it, so only the entries touched are read (not its tensors)."""
    path = rank_file(step_dir, rank)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint was saved with a different layout")
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
