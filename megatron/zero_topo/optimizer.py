"""AdamW on one flat fp32 slice, elementwise identical to ``torch.optim.AdamW(foreach=False)``.

Weight decay is decoupled and applies only inside ``decay_ranges`` (the matrix parameters' elements
of the slice); norms, biases and padding get none, as with torch's two parameter groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWHyper:
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def from_config(cls, opt_cfg) -> "AdamWHyper":
        beta1, beta2 = (float(b) for b in opt_cfg.betas)
        return cls(beta1, beta2, float(opt_cfg.eps), float(opt_cfg.weight_decay))


@torch.no_grad()
def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 decay_ranges: list[tuple[int, int]], *, lr: float, step: int, hyper: AdamWHyper) -> None:
    """One AdamW step (``step`` counts from 1) on fp32 slices, in place; the order of torch's kernel."""
    if hyper.weight_decay != 0:
        factor = 1 - lr * hyper.weight_decay
        for a, b in decay_ranges:
            param[a:b].mul_(factor)
    exp_avg.lerp_(grad, 1 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(grad, grad, value=1 - hyper.beta2)
    t = float(step)  # torch reads its step tensor as a Python float
    bias_correction1 = 1 - hyper.beta1 ** t
    bias_correction2 = 1 - hyper.beta2 ** t
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(hyper.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def clip_coefficient(total_norm: float, max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` factor, computed in fp32 as torch does: min(max/(norm+1e-6), 1)."""
    norm = torch.tensor(total_norm, dtype=torch.float32)
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
