"""Read a rank's slices of a checkpoint step without reading the rest (docs/checkpoints.md).

`CheckpointReader(step_dir)` loads `index.json` (or, for a step saved before it existed, builds the
same index by reading every rank file's piece list once, with a one-line notice). `read(name, lo,
hi)` returns elements [lo, hi) of a parameter's flattened fp32 master and moments, opening — lazily,
memory-mapped, each once — only the rank files whose pieces overlap that range, and copying only the
overlapping elements. A range some element of which no file holds is refused ("incomplete").

Without index.json and with ``share`` (a broadcast from rank 0, ``Engine.broadcast_object``), only
rank 0 reads the piece lists and every rank gets them from it: N file opens for the index instead of
N per rank (N x N in all: 147k at 384 ranks). Rank 0 keeps the files it scanned mapped, so it opens
each file once in all; every other rank opens only the files its reads need.

What it did is kept for tests and the resume log: ``opened`` (rank files whose data was read, in
order), ``scanned`` (files opened to build a missing index), ``opens`` (rank -> how many times this
reader opened that file: one each), ``bytes_copied`` (tensor bytes copied out of the files).
"""
from __future__ import annotations

import bisect
import math
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from megatron.checkpointing.rank_files import CheckpointError, load_meta, rank_file
from megatron.checkpointing.index import INDEX, open_rank_file, read_index, scan_step
from megatron.checkpointing.param_slices import HELD_WEIGHTS, STATES
from megatron.logging.metrics import log_print


class _Pieces:
    """One parameter's pieces sorted by offset, none inside another (so ends rise with offsets)."""

    def __init__(self, items: list[tuple[int, int, int, int]]):
        items.sort(key=lambda t: (t[0], -t[1]))
        kept, reach = [], -1
        for offset, length, rank, position in items:
            if length <= 0 or offset + length <= reach:
                continue  # empty, or wholly inside pieces already kept (a duplicate replica)
            kept.append((offset, length, rank, position))
            reach = offset + length
        self.items = kept
        self.offsets = [t[0] for t in kept]

    def overlapping(self, lo: int, hi: int):
        """The kept pieces that overlap [lo, hi), in offset order."""
        i = max(bisect.bisect_right(self.offsets, lo) - 1, 0)
        for offset, length, rank, position in self.items[i:]:
            if offset >= hi:
                break
            if offset + length > lo:
                yield offset, length, rank, position


# share(obj) -> rank 0's obj on every rank (collective; other ranks pass None): Engine.broadcast_object
Share = Callable[[object], object]


class CheckpointReader:
    def __init__(self, step_dir: str | Path, rank: int = 0, share: Optional[Share] = None):
        """``rank``: this process's rank. ``share``: a broadcast from rank 0, used only when the step
        has no index.json (every rank must then build its reader together); without it each reader
        scans every rank file itself (one process, tools)."""
        self.step_dir = Path(step_dir)
        self.rank = rank
        self.opened: list[int] = []
        self.scanned: list[int] = []
        self.opens: Counter[int] = Counter()
        self.bytes_copied = 0
        self._handles: dict[int, dict] = {}
        if (self.step_dir / INDEX).is_file():
            index = read_index(self.step_dir)
            self.indexed = True
        else:
            index = self._index_by_scanning(share)
            self.indexed = False
        self.index = index
        self.step = int(index["step"])
        self.world_size = int(index["world_size"])
        self.shapes: dict[str, list] = index["shapes"]
        self._files = index["files"]
        if len(self._files) != self.world_size:
            raise CheckpointError(f"{self.step_dir / INDEX} lists {len(self._files)} rank files for a world of "
                                  f"{self.world_size}: the checkpoint is damaged")
        self._shared = dict(index.get("shared", {}))
        self._shared_in_file = list(index.get("shared_in_rank_file", []))
        table: dict[str, list] = {name: [] for name in self.shapes}
        for rank_, entry in enumerate(self._files):
            for position, (name, offset, length) in enumerate(entry["pieces"]):
                if name not in table:
                    raise CheckpointError(f"{self.step_dir}: rank file {rank_} holds {name}, which has no shape")
                table[name].append((int(offset), int(length), rank_, position))
        self._pieces = {name: _Pieces(items) for name, items in table.items()}

    def _index_by_scanning(self, share: Optional[Share]) -> dict:
        """The index of a step without index.json: rank 0 (or, without ``share``, every reader)
        reads each rank file's piece list once; with ``share`` the others receive it."""
        index, failure = None, None
        if share is None or self.rank == 0:
            world = int(load_meta(self.step_dir)["world_size"])
            who = "rank 0 reads" if share is not None else "reading"
            log_print(f"{self.step_dir} has no {INDEX} (saved before it existed): {who} the piece lists of "
                      f"all {world} rank files to index it", self.rank)
            try:
                index = scan_step(self.step_dir, world, on_open=self.scanned.append, opener=self._load)
            except CheckpointError as err:
                if share is None:
                    raise
                failure = str(err)
        if share is not None:  # the others wait for rank 0: a scan that failed fails every rank alike
            index, failure = share((index, failure))
        if failure:
            raise CheckpointError(failure)
        if index is None:
            raise CheckpointError(f"{self.step_dir} holds no engine state in every rank file: it is incomplete")
        return index

    # -- what the index says ----------------------------------------------------------------------
    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])

    def files_for(self, name: str, lo: int, hi: int) -> set[int]:
        """The rank files a ``read(name, lo, hi)`` opens (from the index alone)."""
        return {rank for _o, _n, rank, _p in self._pieces[name].overlapping(lo, hi)} if hi > lo else set()

    def ranks_with(self, key: str) -> list[int]:
        """Rank files that carry the per-rank engine entry ``key`` (e.g. error_feedback)."""
        return [r for r, entry in enumerate(self._files) if key in entry.get("per_rank", [])]

    @property
    def shared(self) -> dict:
        """Engine-state entries every rank saved alike (loss scaler, factors, preset)."""
        if self._shared_in_file:  # entries json could not hold: from rank 0's file, once
            engine = self._open(0)["engine"]
            self._shared.update({k: engine[k] for k in self._shared_in_file if k in engine})
            self._shared_in_file = []
        return self._shared

    # -- reading ------------------------------------------------------------------------------------
    def read(self, name: str, lo: int, hi: int, keys: Iterable[str] = STATES,
             out: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """Elements [lo, hi) of parameter ``name`` (flattened) for each of ``keys``, fp32.

        ``out`` (optional): tensors of hi - lo elements to fill instead of new ones."""
        keys = tuple(keys)
        if name not in self._pieces:
            raise CheckpointError(f"checkpoint {self.step_dir} has no parameter {name}")
        numel = self.numel(name)
        if not 0 <= lo <= hi <= numel:
            raise CheckpointError(f"range [{lo}, {hi}) is outside {name} ({numel} elements)")
        bad = [k for k in keys if k not in STATES + (HELD_WEIGHTS,)]
        if bad:
            raise CheckpointError(f"unknown checkpoint state {bad[0]!r}; known: {', '.join(STATES + (HELD_WEIGHTS,))}")
        if out is None:
            out = {k: torch.zeros(hi - lo, dtype=torch.float32) for k in keys}
        pos = lo
        for offset, length, rank, position in (self._pieces[name].overlapping(lo, hi) if hi > lo else ()):
            end = offset + length
            if end <= pos:
                continue
            if offset > pos:
                break  # a gap: refused below
            a, b = pos, min(end, hi)
            piece = self._piece(rank, position, name, offset, length)
            for key in keys:
                if key not in piece:
                    raise CheckpointError(f"checkpoint {self.step_dir} holds no {key!r} for {name} (rank {rank}'s piece)")
                source = piece[key][a - offset: b - offset]
                out[key][a - lo: b - lo].copy_(source)
                self.bytes_copied += source.numel() * source.element_size()
            pos = b
            if pos >= hi:
                break
        if pos < hi:
            raise CheckpointError(f"incomplete checkpoint {self.step_dir}: no rank file holds {name}"
                                  f"[{pos}:{hi}]; a rank file or piece is missing")
        return out

    def rank_state(self, rank: int) -> dict:
        """The whole (memory-mapped) state of rank file ``rank``, e.g. its ``rng``; opened once."""
        if not 0 <= rank < self.world_size:
            raise CheckpointError(f"{self.step_dir} has no rank file {rank} (world size {self.world_size})")
        return self._open(rank)

    def rank_entry(self, rank: int, key: str):
        """The per-rank engine entry ``key`` of rank file ``rank`` (None when it has none, without
        opening the file)."""
        if not 0 <= rank < self.world_size or key not in self._files[rank].get("per_rank", []):
            return None
        return self._open(rank)["engine"].get(key)

    def close(self) -> None:
        """Drop the memory maps (what was read stays valid: it was copied)."""
        self._handles.clear()

    # -- files --------------------------------------------------------------------------------------
    def _open(self, rank: int) -> dict:
        """Rank file ``rank`` for its data: mapped once per reader (a file the scan mapped is reused)."""
        state = self._handles.get(rank)
        if state is None:
            state = self._load(rank, self._files[rank].get("file"))
        if rank not in self.opened:
            self.opened.append(rank)
        return state

    def _load(self, rank: int, name: Optional[str] = None) -> dict:
        """Map rank file ``rank`` (every open of a rank file by this reader goes through here)."""
        path = self.step_dir / name if name else rank_file(self.step_dir, rank)
        state = open_rank_file(path, self.step_dir)
        self.opens[rank] += 1
        self._handles[rank] = state
        return state

    def _piece(self, rank: int, position: int, name: str, offset: int, length: int) -> dict:
        pieces = self._open(rank)["engine"]["pieces"]
        piece = pieces[position] if position < len(pieces) else None
        if piece is None or (piece["name"], int(piece["offset"]), int(piece["length"])) != (name, offset, length):
            raise CheckpointError(f"{self.step_dir / INDEX} does not match rank file {rank} (piece {position}): "
                                  "the checkpoint is damaged")
        return piece


def read_master_weights(step_dir: str | Path, progress: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of a step saved under any layout, whole, by name (fp32 master weights, in
    their shapes; a tied weight once): read one parameter at a time through the index, without the
    Adam moments. ``progress``: show the bytes read on stderr (megatron/logging/progress.py)."""
    from megatron.logging.progress import Progress  # only for this whole-model read

    reader = CheckpointReader(step_dir)
    params = {}
    total = 4 * sum(reader.numel(name) for name in reader.shapes)
    try:
        with Progress("reading master weights", total, bytes_unit=True, enabled=progress) as bar:
            for name, shape in reader.shapes.items():
                params[name] = reader.read(name, 0, reader.numel(name), ("master",))["master"].view(shape)
                bar.update(4 * reader.numel(name))
    finally:
        reader.close()
    return params
