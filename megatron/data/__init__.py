"""Data pipeline: tokenizers, NeoX/Megatron mmap .bin/.idx datasets, GPT sample index, blending,
the resumable loader and the embedded demo corpus.

Nothing here imports ``torch.distributed``: work done once for all ranks (index caches, their
digests, token-id checks) goes through the caller's ``share`` callable (see
:data:`~megatron.data.gpt_dataset.Share` and :func:`build_datasets`). The names below are imported on first use, so the
preprocessing tools and their worker processes do not pay for importing torch.
"""
from importlib import import_module

from megatron.data.errors import DataError

_LAZY_EXPORTS = {
    "build_datasets": "megatron.data.loader",
    "collate": "megatron.data.loader",
    "global_batch_indices": "megatron.data.loader",
    "micro_batch_indices": "megatron.data.loader",
    "build_tokenizer": "megatron.data.tokenizers",
}
__all__ = ["DataError", *_LAZY_EXPORTS]


def __getattr__(name: str):
    if name in _LAZY_EXPORTS:
        return getattr(import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron.data' has no attribute {name!r}")
