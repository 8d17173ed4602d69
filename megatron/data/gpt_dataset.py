"""GPT training samples over an indexed dataset: document, sample and shuffle indices.

Documents (the sequences of a .bin/.idx in a range, as NeoX) are laid end to end into one token
stream, epoch after epoch; sample ``j`` is the ``seq_length + 1`` tokens starting at stream position
``j * seq_length`` (consecutive samples share one token, so every token is an input exactly once).

Built epoch by epoch so that asking for more samples never reorders earlier ones:

- doc_idx: epoch ``e`` appends a permutation of the documents drawn from ``(seed, e)``;
- sample_idx: ``(n + 1, 2)`` int64 rows ``(position in doc_idx, offset in that document)`` of each
  sample's first token; row ``j + 1`` is also sample ``j``'s last token (NeoX's layout);
- shuffle_idx: the samples that end inside epoch ``e`` (and not earlier) are permuted by ``(seed, e)``.

So sample order depends only on (documents, seed, seq_length); a run that needs more samples builds
more epochs and its first K samples are those of a shorter run. The three arrays are cached as
``.npy`` beside the data (or in ``cache_dir``) under names encoding what changes them: data prefix,
split name, seed, seq_length, epochs, document range and a hash of the documents' sizes. One rank
hashes, builds and writes them (``share``: :func:`load_or_build_sample_index`); the others are told
the name and memory-map the files, never reading the sizes.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, TypeVar

import numpy as np
import torch

from megatron.data.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDataset, token_range_error
from megatron.logging.progress import Progress

# Bumped when the index construction changes, so stale caches are never read.
INDEX_MAP_VERSION = 1
DOCUMENT_STREAM, SAMPLE_STREAM = 0, 1  # RNG purposes: separate streams per (seed, epoch)
T = TypeVar("T")
# ``share(what, fn)``: ``fn()`` run by the building rank, its (small, picklable) result returned on
# every rank; ``what`` names the work for errors ("build the train sample index of X"). The caller
# picks the builder and how the others wait (megatron.runtime.Runtime.on_rank_zero: rank 0, the
# others on the rendezvous store, outside the collective timeout). One process: :func:`run_here`.
Share = Callable[[str, Callable[[], T]], T]
Advance = Callable[[int], None]  # told how many index entries were just built (for progress)
# Sample positions located per searchsorted call: bounds the memory of one call and lets the
# progress bar move during a build of hundreds of millions of samples (the Pile at 2048 tokens).
SAMPLE_CHUNK = 1 << 22
# A build that ends sooner than this prints no progress (small datasets, tests).
INDEX_PROGRESS_DELAY_S = 2.0


@dataclass(frozen=True)
class SampleIndex:
    """The three index arrays of a GPT dataset (memmapped when loaded from the cache)."""
    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray
    num_epochs: int


def samples_in_epochs(tokens_per_epoch: int, seq_length: int, num_epochs: int) -> int:
    """Samples whose ``seq_length + 1`` tokens lie within the first ``num_epochs`` epochs."""
    if num_epochs <= 0 or tokens_per_epoch <= 0:
        return 0
    return (num_epochs * tokens_per_epoch - 1) // seq_length


def epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs holding ``num_samples`` samples (at least 1)."""
    if tokens_per_epoch <= 0:
        raise DataError("cannot draw samples from documents with no tokens")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, stream])


def _no_progress(entries: int) -> None:
    pass


def run_here(what: str, fn: Callable[[], T]) -> T:
    """The :data:`Share` of a single process: ``fn()``."""
    return fn()


def build_doc_idx(documents: np.ndarray, num_epochs: int, seed: int, advance: Advance = _no_progress) -> np.ndarray:
    """Epochs of shuffled documents, epoch ``e`` permuted by ``(seed, e)``."""
    documents = np.asarray(documents, dtype=np.int64)
    epochs = []
    for epoch in range(num_epochs):
        epochs.append(_rng(seed, epoch, DOCUMENT_STREAM).permutation(documents))
        advance(len(documents))
    return np.concatenate(epochs or [np.zeros(0, dtype=np.int64)])


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int,
                     advance: Advance = _no_progress) -> np.ndarray:
    """``(num_samples + 1, 2)`` rows (doc_idx position, offset) of stream positions ``j * seq_length``."""
    ends = np.cumsum(sizes[doc_idx], dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]]) if len(ends) else np.zeros(0, dtype=np.int64)
    last = num_samples * seq_length
    if not len(ends) or last >= ends[-1]:
        raise DataError(f"internal: {num_samples} samples of {seq_length} tokens do not fit the document stream")
    rows = np.empty((num_samples + 1, 2), dtype=np.int64)
    for first in range(0, num_samples + 1, SAMPLE_CHUNK):
        stop = min(first + SAMPLE_CHUNK, num_samples + 1)
        positions = np.arange(first, stop, dtype=np.int64) * seq_length
        # The document holding position p is the last one starting at or before p (skips empty ones).
        where = np.searchsorted(starts, positions, side="right") - 1
        rows[first:stop, 0] = where
        rows[first:stop, 1] = positions - starts[where]
        advance(stop - first)
    return rows


def build_shuffle_idx(tokens_per_epoch: int, seq_length: int, num_epochs: int, seed: int,
                      advance: Advance = _no_progress) -> np.ndarray:
    """Sample order: the samples completed by epoch ``e`` are permuted by ``(seed, e)``, epochs in order."""
    pieces = []
    for epoch in range(num_epochs):
        first = samples_in_epochs(tokens_per_epoch, seq_length, epoch)
        last = samples_in_epochs(tokens_per_epoch, seq_length, epoch + 1)
        pieces.append(first + _rng(seed, epoch, SAMPLE_STREAM).permutation(last - first))
        advance(last - first)
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)


def index_entries(num_documents: int, num_samples: int, num_epochs: int) -> int:
    """Entries :func:`build_sample_index` produces (what its progress counts): doc, sample, shuffle."""
    return num_epochs * num_documents + (num_samples + 1) + num_samples


def build_sample_index(sizes: np.ndarray, documents: np.ndarray, seq_length: int, seed: int,
                       num_epochs: int, advance: Advance = _no_progress) -> SampleIndex:
    """The three arrays for ``num_epochs`` epochs of ``documents`` (pure function, no caching);
    ``advance(n)`` is called as entries are built (see :func:`index_entries`)."""
    if seq_length < 1:
        raise DataError(f"seq_length must be >= 1, got {seq_length}")
    if seed < 0:
        raise DataError(f"data seed must be >= 0, got {seed}")
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    num_samples = samples_in_epochs(tokens_per_epoch, seq_length, num_epochs)
    doc_idx = build_doc_idx(documents, num_epochs, seed, advance)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_samples, advance)
    shuffle_idx = build_shuffle_idx(tokens_per_epoch, seq_length, num_epochs, seed, advance)
    return SampleIndex(doc_idx, sample_idx, shuffle_idx, num_epochs)


def cache_prefix(data_prefix: str, name: str, documents: range, sizes: np.ndarray, seq_length: int,
                 seed: int, num_epochs: int, cache_dir: Optional[str] = None) -> str:
    """Cache file prefix; the three arrays go to ``<it>_{doc,sample,shuffle}_idx.npy``."""
    digest = hashlib.blake2b(digest_size=6)
    digest.update(f"v{INDEX_MAP_VERSION}".encode())
    digest.update(np.ascontiguousarray(sizes[documents.start:documents.stop]).tobytes())
    folder = cache_dir if cache_dir is not None else os.path.dirname(data_prefix)
    base = os.path.basename(data_prefix)
    return os.path.join(folder, f"{base}_{name}_indexmap_{seed}s_{seq_length}sl_{num_epochs}ep_"
                                f"{documents.start}-{documents.stop}d_{digest.hexdigest()}")


def _cache_paths(prefix: str) -> Dict[str, str]:
    return {part: f"{prefix}_{part}.npy" for part in ("doc_idx", "sample_idx", "shuffle_idx")}


def _save_atomically(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as stream:
        np.save(stream, array, allow_pickle=False)
    os.replace(tmp, path)


def build_index_cache(name: str, indexed: MMapIndexedDataset, documents: range, seq_length: int, seed: int,
                      num_samples: int, cache_dir: Optional[str] = None) -> tuple[str, int]:
    """The building rank's part: the cache prefix (a digest of the documents' sizes) and epoch count
    for ``num_samples`` samples, the three arrays built and written unless already cached.
    -> (cache prefix, num_epochs), all another rank needs to load them without reading ``sizes``."""
    sizes = indexed.sizes
    docs = np.arange(documents.start, documents.stop, dtype=np.int64)
    tokens_per_epoch = int(sizes[docs].sum(dtype=np.int64))
    if not len(docs) or tokens_per_epoch == 0:
        raise DataError(f"the {name} split of {indexed.prefix} has no tokens (documents {documents.start}-"
                        f"{documents.stop}); give it more data or a larger share in `split`")
    num_epochs = epochs_needed(tokens_per_epoch, seq_length, num_samples)
    prefix = cache_prefix(indexed.prefix, name, documents, sizes, seq_length, seed, num_epochs, cache_dir)
    paths = _cache_paths(prefix)
    if all(os.path.isfile(p) for p in paths.values()):
        return prefix, num_epochs
    entries = index_entries(len(docs), samples_in_epochs(tokens_per_epoch, seq_length, num_epochs), num_epochs)
    with Progress(f"building the {name} sample index ({num_epochs} epochs)", entries, "entries",
                  delay_s=INDEX_PROGRESS_DELAY_S) as progress:
        index = build_sample_index(sizes, docs, seq_length, seed, num_epochs, progress.update)
    try:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        for part, path in paths.items():
            _save_atomically(path, getattr(index, part))
    except OSError as error:
        raise DataError(f"cannot write the sample index cache {prefix}_*.npy ({error.strerror}); "
                        f"make the data folder writable or pass a writable cache_dir") from error
    return prefix, num_epochs


def load_or_build_sample_index(name: str, indexed: MMapIndexedDataset, documents: range, seq_length: int,
                               seed: int, num_samples: int, cache_dir: Optional[str] = None,
                               share: Share = run_here) -> SampleIndex:
    """The sample index covering ``num_samples`` samples, from the cache or built and cached.

    Distributed protocol: the building rank runs :func:`build_index_cache` inside ``share`` (hashing
    the sizes, building what is missing); every rank gets its (prefix, epochs) and memory-maps the
    files. Files are written to a temporary name and renamed, and their content is a pure function
    of the name, so concurrent builders (one per node without a shared file system) cannot corrupt
    them.
    """
    prefix, num_epochs = share(
        f"build the {name} sample index of {indexed.prefix} (documents {documents.start}-{documents.stop})",
        lambda: build_index_cache(name, indexed, documents, seq_length, seed, num_samples, cache_dir))
    paths = _cache_paths(prefix)
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    if missing:
        raise DataError(f"sample index cache {missing[0]} is missing on this rank after the building rank "
                        f"wrote it; the cache folder must be shared, or build on each node's local rank 0")
    arrays = {part: np.load(path, mmap_mode="r", allow_pickle=False) for part, path in paths.items()}
    return SampleIndex(num_epochs=num_epochs, **arrays)


class GPTDataset(torch.utils.data.Dataset):
    """Shuffled ``seq_length + 1``-token samples: ``ds[i] -> {"tokens", "labels"}`` (int64, seq_length).

    ``labels`` are ``tokens`` shifted by one. With ``vocab_size`` set, every returned sample is checked
    against it (cheap), which covers files too large for :func:`check_token_range` at open.
    """

    def __init__(self, name: str, indexed: MMapIndexedDataset, index: SampleIndex, seq_length: int,
                 vocab_size: Optional[int] = None, documents: Optional[range] = None):
        self.name = name
        self.indexed = indexed
        self.index = index
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        if documents is None:  # each epoch of doc_idx is a permutation of the (contiguous) document range
            doc_idx = np.asarray(index.doc_idx)
            documents = range(int(doc_idx.min()), int(doc_idx.max()) + 1) if len(doc_idx) else range(0)
        self.documents = documents

    def __len__(self) -> int:
        return len(self.index.shuffle_idx)

    def sample_tokens(self, sample: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of unshuffled sample ``sample`` (int64)."""
        doc_idx, sample_idx = self.index.doc_idx, self.index.sample_idx
        first, first_offset = (int(v) for v in sample_idx[sample])
        last, last_offset = (int(v) for v in sample_idx[sample + 1])
        if first == last:
            pieces = [self.indexed.get(int(doc_idx[first]), first_offset, last_offset - first_offset + 1)]
        else:
            pieces = [self.indexed.get(int(doc_idx[first]), first_offset)]
            pieces += [self.indexed.get(int(doc_idx[d])) for d in range(first + 1, last)]
            pieces.append(self.indexed.get(int(doc_idx[last]), 0, last_offset + 1))
        tokens = np.concatenate(pieces).astype(np.int64)
        if len(tokens) != self.seq_length + 1:
            raise DataError(f"{self.indexed.prefix}: sample {sample} has {len(tokens)} tokens instead of "
                            f"{self.seq_length + 1}; the sample index cache is stale, delete *_indexmap_* files")
        if self.vocab_size is not None and len(tokens) and (tokens.max() >= self.vocab_size or tokens.min() < 0):
            bad = int(tokens[np.argmax((tokens >= self.vocab_size) | (tokens < 0))])
            raise token_range_error(self.indexed, bad, int(doc_idx[first]), self.vocab_size)
        return tokens

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for the {self.name} dataset of {n} samples")
        tokens = torch.from_numpy(self.sample_tokens(int(self.index.shuffle_idx[i % n])))
        return {"tokens": tokens[:-1], "labels": tokens[1:]}


def build_gpt_dataset(name: str, indexed: MMapIndexedDataset, documents: range, seq_length: int, seed: int,
                      num_samples: int, vocab_size: Optional[int] = None, cache_dir: Optional[str] = None,
                      share: Share = run_here) -> GPTDataset:
    """A :class:`GPTDataset` of at least ``num_samples`` samples over ``documents`` of ``indexed``."""
    index = load_or_build_sample_index(name, indexed, documents, seq_length, seed, num_samples, cache_dir, share)
    return GPTDataset(name, indexed, index, seq_length, vocab_size, documents)
