"""A Hugging Face GPT-NeoX folder read lazily (safetensors' `safe_open`), by our parameter names.

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
from megatron.checkpointing.hf import (HF_IGNORED_SUFFIXES, HF_OUTPUT, HF_OUTPUT_IN_MEMORY, OUR_EMBED,
                                       OUR_OUTPUT, model_config_from_hf, name_pairs)


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
        self.model_cfg = model_config_from_hf(json.loads(config_path.read_text()))
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
        pairs = dict(name_pairs(self.model_cfg))
        if not self.model_cfg.no_weight_tying:  # HF saves a tied model without its output layer
            pairs[OUR_OUTPUT] = pairs[OUR_EMBED]
        self._hf_name = pairs
        missing = sorted(hf for hf in set(pairs.values()) if hf not in self._where)
        if missing:
            raise CheckpointError(f"{self.folder} lacks {missing[:3]}: it does not match its config.json")

    def shapes(self) -> dict[str, tuple]:
        """Our parameter names -> shapes, from the shard headers (no tensor is read)."""
        return {ours: tuple(self._slice(ours).get_shape()) for ours in self._hf_name}

    def tensor(self, our_name: str) -> torch.Tensor:
        """The whole tensor, fp32."""
        file, key = self._located(our_name)
        value = file.get_tensor(key).float()
        self.elements_read += value.numel()
        return value

    def read(self, our_name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened tensor, fp32, reading only those (at most three
        rectangular slices per dimension: a row's tail, whole rows, the next row's head)."""
        view = self._slice(our_name)
        shape = tuple(view.get_shape())
        if not 0 <= lo <= hi <= math.prod(shape):
            raise CheckpointError(f"range [{lo}, {hi}) is outside {our_name} of shape {shape} in {self.folder}")
        if not shape:  # a 0-d tensor cannot be sliced: it is one element
            pieces = [self.tensor(our_name).reshape(-1)[lo:hi]]
        else:
            pieces = [p.reshape(-1).float() for p in _flat_range(view, shape, lo, hi, ())]
            self.elements_read += sum(p.numel() for p in pieces)
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

    def _located(self, our_name: str):
        """(open shard, HF key) of one of our parameters."""
        hf = self._hf_name.get(our_name)
        if hf is None:
            raise CheckpointError(f"{self.folder} has no weight for parameter {our_name}")
        return self._file(self._where[hf]), self._alias.get(hf, hf)

    def _slice(self, our_name: str):
        file, key = self._located(our_name)
        return file.get_slice(key)


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
