"""The training loop's one interface to "model + optimizer" (``Engine``), and what every engine
shares: the language-model loss, AdamW's parameter groups, the autocast dtype of a precision.

Two engines implement it: ``SingleProcessEngine`` (one process, megatron/engine/single_process.py)
and ``ZeroTopoEngine`` (sharded over ranks, megatron/engine/zero_topo.py). The loop calls nothing
else, so it never changes with the sharding.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

LossFn = Callable[[nn.Module, dict], torch.Tensor]


class Engine(Protocol):
    """What the training loop, the checkpointer and the tools call on an engine."""

    def forward_backward(self, batch: dict) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns the detached local mean loss."""

    def optimizer_step(self, lr: float) -> dict:
        """Clip and step once all micro-batches are in; returns the pre-clip global ``grad_norm``, the
        ``loss_scale`` used and ``skipped_step`` (0/1), as floats or 0-d tensors (the loop reads them
        after the step's work is queued)."""

    def eval_loss(self, batch: dict) -> torch.Tensor:
        """Mean loss of one batch without gradients."""

    def all_reduce_sum(self, values: list, sync_ledger: bool = False) -> list[float]:
        """Sum `values` (floats or 0-d device tensors) over every rank (a `control` collective) and
        return them as floats; on one process only the read-back. ``sync_ledger`` (once per step):
        the byte ledger's counters ride in the same collective, for ``comm_metrics``."""

    def gather_objects(self, obj: Any) -> list:
        """Every rank's small picklable ``obj`` in rank order, on every rank (collective)."""

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's picklable ``obj`` on every rank (collective; other ranks pass None)."""

    def comm_metrics(self) -> dict:
        """The byte ledger synced by ``all_reduce_sum(..., sync_ledger=True)`` since the last call,
        summed over ranks, as metrics (``comm/...``); {} on one process (no collectives)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """All parameters by name, fp32, on every rank (tests, export)."""

    def checkpoint_state(self) -> dict:
        """This rank's parameter pieces and optimizer state (megatron.checkpointing.param_slices)."""

    def load_checkpoint(self, reader, weights_only: bool = False) -> None:
        """This rank's slices from a ``megatron.checkpointing.reader.CheckpointReader``;
        ``weights_only`` (finetune): no optimizer state, step 0."""


def no_decay(param: torch.Tensor) -> bool:
    """Norm weights and biases (the 1-D parameters) get no weight decay, as in NeoX."""
    return param.ndim < 2


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, plain = [], []
    for p in model.parameters():
        (plain if no_decay(p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


# The compute dtype of each config precision (``precision.precision``).
COMPUTE_DTYPES = {"fp32": torch.float32, "bfloat16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype_of(precision: str) -> Optional[torch.dtype]:
    """The autocast dtype of a config precision; None for fp32 (no autocast)."""
    return None if precision == "fp32" else COMPUTE_DTYPES.get(precision)


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the micro-batch (fp32 softmax)."""
    logits = model(batch["tokens"])
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())


def fused_lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """``lm_loss`` computed by the model's output head chunk by chunk, never holding the logits
    (``training.fused_cross_entropy``; megatron/model/fused_cross_entropy.py). The head runs as a
    module call, so an engine's hooks on it (gather, release, gradient) fire as for the logits."""
    return model(batch["tokens"], labels=batch["labels"])


def training_loss_of(fused_cross_entropy: bool) -> LossFn:
    """The loss function training uses: fused or plain (``training.fused_cross_entropy``)."""
    return fused_lm_loss if fused_cross_entropy else lm_loss
