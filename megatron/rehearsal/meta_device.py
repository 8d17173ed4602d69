"""The meta device as a stand-in for a GPU in a rehearsal (tools/rehearse.py --device meta).

On ``meta`` every op runs for shapes, dtypes and devices only: no memory, no arithmetic, so what a
step costs the host (Python, dispatch, the engine's bookkeeping) is measured without the compute, and
a host tensor mixed into device work raises as it would on a GPU. What meta cannot do is hand a
value to the host; ``answers_reads`` registers, for as long as it is active, meta kernels that do,
as the fake backend's collectives would leave the values on a CPU (fake_world.py):

- a value the host copied into a meta tensor (up to ``REMEMBERED_ELEMENTS``: a step vector, a
  length, not a checkpoint's pieces) is remembered and read back as it was; a device op that writes
  over it (a copy from another meta tensor) forgets that part;
- every other read (``.item()``, ``float(t)``, ``bool(t)``) returns 0 (False), ``torch.equal``
  True, and a copy to the host leaves zeros (``.cpu()``, ``.tolist()``, a checkpoint's pieces);
- a copy into meta checks shapes.

So a rehearsed step reads a norm of 0 (finite: the step is taken), a loss of 0 over the micro-batch
count it packed, and writes files of the right sizes full of zeros. Values that only a collective
would bring from another rank (an all-gather's output) read as zeros, so object collectives, which
unpickle what they gather, cannot run on meta. These kernels replace torch's own meta kernels
process-wide while active (torch warns that it overrides them): use them in a process of its own,
as the rehearsal does.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch


REMEMBERED_ELEMENTS = 1 << 16  # larger host copies (checkpoint pieces, batches of long sequences) are not kept
_KEPT = 1024  # most remembered copies at once (the oldest is forgotten first)


class _Remembered:
    """Host values copied into meta tensors, by storage: {storage: (the tensor, its offset, values)}.
    Holding the tensor keeps its storage alive, so no other tensor can take its address meanwhile."""

    def __init__(self):
        self.copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def keep(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        key = dst.untyped_storage()._cdata
        if src.device.type != "cpu" or src.numel() > REMEMBERED_ELEMENTS or not dst.is_contiguous():
            self._forget(key, dst)
            return
        values = src.expand(dst.shape).reshape(-1).to(dst.dtype).clone()
        self.copies.pop(key, None)
        if len(self.copies) >= _KEPT:
            self.copies.pop(next(iter(self.copies)))
        self.copies[key] = (dst, dst.storage_offset(), values)

    def _forget(self, key: int, dst: torch.Tensor) -> None:
        held = self.copies.get(key)
        if held is None:
            return
        lo = dst.storage_offset() - held[1]
        if 0 <= lo and dst.is_contiguous() and lo + dst.numel() <= held[2].numel():
            held[2][lo: lo + dst.numel()] = 0
        else:
            del self.copies[key]

    def values(self, src: torch.Tensor) -> torch.Tensor:
        """What the host would read from ``src``: its remembered values, else zeros."""
        held = self.copies.get(src.untyped_storage()._cdata)
        if held is not None and src.is_contiguous():
            lo = src.storage_offset() - held[1]
            if 0 <= lo and lo + src.numel() <= held[2].numel():
                return held[2][lo: lo + src.numel()].view(src.shape)
        return torch.zeros(src.shape, dtype=src.dtype)


@contextlib.contextmanager
def answers_reads() -> Iterator[None]:
    """Meta kernels that answer host reads and copies (module docstring), while active."""
    remembered = _Remembered()

    def read(tensor: torch.Tensor):
        return remembered.values(tensor).item()

    def copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if torch.broadcast_shapes(dst.shape, src.shape) != dst.shape:
            raise RuntimeError(f"copy_: a tensor of shape {tuple(src.shape)} does not fit one of {tuple(dst.shape)}")
        if dst.device.type == "cpu":  # meta -> host
            return dst.copy_(remembered.values(src).to(dst.dtype))
        remembered.keep(dst, src)
        return dst

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
        library = torch.library.Library("aten", "IMPL")
        library.impl("_local_scalar_dense", read, "Meta")
        library.impl("equal", lambda a, b: True, "Meta")
        library.impl("copy_", copy, "Meta")
    try:
        yield
    finally:
        library._destroy()
