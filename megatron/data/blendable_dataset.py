"""Weighted blending of several datasets (NeoX's BlendableDataset).

Sample ``i`` of the blend comes from the dataset whose share is furthest behind its weight: NeoX's
greedy rule, argmax over d of ``w_d * max(i, 1) - taken_d`` (ties to the lower index), then the next
unused sample of that dataset. The assignment is deterministic and prefix-stable (the first K
entries do not depend on the blend's length), and every prefix stays within about one sample of
each weight. It is a sequential loop (~0.5 s per million samples for three datasets), so the loader caches it
(``.npz`` beside the data), built by one rank while the others wait for it (``share``).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron.data.errors import DataError
from megatron.data.gpt_dataset import Share, run_here


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights scaled to sum to 1 (they must be non-negative with a positive sum)."""
    array = np.asarray([float(w) for w in weights], dtype=np.float64)
    if not len(array) or np.any(array < 0) or not np.isfinite(array).all() or array.sum() <= 0:
        raise DataError(f"blend weights must be non-negative numbers with a positive sum, got {list(weights)}")
    return array / array.sum()


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """-> (dataset index per sample, sample index within that dataset), NeoX's greedy assignment."""
    w = normalize_weights(weights).tolist()
    taken = [0] * len(w)
    dataset_index = np.zeros(size, dtype=np.int16 if len(w) > 255 else np.uint8)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    datasets = range(len(w))
    for i in range(size):
        scale = float(max(i, 1))
        best, best_error = 0, w[0] * scale - taken[0]
        for d in datasets[1:]:
            error = w[d] * scale - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, dataset_sample_index


def samples_per_dataset(weights: Sequence[float], size: int) -> List[int]:
    """How many samples of each dataset a blend of ``size`` samples uses (exactly)."""
    dataset_index, _ = build_blending_indices(weights, size)
    return np.bincount(dataset_index, minlength=len(weights)).tolist()


def write_blending_indices(weights: Sequence[float], size: int, path: str) -> None:
    """The building rank's part: :func:`build_blending_indices` saved at ``path`` unless already there."""
    if os.path.isfile(path):
        return
    dataset_index, dataset_sample_index = build_blending_indices(weights, size)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as stream:
            np.savez(stream, dataset_index=dataset_index, dataset_sample_index=dataset_sample_index)
        os.replace(tmp, path)
    except OSError as error:
        raise DataError(f"cannot write the blend cache {path} ({error.strerror}); pass a writable cache_dir") from error


def cached_blending_indices(weights: Sequence[float], size: int, cache_prefix: Optional[str],
                            share: Share = run_here) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`build_blending_indices`, cached at ``<cache_prefix>_blend_<hash>.npz`` when a prefix is
    given: built by the rank ``share`` picks (see :data:`~megatron.data.gpt_dataset.Share`), read by all."""
    if cache_prefix is None:
        return build_blending_indices(weights, size)
    key = hashlib.blake2b(repr((normalize_weights(weights).tolist(), size)).encode(), digest_size=6).hexdigest()
    path = f"{cache_prefix}_blend_{size}n_{key}.npz"
    share(f"build the blend index {path}", lambda: write_blending_indices(weights, size, path))
    if not os.path.isfile(path):
        raise DataError(f"blend cache {path} is missing on this rank after the building rank wrote it; "
                        f"the cache folder must be shared, or build on each node's local rank 0")
    with np.load(path, allow_pickle=False) as cached:
        return cached["dataset_index"], cached["dataset_sample_index"]


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``."""

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int,
                 cache_prefix: Optional[str] = None,
                 indices: Optional[Tuple[np.ndarray, np.ndarray]] = None):
        """``indices``: the result of :func:`cached_blending_indices` when the caller already has it."""
        if len(datasets) != len(weights):
            raise DataError(f"{len(datasets)} datasets but {len(weights)} weights; give one weight per data path")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        if indices is None:
            indices = cached_blending_indices(weights, self.size, cache_prefix)
        self.dataset_index, self.dataset_sample_index = indices
        if len(self.dataset_index) != self.size:
            raise DataError(f"blend indices cover {len(self.dataset_index)} samples, not {self.size}")
        needed = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (dataset, count) in enumerate(zip(self.datasets, needed)):
            if count > len(dataset):
                raise DataError(f"blended dataset {d} has {len(dataset)} samples but the blend needs {count}; "
                                f"build it with samples_per_dataset(weights, size)")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        if not -self.size <= i < self.size:
            raise IndexError(f"sample {i} out of range for a blend of {self.size} samples")
        i %= self.size
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
