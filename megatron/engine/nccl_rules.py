"""NCCL/RCCL's rules for a collective, checked before it is issued (the communicator's strict mode).

Every multi-rank test runs on gloo with CPU tensors, where the host is the device and gloo accepts
what NCCL would refuse or run differently. In strict mode the ``Communicator`` checks each call
against what NCCL/RCCL does, so a CPU test fails where a GPU job would:

- every tensor on the communicator's device (NCCL moves only the process's own GPU's memory: a
  tensor made on the host and handed to a collective is an error there, a silent copy nowhere);
- contiguous buffers (NCCL reads flat memory; gloo copies a strided view for you);
- dtypes NCCL has (no bool: torch sends it as uint8 and turns SUM into MAX, i.e. a logical or;
  no complex);
- equal all-to-all splits, input and output of the same size;
- a reduce-scatter takes NCCL's own ring when the communicator's device is not the host (our gloo
  paths, the all-to-all-sum and the send/receive ring, are for CPU tensors only);
- a barrier names its device under NCCL (``device_ids``), or NCCL guesses one per rank.

Object collectives (torch's ``all_gather_object``, ``broadcast_object_list``) pickle on the host;
the communicator's own ``all_gather_object``/``broadcast_object`` move the pickles as device
tensors instead, and tests/test_nccl_rules.py checks that nothing else in the package calls torch's.

The checks cost a few attribute reads per collective; strict mode is on in the test suite
(tests/conftest.py sets ``NEOX_TOPO_STRICT_COLLECTIVES=1``) and in the rehearsal (tools/rehearse.py).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

STRICT_ENV = "NEOX_TOPO_STRICT_COLLECTIVES"
# The dtypes ProcessGroupNCCL maps to an NCCL type with the same arithmetic (bool is mapped to
# uint8 with SUM made MAX; float8 needs NCCL >= 2.19 and is not used here).
NCCL_DTYPES = frozenset({torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                         torch.float32, torch.float64})


class NcclRuleError(ValueError):
    """A collective NCCL/RCCL would refuse or run differently from gloo (a programming error)."""


def strict_from_env(env=None) -> bool:
    """Strict mode's default: on when ``NEOX_TOPO_STRICT_COLLECTIVES`` is set to 1."""
    return (os.environ if env is None else env).get(STRICT_ENV, "") == "1"


class NcclRules:
    """The checks for a communicator on ``device`` (module docstring); each raises NcclRuleError."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    @property
    def on_host(self) -> bool:
        return self.device.type == "cpu"

    def tensors(self, op: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device != self.device:
                raise NcclRuleError(f"{op}: a tensor on {t.device}, but the communicator's device is {self.device}: "
                                    "NCCL/RCCL moves only the process's own device memory (a tensor made on the host?)")
            if not t.is_contiguous():
                raise NcclRuleError(f"{op}: a non-contiguous tensor of shape {tuple(t.shape)}: NCCL/RCCL reads flat "
                                    "memory; pass .contiguous() (gloo copies it silently)")
            if t.dtype not in NCCL_DTYPES:
                why = ("NCCL has no bool: torch sends it as uint8 and makes SUM a MAX (a logical or)"
                       if t.dtype is torch.bool else "NCCL has no such type")
                raise NcclRuleError(f"{op}: dtype {t.dtype}: {why}")

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, k: int) -> None:
        if out.numel() != inp.numel() or inp.numel() % k:
            raise NcclRuleError(f"all_to_all: {inp.numel()} elements in, {out.numel()} out over {k} ranks: "
                                "the engine's all-to-alls send equal splits (input and output alike)")

    def reduce_scatter_path(self, path: str) -> None:
        """``path``: the reduce-scatter algorithm the communicator chose for these tensors."""
        if path != "nccl" and not self.on_host:
            raise NcclRuleError(f"reduce_scatter: the gloo-only path {path!r} was chosen on {self.device}, where "
                                "NCCL/RCCL's ring runs")

    def barrier(self, device_ids: Optional[list[int]]) -> None:
        if not self.on_host and self.device.type == "cuda" and not device_ids:
            raise NcclRuleError("barrier without device_ids under NCCL/RCCL: it would guess a device per rank")
