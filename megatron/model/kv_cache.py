"""Keys and values of the positions already processed, kept per layer, so that decoding one more
token runs the model over that one position instead of over the whole prefix.

    cache = KVCache.for_model(model, batch=1, max_len=prompt_len + new_tokens)
    logits = model(prompt, cache=cache)          # fills positions [0, prompt_len)
    logits = model(next_token, cache=cache)      # one position: attends to everything cached

The buffers are allocated once for ``max_len`` positions (no re-allocation or concatenation per
token); ``length`` is the number of positions filled, which the model reads as the position of the
first new token (its rotary angle). Only the model's ``forward`` writes to a cache.
"""
from __future__ import annotations

import torch

from megatron.config.model_shape import head_dim, kv_heads


class LayerCache:
    """One attention layer's keys and values, [batch, heads, max_len, head_dim] each."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: "KVCache"):
        self.keys = keys
        self.values = values
        self.owner = owner

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k, v [batch, heads, new, head_dim] after the cached ones and
        return the keys and values of every position so far (views, no copy)."""
        start = self.owner.length
        end = start + k.shape[2]
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Every layer's cache, and how many positions they hold."""

    def __init__(self, num_layers: int, batch: int, heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.max_len = max_len
        self.length = 0
        shape = (batch, heads, max_len, head_dim)
        self.layers = [LayerCache(torch.empty(shape, dtype=dtype, device=device),
                                  torch.empty(shape, dtype=dtype, device=device), self)
                       for _ in range(num_layers)]

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, dtype: torch.dtype | None = None) -> "KVCache":
        """A cache shaped for ``model`` (a GPTNeoX), on its device, in its parameters' dtype unless
        ``dtype`` says otherwise (the compute dtype under autocast)."""
        cfg = model.config
        weight = model.embed.embed_in.weight
        # Keys and values of the K/V heads only: grouped-query attention caches num_kv_heads of them.
        return cls(cfg.num_layers, batch, kv_heads(cfg), max_len, head_dim(cfg),
                   dtype or weight.dtype, weight.device)

    def advance(self, new: int) -> None:
        """The model has written ``new`` more positions into every layer."""
        self.length += new

    def check_room(self, new: int) -> None:
        if self.length + new > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {self.length} are used and "
                             f"{new} more do not fit")
