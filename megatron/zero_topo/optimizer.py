"""AdamW on one flat fp32 slice, elementwise identical to ``torch.optim.AdamW(foreach=False)``,
and the dynamic loss scale fp16 needs.

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


class DynamicLossScale:
    """fp16 loss scaling (GradScaler's defaults): halve on overflow, double after 2000 clean steps."""

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 2000,
                 min_scale: float = 1.0):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0

    def update(self, grads_finite: bool) -> None:
        if not self.enabled:
            return
        if not grads_finite:
            self.scale = max(self.scale / 2, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        portable = portable_loss_scale(state)
        if portable is not None and self.enabled:  # a bf16/fp32 run resuming fp16 keeps scale 1
            self.scale, self.clean_steps = portable["scale"], portable["clean_steps"]


def portable_loss_scale(state: dict | None) -> dict | None:
    """A saved loss-scale state in the one form checkpoints carry, ``{"scale", "clean_steps"}``,
    from either engine's: DynamicLossScale's (already that form) or torch GradScaler's (``scale``,
    ``_growth_tracker``), so an fp16 checkpoint resumes on either engine. None when there is none
    (an empty dict is what a disabled GradScaler saves)."""
    if not state:
        return None
    if "clean_steps" in state:
        return {"scale": float(state["scale"]), "clean_steps": int(state["clean_steps"])}
    if "_growth_tracker" in state:
        return {"scale": float(state["scale"]), "clean_steps": int(state["_growth_tracker"])}
    raise ValueError(f"unknown loss-scale state with keys {sorted(state)}")
