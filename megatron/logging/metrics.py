"""Where metrics go: metrics.jsonl (always), the console, tensorboard and wandb (when enabled).

Only rank 0 writes. Metric names are NeoX's (`train/lm_loss`, `validation/lm_loss_ppl`, ...), so
dashboards built for NeoX read ours unchanged.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Optional


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class MetricsWriter:
    """One JSON object per `log` call in `<log_dir>/metrics.jsonl`, mirrored to tb/wandb: the trainer
    logs a full record every log_interval steps, the numerics alone on the steps between, and evaluations."""

    def __init__(self, log_dir: str, *, enabled: bool, tensorboard_dir: str | None = None,
                 use_wandb: bool = False, wandb_project: str = "neox-topo",
                 wandb_group: str | None = None, run_config: dict | None = None):
        self.enabled = enabled
        self.path = Path(log_dir) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        if use_wandb:
            import wandb
            self._wandb = wandb.init(project=wandb_project, group=wandb_group, config=run_config,
                                     dir=str(self.path.parent))

    def log(self, iteration: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"iteration": iteration, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key == "iteration" or not isinstance(value, (int, float)):
                continue
            if self._tb is not None:
                self._tb.add_scalar(key, value, iteration)
        if self._wandb is not None:
            self._wandb.log(record, step=iteration)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class ProgressLine:
    """`step 40/200 | loss 4.1234 | lr 9.8e-04 | grad 0.91 | 12,345 tok/s | 151.2 TFLOPS | MFU 45.3% |
    mem 44.61 GiB | ETA 1m02s` (TFLOPS per GPU; MFU where the device's peak is known; mem: the step's
    peak on the device, the process's RSS on a CPU)."""

    def __init__(self, total_iters: int, start_iter: int = 0, stream=sys.stdout):
        self.total = total_iters
        self.start_iter = start_iter
        self.t0 = time.perf_counter()
        self.stream = stream

    def line(self, iteration: int, loss: float, lr: float, grad_norm: float, speed,
             peak_memory: Optional[int] = None) -> str:
        """``speed``: a ``megatron.logging.throughput.Throughput``."""
        done = iteration - self.start_iter
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - iteration) if done > 0 else float("nan")
        eta_text = format_duration(eta) if math.isfinite(eta) else "?"
        parts = [f"step {iteration}/{self.total}", f"loss {loss:.4f}", f"lr {lr:.3e}", f"grad {grad_norm:.3f}",
                 f"{speed.tokens_per_sec:,.0f} tok/s", f"{speed.flops_per_sec_per_gpu / 1e12:.4g} TFLOPS"]
        if speed.mfu is not None:
            parts.append(f"MFU {100 * speed.mfu:.1f}%")
        if peak_memory is not None:
            parts.append(f"mem {format_bytes(peak_memory)}")
        return " | ".join(parts + [f"ETA {eta_text}"])

    def print(self, *args) -> None:
        print(self.line(*args), file=self.stream, flush=True)


def log_print(message: str, rank: int = 0) -> None:
    """Console output from rank 0 only (other ranks stay quiet unless something fails)."""
    if rank == 0:
        print(message, flush=True)
