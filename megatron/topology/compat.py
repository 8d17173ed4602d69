"""One place that knows the names of torch's tensor collectives across versions.

torch 2.13 renamed ``all_gather_into_tensor`` -> ``all_gather_single`` and ``reduce_scatter_tensor``
-> ``reduce_scatter_single`` (the old names still work with a FutureWarning); the ROCm builds on
clusters lag (2.4-2.9 only have the old names). Callers use the two functions below.
"""
from __future__ import annotations

import torch.distributed as dist


def _first(names: tuple[str, ...]):
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch.distributed has none of {names}: torch >= 2.4 is required")


def all_gather_tensor(output, input, group=None, async_op: bool = False):
    """All-gather ``input`` of every member into the flat ``output`` (member order)."""
    return _first(_ALL_GATHER)(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output, input, group=None, async_op: bool = False):
    """Sum ``input`` over the members; member i receives chunk i into ``output``."""
    return _first(_REDUCE_SCATTER)(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


_ALL_GATHER = ("all_gather_single", "all_gather_into_tensor")
_REDUCE_SCATTER = ("reduce_scatter_single", "reduce_scatter_tensor")
