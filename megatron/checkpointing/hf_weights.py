"""A Hugging Face GPT-NeoX, Llama or Mistral folder read lazily (safetensors' `safe_open`), by our
parameter names. Each of our parameters is a list of row ranges of HF tensors (one whole tensor for
GPT-NeoX; Llama's separate q/k/v and up/gate projections for our fused ones, hf_llama.llama_pieces).

Each shard file is opened once per process and kept open (memory-mapped) until ``close``; a
``read(name, lo, hi)`` copies only elements [lo, hi) of the flattened tensor through
``get_slice``, so the sharded build reads on each rank only the weight chunk and optimizer slice it
keeps of every unit (build.unit_materializer), never the whole model; ``tensor(name)`` reads a
whole tensor (one process). ``elements_read`` and ``opens`` count what was read and opened, for
tests. ``import_hf`` reads everything, for one-process tools.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from megatron.checkpointing.rank_files import CheckpointError
from megatron.checkpointing.hf import (HF_IGNORED_SUFFIXES, HF_OUTPUT, HF_OUTPUT_IN_MEMORY, LLAMA_MODEL_TYPES,
                                       OUR_EMBED, OUR_OUTPUT, model_config_from_hf, name_pairs)
from megatron.checkpointing.hf_llama import Piece, llama_pieces


class HFWeights:
    """``tensor(our_name)`` / ``read(our_name, lo, hi)`` -> fp32, from the shards kept open."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.elements_read = 0
        self.opens = 0
        self._open_files: dict[Path, object] = {}  # shard -> its safe_open handle, opened once
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{self.folder} has no config.json: not a Hugging Face model folder")
        hf_config = json.loads(config_path.read_text())
        self.model_cfg = model_config_from_hf(hf_config)
        shards = sorted(self.folder.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.folder} has no .safetensors weights")
        self._where: dict[str, Path] = {}  # HF name -> shard file
        for shard in shards:
            for key in self._file(shard).keys():
                if not key.endswith(HF_IGNORED_SUFFIXES):
                    self._where[key] = shard
        if HF_OUTPUT_IN_MEMORY in self._where and HF_OUTPUT not in self._where:
            self._where[HF_OUTPUT] = self._where[HF_OUTPUT_IN_MEMORY]
            self._alias = {HF_OUTPUT: HF_OUTPUT_IN_MEMORY}
        else:
            self._alias = {}
        if hf_config.get("model_type") in LLAMA_MODEL_TYPES:
            pieces = dict(llama_pieces(self.model_cfg))
        else:
            pieces = {ours: [Piece(hf, 0, -1)] for ours, hf in name_pairs(self.model_cfg)}
        if not self.model_cfg.no_weight_tying:  # HF saves a tied model without its output layer
            pieces[OUR_OUTPUT] = pieces[OUR_EMBED]
        self._pieces = pieces
        missing = sorted({p.name for ps in pieces.values() for p in ps if p.name not in self._where})
        if missing:
            raise CheckpointError(f"{self.folder} lacks {missing[:3]}: it does not match its config.json")

    def shapes(self) -> dict[str, tuple]:
        """Our parameter names -> shapes, from the shard headers (no tensor is read)."""
        return {ours: self._shape(ours) for ours in self._pieces}

    def _shape(self, our_name: str) -> tuple:
        pieces = self._located(our_name)
        shapes = [tuple(self._view(p.name).get_shape()) for p in pieces]
        if len(shapes) == 1 and pieces[0].hi == -1:
            return shapes[0]
        return (sum(shape[0] if p.hi == -1 else p.hi - p.lo for p, shape in zip(pieces, shapes)), *shapes[0][1:])

    def tensor(self, our_name: str) -> torch.Tensor:
        """The whole tensor, fp32."""
        parts = []
        for p in self._located(our_name):
            file, key = self._file(self._where[p.name]), self._alias.get(p.name, p.name)
            whole = file.get_tensor(key) if p.hi == -1 else file.get_slice(key)[p.lo:p.hi]
            parts.append(whole.float())
        value = parts[0] if len(parts) == 1 else torch.cat(parts)
        self.elements_read += value.numel()
        return value

    def read(self, our_name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened tensor, fp32, reading only those (per HF tensor it
        spans, at most three rectangular slices per dimension: a row's tail, whole rows, the next
        row's head)."""
        total = math.prod(self._shape(our_name))
        if not 0 <= lo <= hi <= total:
            raise CheckpointError(f"range [{lo}, {hi}) is outside {our_name} of {total} elements in {self.folder}")
        pieces, at = [], 0
        for p in self._located(our_name):
            view = self._view(p.name)
            shape = tuple(view.get_shape())
            if not shape:  # a 0-d tensor cannot be sliced: it is one element
                pieces.append(self.tensor(our_name).reshape(-1)[lo:hi])
                break
            row = math.prod(shape[1:])
            first = 0 if p.hi == -1 else p.lo
            size = (shape[0] if p.hi == -1 else p.hi - p.lo) * row
            a, b = max(lo, at), min(hi, at + size)
            if a < b:  # this piece's share of [lo, hi), in the HF tensor's own flat positions
                got = [t.reshape(-1).float() for t in _flat_range(view, shape, first * row + a - at, first * row + b - at, ())]
                self.elements_read += sum(t.numel() for t in got)
                pieces += got
            at += size
        if not pieces:
            return torch.zeros(0, dtype=torch.float32)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def close(self) -> None:
        """Drop the open shards (their memory maps go with the handles)."""
        self._open_files.clear()

    def _file(self, shard: Path):
        handle = self._open_files.get(shard)
        if handle is None:
            handle = self._open_files[shard] = safe_open(str(shard), framework="pt")
            self.opens += 1
        return handle

    def _located(self, our_name: str) -> list[Piece]:
        """The HF row ranges one of our parameters is made of."""
        pieces = self._pieces.get(our_name)
        if pieces is None:
            raise CheckpointError(f"{self.folder} has no weight for parameter {our_name}")
        return pieces

    def _view(self, hf_name: str):
        return self._file(self._where[hf_name]).get_slice(self._alias.get(hf_name, hf_name))


def _flat_range(view, shape: tuple, lo: int, hi: int, fixed: tuple) -> list[torch.Tensor]:
    """Elements [lo, hi) of the flattened tensor ``view[fixed]`` (``shape``: its shape) as a list
    of rectangular ``get_slice`` reads, in order. ``fixed``: one-index slices of outer dimensions."""
    if hi <= lo:
        return []
    if len(shape) == 1:
        return [view[fixed + (slice(lo, hi),)]]
    row = math.prod(shape[1:])  # elements under one index of the first dimension
    first, head = divmod(lo, row)
    last, tail = divmod(hi, row)
    if first == last:  # inside one row
        return _flat_range(view, shape[1:], head, tail, fixed + (slice(first, first + 1),))
    pieces = []
    if head:  # the first row's tail
        pieces += _flat_range(view, shape[1:], head, row, fixed + (slice(first, first + 1),))
        first += 1
    if last > first:  # whole rows at once
        pieces.append(view[fixed + (slice(first, last),)])
    if tail:  # the last row's head
        pieces += _flat_range(view, shape[1:], 0, tail, fixed + (slice(last, last + 1),))
    return pieces
