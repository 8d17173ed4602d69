"""The engine's own host time, measured directly: the wall time inside its entry points, less the time
inside the process-group backend's calls they make.

A micro-step's wall time is the model's compute plus autograd plus the engine; subtracting the same
model's micro-step without the engine leaves the engine's share, but as the difference of two noisy
figures ten times its size. Timing the engine where it runs is exact instead: every piece of engine
code a micro-step runs is entered through the hooks it installs on the units (gather before a unit's
forward and backward, release after, the gradient's reduction) or the pass's bookkeeping around them
(begin, end of forward, drain of the reductions, end), and none of those runs model code. The
backend's own calls (``torch.distributed``; under the fake backend a rehearsal uses, a copy per group
member that NCCL would not make) are timed apart and reported as the backend's, not the engine's.

``HostClock(engine)`` wraps those entry points on the engine's objects (instance attributes over the
methods) and the backend calls on the modules the communicator calls them through; ``restore()``
removes every wrapper. The quantization kernels are timed apart too: on the CPU they compute
where a GPU's host only launches them.
"""
from __future__ import annotations

import time
from typing import Callable

import torch.distributed as dist

from megatron.topology import compat

# (attribute path on the engine, method): the engine's entry points, disjoint (none calls another)
ENTRY_POINTS = (("gathers", "begin_pass"), ("gathers", "end_forward"), ("gathers", "begin_backward"),
                ("gathers", "pre_forward"), ("gathers", "post_forward"), ("gathers", "pre_backward"),
                ("", "_post_accumulate"), ("reductions", "drain"), ("reductions", "abandon"), ("gathers", "end_pass"))
BACKEND_CALLS = ((compat, "all_gather_tensor"), (compat, "reduce_scatter_tensor"), (dist, "all_reduce"),
                 (dist, "all_to_all_single"), (dist, "broadcast"), (dist, "isend"), (dist, "irecv"), (dist, "barrier"))


# The quantizer's kernels: compute (on a GPU, launched without waiting), not the engine's Python.
KERNELS = ("quantize", "dequantize", "reduce_requantize", "dequantize_sum", "rotate", "quantize_records",
           "dequantize_records", "reduce_requantize_records", "dequantize_sum_records")


class HostClock:
    """Seconds inside the engine's entry points (``engine_s``), inside backend calls (``backend_s``,
    those made from the entry points and elsewhere alike) and inside the quantization kernels
    (``kernels_s``), since the last ``reset``."""

    def __init__(self, engine):
        self.engine_s = self.backend_s = self.kernels_s = 0.0
        self._undo: list[Callable[[], None]] = []
        for path, name in ENTRY_POINTS:
            owner = getattr(engine, path) if path else engine
            self._wrap(owner, name, self._timer("engine_s"), instance=True)
        for module, name in BACKEND_CALLS:
            self._wrap(module, name, self._timer("backend_s"), instance=False)
        if engine.qcomm is not None:
            for name in KERNELS:
                self._wrap(engine.qcomm.quantizer, name, self._timer("kernels_s"), instance=True)

    def reset(self) -> None:
        self.engine_s = self.backend_s = self.kernels_s = 0.0

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _wrap(self, owner, name: str, timer, instance: bool) -> None:
        inner = getattr(owner, name)
        setattr(owner, name, timer(inner))
        if instance:  # an instance attribute shadowing the class's method
            self._undo.append(lambda: delattr(owner, name))
        else:
            self._undo.append(lambda: setattr(owner, name, inner))

    def _timer(self, total: str) -> Callable[[Callable], Callable]:
        def wrap(inner: Callable) -> Callable:
            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    setattr(self, total, getattr(self, total) + time.perf_counter() - start)
            return timed
        return wrap
