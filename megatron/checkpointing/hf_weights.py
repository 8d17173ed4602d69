"""A Hugging Face GPT-NeoX folder read one tensor at a time (safetensors' lazy `safe_open`), by our
parameter names: the sharded build loads each unit's weights right before it keeps its slices, so
no rank ever holds the whole model (``import_hf`` reads everything, for one-process uses)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from megatron.checkpointing.checkpointer import CheckpointError
from megatron.checkpointing.hf import (HF_IGNORED_SUFFIXES, HF_OUTPUT, HF_OUTPUT_IN_MEMORY, OUR_EMBED,
                                       OUR_OUTPUT, model_config_from_hf, name_pairs)


class HFWeights:
    """``tensor(our_name)`` -> fp32 tensor, reading only that tensor from its safetensors shard."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{self.folder} has no config.json: not a Hugging Face model folder")
        self.model_cfg = model_config_from_hf(json.loads(config_path.read_text()))
        shards = sorted(self.folder.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.folder} has no .safetensors weights")
        self._where: dict[str, Path] = {}  # HF name -> shard file
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
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
        out = {}
        for ours, hf in self._hf_name.items():
            with safe_open(str(self._where[hf]), framework="pt") as f:
                out[ours] = tuple(f.get_slice(self._alias.get(hf, hf)).get_shape())
        return out

    def tensor(self, our_name: str) -> torch.Tensor:
        hf = self._hf_name.get(our_name)
        if hf is None:
            raise CheckpointError(f"{self.folder} has no weight for parameter {our_name}")
        with safe_open(str(self._where[hf]), framework="pt") as f:
            return f.get_tensor(self._alias.get(hf, hf)).float()
