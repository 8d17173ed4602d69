"""Peak memory per phase of a rank's life (build, load, step, save), measured, not estimated.

Host memory is the process's peak resident set (``VmHWM`` in /proc/self/status); Linux resets it to
the current RSS when "5" is written to /proc/self/clear_refs, which is how one phase's peak is told
from the previous one's. On a GPU the device's peak allocation (torch.cuda.max_memory_allocated,
reset per phase) is recorded beside it. Where /proc is missing (not Linux) the host figures are None.

On a CPU run, ``AllocatorTrace`` gives the counterpart of the GPU's figure: each phase's peak of the
bytes torch's CPU allocator holds, from torch.profiler's memory events (one event per allocation
and free, followed by address; a mapped file counts as one allocation of its size). The resident
set also counts the allocator's freed-but-kept pages, the interpreter and file pages; the
allocator's count is the quantity the memory model's terms add up.
"""
from __future__ import annotations

import bisect
import contextlib
import json
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

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


PHASE_MARK = "memory_phase:"


class AllocatorTrace:
    """Every CPU allocation and free from ``start()`` on, with the phases marked: ``peaks()`` gives
    each phase's largest count of bytes held, counted from zero at ``start()`` (as the GPU's
    allocator counts from nothing; what was allocated before is the baseline and its frees are not
    reported). One trace for the whole run, because the profiler forgets a block's size once it is
    stopped. It keeps one event per allocation: for a run of a few steps (bench/memory.py), not a
    long training run."""

    def __init__(self):
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._peaks: Optional[dict[str, int]] = None

    def start(self) -> None:
        self._profile.__enter__()

    def mark(self, name: str):
        return record_function(PHASE_MARK + name)

    def peaks(self) -> dict[str, int]:
        """{phase: peak bytes held}; stops the trace the first time it is called."""
        if self._peaks is None:
            self._profile.__exit__(None, None, None)
            self._peaks = allocator_peaks(self._profile.profiler.kineto_results.experimental_event_tree())
        return self._peaks


def allocator_peaks(roots) -> dict[str, int]:
    """{phase: the largest count of bytes held inside the phase's marks (every window of a phase
    entered more than once), the count at the phase's start included}, from the profiler's event
    tree. Blocks are followed by address: a free the profiler did not see (a block freed on a
    thread it does not follow, a collective's worker) is taken as done when its address is handed
    out again, so a missed free does not count for the rest of the run."""
    allocations, windows, stack = [], [], list(roots)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        fields = node.extra_fields
        if hasattr(fields, "alloc_size"):
            allocations.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        elif node.name.startswith(PHASE_MARK):
            windows.append((node.name[len(PHASE_MARK):], node.start_time_ns, node.end_time_ns))
    allocations.sort()
    held, times, live, running = [], [], {}, 0
    for time_ns, ptr, size in allocations:
        running -= live.pop(ptr, 0)  # a free (or, for an allocation, a free that was missed)
        if size > 0:
            live[ptr] = size
            running += size
        held.append(running)
        times.append(time_ns)
    peaks: dict[str, int] = {}
    for name, begin, end in windows:
        first, last = bisect.bisect_left(times, begin), bisect.bisect_right(times, end)
        at_start = held[first - 1] if first else 0
        peaks[name] = max(peaks.get(name, 0), at_start, max(held[first:last], default=0))
    return peaks


class PhasePeaks:
    """``with peaks.phase("step"): ...`` records that phase's peak; a phase entered again (every
    step, every save) keeps the largest peak seen. ``trace_allocator`` (a CPU run): also each phase's
    peak of the CPU allocator's bytes (``AllocatorTrace``), the GPU's figure's counterpart."""

    def __init__(self, device: Optional[torch.device] = None, trace_allocator: bool = False):
        self.device = device
        self.host: dict[str, int] = {}
        self.device_peak: dict[str, int] = {}
        self.baseline = rss_bytes()  # the interpreter, torch and our imports, before any model state
        self.allocator = AllocatorTrace() if trace_allocator else None
        if self.allocator is not None:
            self.allocator.start()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        reset_peak()
        marked = self.allocator.mark(name) if self.allocator is not None else contextlib.nullcontext()
        try:
            with marked:
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
        out = {"baseline_rss": self.baseline, "peak_rss": dict(self.host), "device_peak": dict(self.device_peak)}
        if self.allocator is not None:
            out["allocator_peak"] = self.allocator.peaks()
        return out

    def write(self, folder: str | Path, rank: int) -> Path:
        """<folder>/memory/rank_<rank>.json (each rank its own file: no collective needed)."""
        path = Path(folder) / "memory" / f"rank_{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=1))
        return path
