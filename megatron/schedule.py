"""NeoX's learning-rate schedule as a pure function of the iteration (nanoGPT's `get_lr` habit)."""
from __future__ import annotations

import math


def learning_rate(iteration: int, *, lr: float, min_lr: float, warmup_iters: int,
                  decay_iters: int, style: str) -> float:
    """LR for optimizer step `iteration` (1-based: the first step is 1).

    Linear warmup from 0 to `lr` over `warmup_iters` steps, then `style` decay (cosine, linear or
    constant) from `lr` to `min_lr` over the remaining `decay_iters - warmup_iters` steps, then
    `min_lr`. Depends on `decay_iters` (NeoX's `lr_decay_iters`), never on `train_iters`, so a run
    resumed with a longer `train_iters` follows the same curve.
    """
    if warmup_iters > 0 and iteration <= warmup_iters:
        return lr * iteration / warmup_iters
    if style == "constant":
        return lr
    span = max(decay_iters - warmup_iters, 1)
    progress = min(max(iteration - warmup_iters, 0) / span, 1.0)
    if style == "cosine":
        value = min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    elif style == "linear":
        value = lr - (lr - min_lr) * progress
    else:
        raise ValueError(f"unknown lr_decay_style {style!r} (cosine, linear or constant)")
    return max(value, min_lr)


def schedule_from_config(cfg) -> dict:
    """The keyword arguments of `learning_rate` from a validated NeoXConfig."""
    sched = cfg.lr_schedule
    return dict(lr=cfg.optimizer.lr, min_lr=sched.min_lr, warmup_iters=sched.warmup_iters or 0,
                decay_iters=sched.lr_decay_iters or cfg.training.train_iters, style=sched.lr_decay_style)
