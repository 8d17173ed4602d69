"""The next token from the last position's logits: greedy, or sampled after temperature, top-k and
top-p (nucleus) filtering, with GPT-NeoX's meanings (temperature 0 = greedy; top_k 0 and top_p 0 =
no filter)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0

    @classmethod
    def from_config(cls, generation_cfg) -> "Sampling":
        g = generation_cfg
        return cls(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [B, V] (fp32) with every token outside the top-k and outside the nucleus set to -inf.
    The most likely token always survives, so a distribution remains."""
    out = logits.clone()
    if top_k > 0 and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out[out < kth] = float("-inf")
    if top_p > 0.0:
        ordered, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # drop a token when the ones before it already exceed top_p (so the first is never dropped)
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out[drop] = float("-inf")
    return out


def next_token(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token id per row of logits [B, V] -> [B] (int64)."""
    logits = logits.float()
    if sampling.greedy:
        return logits.argmax(dim=-1)
    filtered = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    probs = torch.softmax(filtered, dim=-1)
    # multinomial on the CPU with a CPU generator: the same seed gives the same text on any device
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
