"""The one wrapper every collective of the engine and the trainer goes through.

Before issuing a collective the wrapper charges the bytes this rank sends to the ledger, under the
standard algorithm in the group's sorted order (docs/engine.md, "Bytes charged"):
ring all-gather / reduce-scatter: (k-1)/k x B to the next member; all-reduce: twice that;
all-to-all: B/k to each other member. Each send is charged to the tier between sender and receiver.
A group of one rank issues nothing and records nothing (a local copy keeps the semantics).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.topology import compat
from megatron.topology.groups import ProcessGroups, RankGroup
from megatron.zero_topo.ledger import ByteLedger


class CommError(ValueError):
    """Buffers that do not fit the collective (sizes, divisibility); a programming error in a caller."""


class Communicator:
    """Collectives on ``RankGroup``s of ``groups``, charged to ``ledger`` by phase and tier."""

    def __init__(self, groups: ProcessGroups, ledger: ByteLedger | None = None, device: torch.device | str = "cpu"):
        self.groups = groups
        self.topology = groups.topology
        self.rank = groups.rank
        self.ledger = ledger if ledger is not None else ByteLedger()
        self.device = torch.device(device)  # where small control buffers live (cuda under NCCL)

    # -- charging -----------------------------------------------------------------------------------
    def charge(self, op: str, nbytes: int, group: RankGroup, phase: str) -> dict[str, int]:
        """Record what this rank sends for ``op`` on a B-byte buffer; returns {tier: bytes}."""
        k = group.size
        if k == 1:
            return {}
        if nbytes % k:
            raise CommError(f"{op} of {nbytes} bytes over {k} ranks: the buffer must be a multiple of {k}")
        me = group.index(self.rank)
        charges: dict[str, int] = {}
        if op in ("all_gather", "reduce_scatter", "all_reduce"):
            nxt = group.ranks[(me + 1) % k]
            factor = 2 if op == "all_reduce" else 1
            charges[self.topology.tier_between(self.rank, nxt)] = factor * (k - 1) * (nbytes // k)
        elif op == "all_to_all":
            for peer in group.ranks:
                if peer != self.rank:
                    tier = self.topology.tier_between(self.rank, peer)
                    charges[tier] = charges.get(tier, 0) + nbytes // k
        else:
            raise CommError(f"unknown collective {op!r}")
        for tier, sent in charges.items():
            self.ledger.record(phase, tier, sent)
        return charges

    # -- collectives --------------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: RankGroup, phase: str) -> dict[str, int]:
        """Member i's ``inp`` lands in chunk i of the flat ``out``; returns the charges {tier: bytes}."""
        charges, pending = self.start_all_gather(out, inp, group, phase)
        pending.wait()
        return charges

    def start_all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: RankGroup, phase: str
                         ) -> tuple[dict[str, int], "Pending"]:
        """``all_gather`` issued asynchronously: charged now (bytes leave whether or not anyone waits),
        ``out`` valid after ``wait()``. ``inp`` and ``out`` must stay untouched until then (the handle
        keeps both alive)."""
        if out.numel() != inp.numel() * group.size:
            raise CommError(f"all_gather: output has {out.numel()} elements, expected {group.size} x {inp.numel()}")
        if group.size == 1:
            _copy_unless_same(out, inp)
            return {}, Pending(None)
        charges = self.charge("all_gather", _nbytes(out), group, phase)
        return charges, Pending(compat.all_gather_tensor(out, inp, group=group.handle, async_op=True), inp, out)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: RankGroup, phase: str) -> dict[str, int]:
        """Sum ``inp`` over the members; member i gets chunk i in ``out``."""
        charges, pending = self.start_reduce_scatter(out, inp, group, phase)
        pending.wait()
        return charges

    def start_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: RankGroup, phase: str
                             ) -> tuple[dict[str, int], "Pending"]:
        """``reduce_scatter`` issued asynchronously (charged now, ``out`` valid after ``wait()``)."""
        if inp.numel() != out.numel() * group.size:
            raise CommError(f"reduce_scatter: input has {inp.numel()} elements, expected {group.size} x {out.numel()}")
        if group.size == 1:
            _copy_unless_same(out, inp)
            return {}, Pending(None)
        charges = self.charge("reduce_scatter", _nbytes(inp), group, phase)
        return charges, Pending(compat.reduce_scatter_tensor(out, inp, group=group.handle, async_op=True), inp, out)

    def all_reduce(self, buf: torch.Tensor, group: RankGroup, phase: str) -> dict[str, int]:
        """Sum ``buf`` over the members, in place."""
        charges = self.charge("all_reduce", _nbytes(buf), group, phase)
        self.issue_all_reduce(buf, group)
        return charges

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: RankGroup, phase: str) -> dict[str, int]:
        """Chunk j of ``inp`` goes to member j; chunk i of ``out`` comes from member i (equal splits)."""
        charges, pending = self.start_all_to_all(out, inp, group, phase)
        pending.wait()
        return charges

    def start_all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: RankGroup, phase: str
                         ) -> tuple[dict[str, int], "Pending"]:
        """``all_to_all`` issued asynchronously (charged now, ``out`` valid after ``wait()``)."""
        if out.numel() != inp.numel():
            raise CommError(f"all_to_all: output has {out.numel()} elements, input {inp.numel()}")
        if group.size == 1:
            _copy_unless_same(out, inp)
            return {}, Pending(None)
        charges = self.charge("all_to_all", _nbytes(inp), group, phase)
        return charges, Pending(dist.all_to_all_single(out, inp, group=group.handle, async_op=True), inp, out)

    def issue_all_reduce(self, buf: torch.Tensor, group: RankGroup) -> None:
        """The all-reduce without charging: only for callers that charged beforehand (the ledger sync)."""
        if group.size > 1:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group.handle)

    def barrier(self) -> None:
        """World barrier (no payload, not charged); used around checkpoint commits."""
        if self.groups.world.size > 1:
            dist.barrier()


class Pending:
    """An issued collective (or a local copy already done): ``wait()`` before reading its output.
    On GPUs the wait orders the current stream after the collective's stream. Until then it holds
    the collective's buffers, so a caller's temporary send buffer cannot be freed under it."""

    def __init__(self, work, *buffers: torch.Tensor):
        self._work, self._buffers = work, buffers

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work, self._buffers = None, ()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_unless_same(out: torch.Tensor, inp: torch.Tensor) -> None:
    if out.data_ptr() != inp.data_ptr():
        out.copy_(inp.view(out.shape))
