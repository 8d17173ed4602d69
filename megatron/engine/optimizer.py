"""AdamW on flat fp32 slices, elementwise identical to torch's AdamW on separate parameters.

Two implementations, as ``optimizer.params.fused`` chooses: ``fused_adamw_update`` calls the kernel
of ``torch.optim.AdamW(fused=True)`` (``torch._fused_adamw_``) once for every unit's slices (one
launch for the decay runs, one for the rest; its elementwise result does not depend on where a
slice is cut), ``adamw_update`` repeats ``torch.optim.AdamW(foreach=False)``'s for-loop ops.
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


def plain_ranges(length: int, decay_ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The runs of ``[0, length)`` outside the (sorted, disjoint) ``decay_ranges``."""
    runs, start = [], 0
    for a, b in decay_ranges:
        if a > start:
            runs.append((start, a))
        start = b
    if start < length:
        runs.append((start, length))
    return runs


@torch.no_grad()
def fused_adamw_update(slices: list[tuple], *, lr: float, step: int, hyper: AdamWHyper) -> None:
    """One AdamW step on many flat fp32 slices in place, by torch's fused kernel: ``slices`` holds
    ``(param, grad, exp_avg, exp_avg_sq, decay_ranges)`` per unit."""
    classes = [(hyper.weight_decay, lambda runs, n: runs), (0.0, lambda runs, n: plain_ranges(n, runs))]
    if hyper.weight_decay == 0:  # one launch for everything
        classes = [(0.0, lambda runs, n: [(0, n)])]
    for weight_decay, runs_of in classes:
        params, grads, exp_avgs, exp_avg_sqs = [], [], [], []
        for param, grad, exp_avg, exp_avg_sq, decay_ranges in slices:
            for a, b in runs_of(decay_ranges, param.numel()):
                params.append(param[a:b])
                grads.append(grad[a:b])
                exp_avgs.append(exp_avg[a:b])
                exp_avg_sqs.append(exp_avg_sq[a:b])
        if not params:
            continue
        # torch counts steps in a float32 tensor on the parameters' device; the kernel only reads it
        count = torch.full((), float(step), dtype=torch.float32, device=params[0].device)
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [count] * len(params), amsgrad=False,
                            lr=lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=weight_decay, eps=hyper.eps,
                            maximize=False)


class ShardedAdamW:
    """AdamW over every unit's fp32 1/os slice (``master``, ``exp_avg``, ``exp_avg_sq``): the fused
    kernel once per step over all slices, or the for-loop per unit. Holds AdamW's step count t."""

    def __init__(self, opt_cfg, step_count: int = 0):
        self.hyper = AdamWHyper.from_config(opt_cfg)
        self.fused = bool(opt_cfg.fused)
        self.step_count = step_count

    def step(self, units: list, grads: list[torch.Tensor], lr: float) -> None:
        """One step of every unit's slice in place with ``grads`` (same order)."""
        self.step_count += 1
        if self.fused:
            fused_adamw_update([(u.master, g, u.exp_avg, u.exp_avg_sq, u.decay_ranges) for u, g in zip(units, grads)],
                               lr=lr, step=self.step_count, hyper=self.hyper)
            return
        for unit, grad in zip(units, grads):
            adamw_update(unit.master, grad, unit.exp_avg, unit.exp_avg_sq, unit.decay_ranges,
                         lr=lr, step=self.step_count, hyper=self.hyper)
