"""Rank R of an N-rank world in one process, with torch's ``fake`` process-group backend.

What a collective leaves in its output under ``fake`` (measured on torch 2.13, tested in
tests/test_rehearsal.py), so a rehearsed step runs through the optimizer on defined values and is not
skipped by the non-finite-gradient policy:

- all-gather: this rank's input in every member's slot (its own chunk repeated);
- reduce-scatter: this rank's own chunk of its input (as if every other member sent zeros);
- all-reduce, broadcast: the buffer unchanged;
- all-to-all: the input unchanged (each chunk back in its own slot);
- barrier, new_group: return at once.

So the values are this rank's own, never another's: a rehearsal checks what runs (shapes, devices,
dtypes, the collectives issued and their bytes, memory, host time, syncs, files), not what it
computes. The backend is registered by a private torch module; without it the rehearsal cannot run.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch.distributed as dist

FAKE_SEMANTICS = ("all-gather: own input repeated; reduce-scatter: own chunk of own input; all-reduce, broadcast: "
                  "unchanged; all-to-all: input unchanged")


class RehearsalError(RuntimeError):
    """The rehearsal cannot run here (one line says why)."""


def join_fake_world(rank: int, world_size: int) -> None:
    """Initialise the default process group as ``rank`` of ``world_size`` on the fake backend."""
    if not 0 <= rank < world_size:
        raise RehearsalError(f"--rank {rank} is outside a world of {world_size} ranks")
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    except ImportError as err:
        raise RehearsalError(f"this torch has no fake process-group backend ({err}); torch >= 2.3 is needed") from None
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())


def synthetic_corpus(prefix: Path, vocab_size: int, tokens: int, seed: int = 0, document_tokens: int = 4096) -> Path:
    """A ``.bin/.idx`` corpus of ``tokens`` uniform random ids in [0, vocab_size), documents of
    ``document_tokens``: the rehearsal's stand-in for the job's data (its sample index is built
    the same way). Written once; reused when present."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype, index_file_path
    if Path(index_file_path(prefix)).is_file():
        return prefix
    rng = np.random.default_rng(seed)
    with MMapIndexedDatasetBuilder(prefix, best_fitting_dtype(vocab_size)) as builder:
        for start in range(0, tokens, document_tokens):
            builder.add_item(rng.integers(0, vocab_size, min(document_tokens, tokens - start)))
            builder.end_document()
    return prefix
