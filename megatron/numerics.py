"""What the loop watches in the numbers: skipped steps, runs of them, loss spikes.

The engines skip a step whose gradients are not finite (every rank sees the same global norm, so
all skip together); the loop counts them (``train/skipped_steps``), stops the run when
``training.max_consecutive_skipped_steps`` come in a row (a diverged run would otherwise log
``loss nan`` to the end and exit 0), refuses to save a state whose loss is not finite (so
``latest`` and ``keep_last_n_checkpoints`` never replace a good checkpoint with a bad one), and logs
a loss spike (a finite loss above ``training.loss_spike_factor`` x its running mean) without
stopping.
"""
from __future__ import annotations

import math
from typing import Optional

from megatron.logging.metrics import log_print

SPIKE_WARMUP_STEPS = 10   # the running mean needs a few steps before a spike means anything
SPIKE_EMA_DECAY = 0.9


class NumericsError(Exception):
    """The run diverged: too many consecutive steps were skipped."""


class NumericsWatch:
    def __init__(self, max_consecutive_skips: int, spike_factor: float):
        self.max_consecutive_skips = max_consecutive_skips
        self.spike_factor = spike_factor
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.loss_spikes = 0
        self.last_loss: Optional[float] = None
        self._mean: Optional[float] = None
        self._clean_steps = 0

    @property
    def last_loss_finite(self) -> bool:
        return self.last_loss is None or math.isfinite(self.last_loss)

    def observe(self, iteration: int, loss: float, skipped: bool, rank: int) -> None:
        """After each optimizer step (every rank, the same values)."""
        self.last_loss = loss
        if skipped:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            return
        self.consecutive_skips = 0
        if not math.isfinite(loss):
            return
        if (self.spike_factor > 0 and self._mean is not None and self._clean_steps >= SPIKE_WARMUP_STEPS
                and loss > self.spike_factor * self._mean):
            self.loss_spikes += 1
            log_print(f"loss spike at step {iteration}: {loss:.4f} is {loss / self._mean:.1f}x the running "
                      f"mean {self._mean:.4f} (training.loss_spike_factor {self.spike_factor:g}; not stopping)", rank)
        self._mean = loss if self._mean is None else SPIKE_EMA_DECAY * self._mean + (1 - SPIKE_EMA_DECAY) * loss
        self._clean_steps += 1

    def raise_if_diverged(self, iteration: int) -> None:
        """NumericsError once the run of skipped steps reaches the limit (after the step is logged)."""
        if self.max_consecutive_skips and self.consecutive_skips >= self.max_consecutive_skips:
            raise NumericsError(
                f"{self.consecutive_skips} steps in a row were skipped for a non-finite gradient "
                f"(up to step {iteration}, loss {self.last_loss:.4g}): the run has diverged; stopping "
                "without saving (the last checkpoint stays latest). Lower the learning rate or resume "
                "from an earlier checkpoint; training.max_consecutive_skipped_steps sets the limit")

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.skipped_steps = int((state or {}).get("skipped_steps", 0))
