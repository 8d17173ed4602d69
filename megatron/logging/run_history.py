"""A run's logged history read back from its log folder (tools/loss_curves.py compares runs with it;
tools/repro_loss_curves.py asks it whether a run has finished and how long its steps took).

A run is a ``metrics.jsonl`` (MetricsWriter: one JSON record per logged step, and one per evaluation
at the same iteration) or the log folder that holds one, beside the ``neox_config_<time>_<pid>.json``
deepy writes at every launch (the newest describes the run: its preset, batch and sequence length).

Restarts: a resumed run appends to the same file from the step after its checkpoint, so iterations
repeat. Records are read in file order, and one whose iteration is lower than an iteration already
read starts a new attempt: everything logged from that iteration on is dropped and the new records
take its place. So the latest record wins, and steps a crashed attempt logged past its checkpoint do
not linger while the resumed attempt has not reached them yet. Only a training record (one with a
``train/`` metric) can start an attempt: eval.py appends its ``eval/`` record at the iteration of
the checkpoint it scored, often an earlier one, and that must not erase the steps after it. A line
that is not a JSON record (a run killed in the middle of writing one) is skipped and counted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

from megatron.topology.layout import display_name
from megatron.config.quant_spec import QuantSpec

METRICS_FILE = "metrics.jsonl"
TRAIN_LOSS = "train/lm_loss"
VALID_LOSS = "validation/lm_loss"
TOKENS_FIELD = "tokens"  # used as the x axis when a run's records carry it (e.g. runs from elsewhere)


class RunError(ValueError):
    """A run that cannot be read: the message is one line naming the path."""


@dataclass
class RunHistory:
    """What one run logged: ``series[metric][iteration] = value`` after de-duplication."""
    label: str
    metrics_path: Path
    config: Optional[dict]
    series: Dict[str, Dict[int, float]] = field(default_factory=dict)
    tokens: Dict[int, float] = field(default_factory=dict)  # from a TOKENS_FIELD, when records have one
    restarts: int = 0  # attempts after the first (resumes)
    skipped_lines: int = 0  # lines that were not JSON records

    @property
    def preset(self) -> str:
        return preset_label(self.config) if self.config else "?"

    @property
    def tokens_per_iteration(self) -> Optional[int]:
        """Global batch x sequence length from the run's config (None without a config)."""
        try:
            return int(self.config["training"]["train_batch_size"]) * int(self.config["model"]["seq_length"])
        except (TypeError, KeyError, ValueError):
            return None

    def tokens_at(self, iteration: int) -> Optional[float]:
        if iteration in self.tokens:
            return self.tokens[iteration]
        per_iteration = self.tokens_per_iteration
        return None if per_iteration is None or self.tokens else float(iteration * per_iteration)

    def last(self, metric: str) -> Optional[tuple[int, float]]:
        """(iteration, value) of the metric's last record, or None."""
        values = self.series.get(metric)
        if not values:
            return None
        iteration = max(values)
        return iteration, values[iteration]

    def finished(self, train_iters: int) -> bool:
        """Logged a training loss and a validation loss at ``train_iters`` (the trainer logs and
        evaluates at the last step whatever the intervals)."""
        return (train_iters in self.series.get(TRAIN_LOSS, {})
                and train_iters in self.series.get(VALID_LOSS, {}))


def metrics_file(path: str | Path) -> Path:
    """``path`` itself (a metrics.jsonl) or the metrics.jsonl inside folder ``path``."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise RunError(f"{path}: no such file (give a metrics.jsonl or the log folder holding one)")
    return path


def latest_config(folder: Path) -> Optional[dict]:
    """The newest ``neox_config_*.json`` in ``folder`` (names start with the launch time), or None."""
    for candidate in sorted(folder.glob("neox_config_*.json"), reverse=True):
        try:
            config = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict):
            return config
    return None


def preset_label(config: dict) -> str:
    """``zero3``, ``zeropp (INT8 weights, INT4 grads)``, ``zero_topo (INT8 weights, INT4 grads, error
    feedback)``: the layout's preset and the quantization the engine ran with."""
    zero = config.get("zero") or {}
    name = zero.get("resolved_preset") or "?"
    name = display_name(name)
    quant = QuantSpec.from_settings(
        bool(zero.get("zero_quantized_weights")), bool(zero.get("zero_quantized_gradients")),
        bool(zero.get("zero_quantized_refresh")), error_feedback=bool(zero.get("quantization_error_feedback")),
        weight_gather_bits=zero.get("weight_gather_bits"), grad_reduce_bits=zero.get("grad_reduce_bits"),
        cross_node_grad_bits=zero.get("cross_node_grad_bits"), refresh_bits=zero.get("refresh_bits"),
        quantized_weights_delta=bool(zero.get("zero_quantized_weights_delta")),
        weight_delta_bits=zero.get("weight_delta_bits"),
        gradient_rotation=zero.get("zero_quantized_gradients_rotation") or "none")
    parts = []
    if quant.weight_gather_bits:
        parts.append(f"INT{quant.weight_gather_bits} weights")
    grad_bits = quant.grad_reduce_bits or quant.cross_node_grad_bits
    if grad_bits:
        parts.append(f"INT{grad_bits} grads")
        if quant.gradient_rotation != "none":
            parts.append(f"{quant.gradient_rotation} rotation")
        if quant.error_feedback:
            parts.append("error feedback")
    if quant.weight_delta_bits:
        parts.append(f"INT{quant.weight_delta_bits} weight deltas")
    return f"{name} ({', '.join(parts)})" if parts else name


def _number(value) -> Optional[float]:
    """A metric value as a float ('nan'/'inf' are how MetricsWriter writes non-finite ones)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def read_run(path: str | Path, label: Optional[str] = None) -> RunHistory:
    """Read one run (see the module doc); ``label`` defaults to the log folder's name."""
    metrics = metrics_file(path)
    text = metrics.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise RunError(f"{metrics} is empty: the run logged nothing yet")
    run = RunHistory(label=label or metrics.resolve().parent.name, metrics_path=metrics,
                     config=latest_config(metrics.parent))
    highest = None
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            iteration = int(record["iteration"])
        except (ValueError, TypeError, KeyError):
            run.skipped_lines += 1
            continue
        trains = any(key.startswith("train/") for key in record)
        if trains and highest is not None and iteration < highest:  # a new attempt: drop what it redoes
            run.restarts += 1
            for values in (*run.series.values(), run.tokens):
                for stale in [i for i in values if i >= iteration]:
                    del values[stale]
            highest = iteration
        if trains:
            highest = iteration if highest is None else max(highest, iteration)
        for key, value in record.items():
            number = _number(value)
            if key == "iteration" or number is None:
                continue
            if key == TOKENS_FIELD:
                run.tokens[iteration] = number
            else:
                run.series.setdefault(key, {})[iteration] = number
    if not run.series:
        raise RunError(f"{metrics} holds no metric records (is it a NeoX-Topo metrics.jsonl?)")
    return run
