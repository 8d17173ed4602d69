"""Peak memory per phase of a rank's life (build, load, step, save), measured, not estimated.

Host memory is the process's peak resident set (``VmHWM`` in /proc/self/status); Linux resets it to
the current RSS when "5" is written to /proc/self/clear_refs, which is how one phase's peak is told
from the previous one's. On a GPU the device's peak allocation (torch.cuda.max_memory_allocated,
reset per phase) is recorded beside it. Where /proc is missing (not Linux) the host figures are None.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator, Optional

import torch

STATUS, CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"


def _status_kib(field: str) -> Optional[int]:
    try:
        with open(STATUS) as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_bytes() -> Optional[int]:
    """The process's peak resident set since start or the last reset, in bytes."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def rss_bytes() -> Optional[int]:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_peak() -> bool:
    """Start a new peak from the current RSS (and the device's current allocation); False where the
    kernel does not allow it, in which case later peaks include earlier phases."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open(CLEAR_REFS, "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


class PhasePeaks:
    """``with peaks.phase("step"): ...`` records that phase's peak; a phase entered again (every
    step, every save) keeps the largest peak seen."""

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device
        self.host: dict[str, int] = {}
        self.device_peak: dict[str, int] = {}
        self.baseline = rss_bytes()  # the interpreter, torch and our imports, before any model state

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        reset_peak()
        try:
            yield
        finally:
            host = peak_rss_bytes()
            if host is not None:
                self.host[name] = max(self.host.get(name, 0), host)
            if self.device is not None and self.device.type == "cuda":
                self.device_peak[name] = max(self.device_peak.get(name, 0),
                                             torch.cuda.max_memory_allocated(self.device))

    def peak_bytes(self, name: str) -> Optional[int]:
        """The phase's peak on the run's device: the GPU's allocation, else (CPU) the process's RSS."""
        if self.device is not None and self.device.type == "cuda":
            return self.device_peak.get(name)
        return self.host.get(name)

    def as_dict(self) -> dict:
        return {"baseline_rss": self.baseline, "peak_rss": dict(self.host), "device_peak": dict(self.device_peak)}

    def write(self, folder: str | Path, rank: int) -> Path:
        """<folder>/memory/rank_<rank>.json (each rank its own file: no collective needed)."""
        path = Path(folder) / "memory" / f"rank_{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=1))
        return path
