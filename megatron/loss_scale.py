"""fp16 loss scaling with NeoX's (DeepSpeed's) `fp16` block, one implementation for both engines.

Settings, read from the block: ``loss_scale`` (0 = dynamic, else that static scale),
``initial_scale_power`` (a dynamic scale starts at 2**power), ``loss_scale_window`` (clean steps
before the scale doubles), ``hysteresis`` (overflows tolerated before the scale halves; the count
refills when the scale grows, or after every clean step with ``consecutive_hysteresis``),
``min_loss_scale``. Defaults are DeepSpeed's. A step whose gradients are not finite is skipped by
the engine either way; the scale only decides how often that happens.

The state travels in checkpoints as ``{"scale", "clean_steps", "hysteresis_left"}``
(``portable_loss_scale`` also reads torch GradScaler's dict, which older single-process
checkpoints hold), so an fp16 checkpoint resumes on either engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LossScaleSettings:
    enabled: bool = False
    static_scale: float = 0.0
    initial_scale_power: int = 16
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0

    @classmethod
    def from_config(cls, precision_cfg) -> "LossScaleSettings":
        """From a config's ``precision`` group (its derived precision and NeoX's fp16 block)."""
        return cls.from_precision(precision_cfg.precision, precision_cfg.fp16)

    @classmethod
    def from_precision(cls, precision: str, fp16_block: Optional[dict] = None) -> "LossScaleSettings":
        """Loss scaling for ``precision`` (only fp16 scales) from NeoX's fp16 block."""
        block = fp16_block or {}
        settings = cls(enabled=precision == "fp16",
                       static_scale=float(block.get("loss_scale", 0.0) or 0.0),
                       initial_scale_power=int(block.get("initial_scale_power", 16)),
                       window=int(block.get("loss_scale_window", 1000)),
                       hysteresis=int(block.get("hysteresis", 2)),
                       consecutive_hysteresis=bool(block.get("consecutive_hysteresis", False)),
                       min_scale=float(block.get("min_loss_scale", 1.0)))
        problems = [f"{key} must be {rule}, got {value}" for key, value, ok, rule in (
            ("loss_scale", settings.static_scale, settings.static_scale >= 0, ">= 0 (0 = dynamic)"),
            ("initial_scale_power", settings.initial_scale_power, 0 <= settings.initial_scale_power <= 63, "in 0..63"),
            ("loss_scale_window", settings.window, settings.window >= 1, ">= 1"),
            ("hysteresis", settings.hysteresis, settings.hysteresis >= 1, ">= 1"),
            ("min_loss_scale", settings.min_scale, settings.min_scale > 0, "> 0")) if not ok]
        if problems:
            raise ValueError("fp16 block: " + "; ".join(problems))
        return settings


class DynamicLossScale:
    """The loss scale of one run: static, dynamic (DeepSpeed's rule), or 1 when disabled."""

    def __init__(self, settings: LossScaleSettings):
        self.settings = s = settings
        self.enabled = s.enabled
        self.scale = (s.static_scale or 2.0 ** s.initial_scale_power) if self.enabled else 1.0
        self.clean_steps = 0
        self.hysteresis_left = s.hysteresis

    @property
    def dynamic(self) -> bool:
        return self.enabled and not self.settings.static_scale

    def update(self, grads_finite: bool) -> None:
        """After every step: halve on an overflow once hysteresis is spent, double after ``window``
        clean steps in a row."""
        if not self.dynamic:
            return
        s = self.settings
        if not grads_finite:
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2, s.min_scale)
            else:
                self.hysteresis_left -= 1
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if s.consecutive_hysteresis:
            self.hysteresis_left = s.hysteresis
        if self.clean_steps % s.window == 0:
            self.scale *= 2
            self.hysteresis_left = s.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        portable = portable_loss_scale(state)
        if portable is None or not self.enabled:  # a bf16/fp32 run resuming fp16 keeps scale 1
            return
        self.clean_steps = portable["clean_steps"]
        self.hysteresis_left = portable.get("hysteresis_left", self.settings.hysteresis)
        if self.dynamic:  # a static scale is this run's setting, not the checkpoint's
            self.scale = portable["scale"]


def portable_loss_scale(state: dict | None) -> dict | None:
    """A saved loss-scale state in the one form checkpoints carry, ``{"scale", "clean_steps",
    "hysteresis_left"?}``, from ours or torch GradScaler's (``scale``, ``_growth_tracker``). None
    when there is none (an empty dict is what a disabled GradScaler saves)."""
    if not state:
        return None
    if "clean_steps" in state:
        out = {"scale": float(state["scale"]), "clean_steps": int(state["clean_steps"])}
        if "hysteresis_left" in state:
            out["hysteresis_left"] = int(state["hysteresis_left"])
        return out
    if "_growth_tracker" in state:
        return {"scale": float(state["scale"]), "clean_steps": int(state["_growth_tracker"])}
    raise ValueError(f"unknown loss-scale state with keys {sorted(state)}")
