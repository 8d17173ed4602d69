"""What makes the host wait for the device, counted while code runs (``HostSyncs``, a dispatch mode).

On a GPU the host runs ahead of the device until it needs a value the device computes, or copies
host memory the device cannot read asynchronously; then it waits for everything queued before.
Kinds counted:

- ``reads``: an op that hands a tensor's value to Python (``HOST_READ_OPS``: ``.item()``,
  ``float(t)``, ``bool(t)``, ``torch.equal``);
- ``device_to_host``: a copy from the device to the host (``.cpu()``, ``.tolist()`` of a device
  tensor, ``.to("cpu")``);
- ``blocking_host_to_device``: a copy from host memory that the host waits for (``non_blocking``
  off, e.g. ``.to(device)`` of a batch);
- ``pageable_host_to_device``: ``non_blocking`` from pageable (unpinned) memory: CUDA stages it
  through a pinned buffer and the host waits for the staging, so it counts as a sync. Pinning needs
  a GPU; on a machine without one (the meta-device rehearsal) these are what a GPU run pins;
- ``async_host_to_device``: ``non_blocking`` from pinned memory, the only copy that does not wait.

``count`` is the syncs: reads + device_to_host + blocking and pageable host-to-device copies.

Where it can see them: a CPU run has one memory, so only ``reads`` exist there (a ``.tolist()``
of a CPU tensor dispatches nothing). Run the same code with the engine on the ``meta`` device (with
megatron/rehearsal/meta_device.py answering its reads) and every kind appears.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::equal")
KINDS = ("reads", "device_to_host", "blocking_host_to_device", "pageable_host_to_device", "async_host_to_device")
SYNC_KINDS = KINDS[:4]

_READS = frozenset(getattr(torch.ops.aten, name.split("::")[1]).default for name in HOST_READ_OPS)
_TO_COPY, _COPY = torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default


class HostSyncs(TorchDispatchMode):
    """Counts, while active, what would make the host wait for a GPU (module docstring):
    ``with HostSyncs() as syncs: ...; syncs.count, syncs.by_kind``."""

    def __init__(self):
        super().__init__()
        self.by_kind = dict.fromkeys(KINDS, 0)

    @property
    def count(self) -> int:
        return sum(self.by_kind[kind] for kind in SYNC_KINDS)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            self.by_kind["reads"] += 1
        elif func is _TO_COPY and kwargs.get("device") is not None:
            self._copy(args[0].device, torch.device(kwargs["device"]), bool(kwargs.get("non_blocking")), args[0])
        elif func is _COPY and args[0].device != args[1].device:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self._copy(args[1].device, args[0].device, bool(non_blocking), args[1])
        return func(*args, **kwargs)

    def _copy(self, src: torch.device, dst: torch.device, non_blocking: bool, tensor: torch.Tensor) -> None:
        if src.type == dst.type:
            return
        if dst.type == "cpu":
            self.by_kind["device_to_host"] += 1
        elif src.type == "cpu":
            if not non_blocking:
                self.by_kind["blocking_host_to_device"] += 1
            elif tensor.is_pinned():
                self.by_kind["async_host_to_device"] += 1
            else:
                self.by_kind["pageable_host_to_device"] += 1
