"""Datasets from the config, and batches keyed by the number of samples consumed.

There is no stateful iterator: the trainer keeps one integer, ``consumed`` (samples of the global
order already used), and asks :func:`global_batch_indices` / :func:`micro_batch_indices` which
samples come next, then ``collate([dataset[i] for i in indices])``. Resuming at any sample count,
with any world size or micro-batch layout, therefore continues the same global sample order, and
nothing holds batches in memory.

Dataset choice, as NeoX: ``train_data_paths`` (+ ``valid_data_paths`` / ``test_data_paths``) are
blended by their weights; otherwise ``data_path`` is split into train/valid/test by documents
according to ``split``.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron.data.blendable_dataset import BlendedDataset, cached_blending_indices, normalize_weights
from megatron.data.errors import DataError
from megatron.data.gpt_dataset import GPTDataset, Share, build_gpt_dataset, run_here
from megatron.data.indexed_dataset import MMapIndexedDataset, check_token_range

SPLIT_NAMES = ("train", "valid", "test")
Dataset = torch.utils.data.Dataset


def parse_split(split: str) -> List[float]:
    """``"969,30,1"`` (or ``"98/2/0"``, or ``"1"``) -> three fractions summing to 1 (NeoX's parsing)."""
    text = str(split).strip()
    parts = text.split(",") if "," in text else text.split("/") if "/" in text else [text]
    try:
        shares = [float(part) for part in parts]
    except ValueError as error:
        raise DataError(f"split {split!r} must be up to three numbers, e.g. \"969,30,1\"") from error
    if len(shares) > 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise DataError(f"split {split!r} must be up to three non-negative numbers with a positive sum")
    shares += [0.0] * (3 - len(shares))
    total = sum(shares)
    return [s / total for s in shares]


def split_document_ranges(split: str, num_documents: int) -> List[range]:
    """Document ranges of train/valid/test: NeoX's rounding, the rounding error taken from the end."""
    bounds = [0]
    for fraction in parse_split(split):
        bounds.append(bounds[-1] + int(round(fraction * num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [0] + [min(max(b - excess, 0), num_documents) for b in bounds[1:]]
    return [range(bounds[i], max(bounds[i], bounds[i + 1])) for i in range(3)]


def global_batch_indices(consumed: int, global_batch: int) -> range:
    """Indices of the next global batch after ``consumed`` samples."""
    if consumed < 0 or global_batch <= 0:
        raise DataError(f"need consumed >= 0 and global_batch > 0, got {consumed} and {global_batch}")
    return range(consumed, consumed + global_batch)


def micro_batch_indices(consumed: int, global_batch: int, micro_batch: int, data_parallel_rank: int,
                        data_parallel_size: int, micro_step: int) -> range:
    """The part of the next global batch that one data-parallel rank uses at one micro-step.

    Micro-step ``m`` takes the ``micro_batch * data_parallel_size`` samples after the ``m`` earlier
    ones, rank ``r`` the ``r``-th ``micro_batch`` of those; together the ranks and micro-steps cover
    :func:`global_batch_indices` exactly once.
    """
    per_step = micro_batch * data_parallel_size
    if micro_batch <= 0 or data_parallel_size <= 0 or global_batch % per_step:
        raise DataError(f"global batch {global_batch} is not a multiple of micro batch {micro_batch} x "
                        f"data-parallel size {data_parallel_size}")
    if not 0 <= data_parallel_rank < data_parallel_size or not 0 <= micro_step < global_batch // per_step:
        raise DataError(f"rank {data_parallel_rank} / micro-step {micro_step} out of range for a global batch "
                        f"of {global_batch} ({global_batch // per_step} micro-steps x {data_parallel_size} ranks)")
    start = global_batch_indices(consumed, global_batch).start + micro_step * per_step + data_parallel_rank * micro_batch
    return range(start, start + micro_batch)


def collate(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack samples into ``{"tokens": [B, seq], "labels": [B, seq]}``."""
    if not samples:
        raise DataError("cannot collate an empty batch")
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


class _DatasetOpener:
    """Opens each data prefix once; the building rank checks its token ids against the vocabulary."""

    def __init__(self, vocab_size: int, share: Share):
        self.vocab_size = vocab_size
        self.share = share
        self._open: Dict[str, MMapIndexedDataset] = {}

    def __call__(self, prefix: str) -> MMapIndexedDataset:
        if prefix not in self._open:
            indexed = MMapIndexedDataset(prefix)
            self.share(f"check the token ids of {prefix}.bin", lambda: check_token_range(indexed, self.vocab_size))
            self._open[prefix] = indexed
        return self._open[prefix]


def _blend(name: str, prefixes: Sequence[str], weights: Optional[Sequence[float]], num_samples: int,
           open_dataset: _DatasetOpener, seq_length: int, seed: int, cache_dir: Optional[str],
           share: Share) -> Dataset:
    if weights is None:
        weights = [1.0] * len(prefixes)
    if len(weights) != len(prefixes):
        raise DataError(f"{len(prefixes)} {name}_data_paths but {len(weights)} {name}_data_weights")
    normalize_weights(weights)  # validates before any work
    indexed = [open_dataset(prefix) for prefix in prefixes]

    def component(i: int, count: int) -> GPTDataset:
        return build_gpt_dataset(name, indexed[i], range(len(indexed[i])), seq_length, seed, count,
                                 open_dataset.vocab_size, cache_dir, share)

    if len(prefixes) == 1:
        return component(0, num_samples)
    folder = cache_dir if cache_dir is not None else os.path.dirname(prefixes[0])
    indices = cached_blending_indices(weights, num_samples, os.path.join(folder, name), share)
    counts = np.bincount(indices[0], minlength=len(prefixes))
    components = [component(i, max(int(count), 1)) for i, count in enumerate(counts)]
    return BlendedDataset(components, weights, num_samples, indices=indices)


def build_datasets(cfg, tokenizer_vocab_size: int, num_train_samples: int, num_valid_samples: int,
                   share: Share = run_here, num_test_samples: Optional[int] = None,
                   cache_dir: Optional[str] = None) -> Tuple[Optional[Dataset], Optional[Dataset], Optional[Dataset]]:
    """(train, valid, test) datasets of at least the requested sizes; None where there is no data.

    ``tokenizer_vocab_size``: the tokenizer's own vocabulary (not the model's padded one); a token id
    at or above it is a :class:`DataError` naming the file: the data was made with another tokenizer.
    ``num_test_samples`` defaults to ``num_valid_samples``.
    ``share``: who does the work that needs doing once (see :data:`~megatron.data.gpt_dataset.Share`):
    the token-id check, the split's token counts, the sample and blend index caches and their digests;
    the other ranks get its results and read the caches. ``cache_dir``: where index caches go (default:
    beside each data file). A train split without tokens is an error; empty valid/test splits give None.
    """
    data = cfg.data
    if data.data_impl != "mmap":
        raise DataError(f"data_impl {data.data_impl!r} is not supported; only 'mmap' (.bin/.idx)")
    seq_length, seed = cfg.model.seq_length, data.seed
    open_dataset = _DatasetOpener(tokenizer_vocab_size, share)
    counts = {"train": num_train_samples, "valid": num_valid_samples,
              "test": num_valid_samples if num_test_samples is None else num_test_samples}
    common = dict(seq_length=seq_length, seed=seed, cache_dir=cache_dir, share=share)

    if data.train_data_paths:
        paths = {"train": data.train_data_paths, "valid": data.valid_data_paths, "test": data.test_data_paths}
        weights = {"train": data.train_data_weights, "valid": data.valid_data_weights, "test": data.test_data_weights}
        datasets = []
        for name in SPLIT_NAMES:
            if not paths[name] or counts[name] <= 0:
                datasets.append(None)
                continue
            datasets.append(_blend(name, paths[name], weights[name], counts[name], open_dataset, **common))
        return tuple(datasets)

    if not data.data_path:
        raise DataError("no data: set data.data_path (a .bin/.idx prefix) or data.train_data_paths")
    indexed = open_dataset(data.data_path)
    splits = split_document_ranges(data.split, len(indexed))
    empty = share(f"count the tokens of each split of {data.data_path}",
                  lambda: [int(indexed.sizes[d.start:d.stop].sum(dtype=np.int64)) == 0 for d in splits])
    datasets = []
    for name, documents, no_tokens in zip(SPLIT_NAMES, splits, empty):
        if counts[name] <= 0 or (no_tokens and name != "train"):
            datasets.append(None)
            continue
        datasets.append(build_gpt_dataset(name, indexed, documents, num_samples=counts[name],
                                          vocab_size=tokenizer_vocab_size, **common))
    return tuple(datasets)
