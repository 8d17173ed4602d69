"""Keys and values of the positions already processed, kept per layer, so that decoding one more
token runs the model over that one position instead of over the whole prefix.

    cache = KVCache.for_model(model, batch=1, max_len=prompt_len + new_tokens)
    logits = model(prompt, cache=cache)          # fills positions [0, prompt_len)
    logits = model(next_token, cache=cache)      # one position: attends to everything cached

The buffers are allocated once for ``max_len`` positions (no re-allocation or concatenation per
token); ``length`` is the number of positions processed, which the model reads as the position of
the first new token (its rotary angle). Only the model's ``forward`` writes to a cache.

With a sliding window (``sliding_window_width`` w, Mistral) no query ever sees a key more than w
positions back, so each layer keeps only the last w positions: the buffers hold min(max_len, w)
and memory stays bounded however long the generation. Once they are full, a forward gets the held
positions followed by its new ones (one concatenation), and the last w of those are kept, in order,
for the next (a trim, as transformers' sliding-window cache does; kept in order rather than as a
ring, the keys are always consecutive positions ending at the newest, which is all the mask needs).
"""
from __future__ import annotations

import torch

from megatron.config.model_shape import head_dim, kv_heads


class LayerCache:
    """One attention layer's keys and values, [batch, heads, capacity, head_dim] each: the last
    ``capacity`` positions processed, oldest first."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: "KVCache"):
        self.keys = keys
        self.values = values
        self.owner = owner

    @property
    def held(self) -> int:
        """Positions held now: every one processed, up to the capacity."""
        return min(self.owner.length, self.keys.shape[2])

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k, v [batch, heads, new, head_dim] after the held ones and return
        the keys and values of the held positions followed by the new ones: views while they fit,
        else a concatenation whose last ``capacity`` positions are what the buffers keep."""
        held, capacity = self.held, self.keys.shape[2]
        end = held + k.shape[2]
        if end <= capacity:
            self.keys[:, :, held:end] = k
            self.values[:, :, held:end] = v
            return self.keys[:, :, :end], self.values[:, :, :end]
        keys = torch.cat((self.keys[:, :, :held], k), dim=2)
        values = torch.cat((self.values[:, :, :held], v), dim=2)
        self.keys.copy_(keys[:, :, -capacity:])
        self.values.copy_(values[:, :, -capacity:])
        return keys, values


class KVCache:
    """Every layer's cache, and how many positions the model has run through it (``length``)."""

    def __init__(self, num_layers: int, batch: int, heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, window: int | None = None):
        self.max_len = max_len
        self.length = 0
        # A window's queries see at most `window` earlier positions: older ones are never read again.
        capacity = max_len if window is None else min(max_len, window)
        shape = (batch, heads, capacity, head_dim)
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
                   dtype or weight.dtype, weight.device, window=cfg.sliding_window_width)

    def advance(self, new: int) -> None:
        """The model has written ``new`` more positions into every layer."""
        self.length += new

    def check_room(self, new: int) -> None:
        if self.length + new > self.max_len:
            raise ValueError(f"KV cache was made for {self.max_len} positions; {self.length} are used and "
                             f"{new} more do not fit")
