"""The one wrapper every collective of the engine and the trainer goes through.

Before issuing a collective the wrapper charges the bytes this rank sends to the ledger, under the
standard algorithm in the group's sorted order (docs/engine.md, "Bytes charged"):
ring all-gather / reduce-scatter: (k-1)/k x B to the next member; all-reduce: twice that;
all-to-all: B/k to each other member. Each send is charged to the tier between sender and receiver.
A group of one rank issues nothing and records nothing (a local copy keeps the semantics).

Which algorithm runs is ``megatron.topology.algorithms.collective_algorithm``'s choice, the one the
step-time model predicts with. Reduce-scatter of CPU tensors (gloo) is ours, not gloo's: gloo's reduce-scatter all-reduces the
whole buffer and keeps a slice, 2x the ring's bytes on the wire (docs/engine.md, "Bytes charged"). A group whose members
all talk over one tier (a node's ranks, the cross-node group of one rank per node) does one
all-to-all and sums the k received chunks locally in fp32: the ring's bytes per tier, one
collective, asynchronous. A group spanning tiers (ZeRO-3's world group on several nodes) runs the
ring itself, k-1 send/receive steps to the next member, so only the ring's two node-boundary hops
cross nodes; it completes before ``start_reduce_scatter`` returns. GPU tensors use the backend's own
(NCCL/RCCL's is a ring).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.topology import compat
from megatron.topology.groups import ProcessGroups, RankGroup
from megatron.topology.algorithms import ALL_TO_ALL_SUM, backend_of_device, collective_algorithm
from megatron.engine.ledger import PHASES, TIERS, ByteLedger
from megatron.engine.nccl_rules import NcclRules, strict_from_env


class CommError(ValueError):
    """Buffers that do not fit the collective (sizes, divisibility); a programming error in a caller."""


class Communicator:
    """Collectives on ``RankGroup``s of ``groups``, charged to ``ledger`` by phase and tier."""

    def __init__(self, groups: ProcessGroups, ledger: ByteLedger | None = None, device: torch.device | str = "cpu",
                 strict: Optional[bool] = None, ring_reduce_scatter: bool = False):
        """``strict``: check every call against NCCL/RCCL's rules (megatron/engine/nccl_rules.py);
        None: as ``NEOX_TOPO_STRICT_COLLECTIVES`` says (on in the tests). ``ring_reduce_scatter``:
        on CPU tensors, run every reduce-scatter as the send/receive ring in the buffer's dtype, as
        NCCL does (a sum rounded at each hop), not gloo's all-to-all and one fp32 sum: for checks of
        NCCL's numerics on CPU (docs/numerics.md)."""
        self.groups = groups
        self.topology = groups.topology
        self.rank = groups.rank
        self.ledger = ledger if ledger is not None else ByteLedger()
        self.device = torch.device(device)  # where small control buffers live (cuda under NCCL)
        self.backend = _backend(self.device)
        self.rules = NcclRules(self.device) if (strict_from_env() if strict is None else strict) else None
        self.ring_reduce_scatter = ring_reduce_scatter
        # collectives issued, by (op, group kind): what the comm model's step_collectives counts
        self.issued: dict[tuple[str, str], int] = {}
        self._wirings: dict[int, tuple[RankGroup, _Wiring]] = {}
        self._wirings_by_ranks: dict[tuple[int, ...], _Wiring] = {}
        self._charges: dict[tuple[str, int, int], tuple[RankGroup, dict[str, int]]] = {}

    # -- charging -----------------------------------------------------------------------------------
    def charge(self, op: str, nbytes: int, group: RankGroup, phase: str) -> dict[str, int]:
        """Record what this rank sends for ``op`` on a B-byte buffer; returns {tier: bytes} (the same
        dict for the same op, size and group: read it, do not change it)."""
        key = (op, nbytes, id(group))
        held = self._charges.get(key)  # a unit's collectives repeat every micro-step: worked out once
        if held is None or held[0] is not group:
            held = (group, self._charges_of(op, nbytes, group))
            self._charges[key] = held
        charges = held[1]
        for tier, sent in charges.items():
            self.ledger.record(phase, tier, sent)
        return charges

    def _charges_of(self, op: str, nbytes: int, group: RankGroup) -> dict[str, int]:
        k = group.size
        if k == 1:
            return {}
        if nbytes % k and op != "broadcast":
            raise CommError(f"{op} of {nbytes} bytes over {k} ranks: the buffer must be a multiple of {k}")
        wiring = self.wiring(group)
        if op in ("all_gather", "reduce_scatter", "all_reduce"):
            factor = 2 if op == "all_reduce" else 1
            return {wiring.next_tier: factor * (k - 1) * (nbytes // k)}
        if op == "broadcast":  # a pipelined chain from the first member: B to the next, but the last
            return {wiring.next_tier: nbytes} if wiring.position < k - 1 else {}
        if op == "all_to_all":
            return {tier: peers * (nbytes // k) for tier, peers in wiring.peers_by_tier.items()}
        raise CommError(f"unknown collective {op!r}")

    def _issue(self, op: str, group: RankGroup) -> None:
        key = (op, group.kind)
        self.issued[key] = self.issued.get(key, 0) + 1

    def wiring(self, group: RankGroup) -> "_Wiring":
        """How this rank is wired into ``group`` (tiers, next member, peers per tier): worked out once
        per group, in O(k), so no collective pays for it again (a world group has 384 members)."""
        held = self._wirings.get(id(group))  # by identity: hashing a 384-rank tuple per collective costs more
        if held is not None and held[0] is group:
            return held[1]
        wiring = self._wirings_by_ranks.get(group.ranks)
        if wiring is None:
            me = group.index(self.rank)
            peers: dict[str, int] = {}
            for peer in group.ranks:
                if peer != self.rank:
                    tier = self.topology.tier_between(self.rank, peer)
                    peers[tier] = peers.get(tier, 0) + 1
            nxt = group.ranks[(me + 1) % group.size]
            wiring = _Wiring(self.topology.tiers_among(group.ranks), me,
                             self.topology.tier_between(self.rank, nxt) if nxt != self.rank else "", peers)
            self._wirings_by_ranks[group.ranks] = wiring
        self._wirings[id(group)] = (group, wiring)  # the group is held, so its id is not reused meanwhile
        return wiring

    def spans_nodes(self, group: RankGroup) -> bool:
        """Whether ``group`` holds ranks of more than one node."""
        return group.size > 1 and "inter_node" in self.wiring(group).tiers

    def one_tier(self, group: RankGroup) -> bool:
        """Whether every pair of members talks over the same tier."""
        return len(self.wiring(group).tiers) == 1

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
        if self.rules:
            self.rules.tensors("all_gather", out, inp)
        self._issue("all_gather", group)
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
        backend = self.backend
        exchange = (not self.ring_reduce_scatter and
                    collective_algorithm("reduce_scatter", backend, self.one_tier(group)) == ALL_TO_ALL_SUM)
        if self.rules:
            self.rules.tensors("reduce_scatter", out, inp)
            self.rules.reduce_scatter_path("nccl" if backend == "nccl" else "all_to_all_sum" if exchange else "ring")
        self._issue("reduce_scatter", group)
        if exchange:
            return self._start_exchange_reduce_scatter(out, inp, group, phase)
        charges = self.charge("reduce_scatter", _nbytes(inp), group, phase)
        if backend == "nccl":  # NCCL/RCCL's own ring
            return charges, Pending(compat.reduce_scatter_tensor(out, inp, group=group.handle, async_op=True), inp, out)
        self._ring_reduce_scatter(out, inp, group)
        return charges, Pending(None)

    def _start_exchange_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: RankGroup, phase: str
                                       ) -> tuple[dict[str, int], "Pending"]:
        """Chunk j of every member to member j (one all-to-all), then the k chunks summed here in fp32
        in member order. On one tier its charges per tier are the ring's."""
        received = torch.empty_like(inp)
        charges = self.charge("all_to_all", _nbytes(inp), group, phase)
        work = dist.all_to_all_single(received, inp.contiguous(), group=group.handle, async_op=True)

        def sum_chunks() -> None:
            out.copy_(received.view(group.size, -1).sum(dim=0, dtype=torch.float32).view(out.shape))
        return charges, Pending(work, inp, out, received, then=sum_chunks)

    def _ring_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: RankGroup) -> None:
        """The ring in member order: at step s member i sends its partial sum of chunk i-s-1 to member
        i+1 and adds its own chunk i-s-2 to what member i-1 sent; after k-1 steps it holds chunk i."""
        k, me = group.size, group.index(self.rank)
        chunks = inp.reshape(k, -1)
        nxt, prev = group.ranks[(me + 1) % k], group.ranks[(me - 1) % k]
        partial = chunks[(me - 1) % k].clone()
        received = torch.empty_like(partial)
        for step in range(k - 1):
            sent = dist.isend(partial, nxt, group=group.handle)
            dist.irecv(received, prev, group=group.handle).wait()
            sent.wait()
            partial = received + chunks[(me - step - 2) % k]
        out.copy_(partial.view(out.shape))

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
        if self.rules:
            self.rules.tensors("all_to_all", out, inp)
            self.rules.all_to_all(out, inp, group.size)
        self._issue("all_to_all", group)
        charges = self.charge("all_to_all", _nbytes(inp), group, phase)
        return charges, Pending(dist.all_to_all_single(out, inp, group=group.handle, async_op=True), inp, out)

    def issue_all_reduce(self, buf: torch.Tensor, group: RankGroup) -> None:
        """The all-reduce without charging: only for callers that charged beforehand (``world_sum``)."""
        if group.size > 1:
            if self.rules:
                self.rules.tensors("all_reduce", buf)
            self._issue("all_reduce", group)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group.handle)

    def world_sum(self, values: list, with_ledger: bool = False) -> tuple[list[float], dict[tuple[str, str], int]]:
        """Sum ``values`` (floats, or 0-d tensors on the device) over every rank as one float64 world
        all-reduce padded to a multiple of N (``control``), read back in one copy: the only wait. With
        ``with_ledger`` the ledger's counters ride in the same all-reduce, recorded after its own bytes
        are charged (the totals include it), and come back summed over the ranks; else {}.

        Python floats and counters travel as one host buffer (pinned on a GPU, copied without
        waiting); a device tensor is copied on the device: nothing here copies a value at a time."""
        world = self.groups.world
        keys = [(p, t) for p in PHASES for t in TIERS] if with_ledger else []
        n = len(values) + len(keys)
        buf = torch.zeros(max(-(-n // world.size) * world.size, world.size), dtype=torch.float64, device=self.device)
        self.charge("all_reduce", _nbytes(buf), world, "control")
        counters = self.ledger.snapshot() if with_ledger else {}
        host = [0.0 if isinstance(v, torch.Tensor) else float(v) for v in values] + [float(counters[k]) for k in keys]
        if host:
            buf[:n].copy_(_staged(host, self.device), non_blocking=True)
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                buf[i].copy_(value)
        self.issue_all_reduce(buf, world)
        summed = buf[:n].tolist()
        return summed[:len(values)], {k: int(round(v)) for k, v in zip(keys, summed[len(values):])}

    def all_gather_object(self, obj, group: RankGroup, phase: str) -> list:
        """Every member's small picklable ``obj`` in member order, on every member: two all-gathers
        (the lengths, then the pickles padded to the longest), charged to ``phase``."""
        raw = pickle.dumps(obj)
        lengths = torch.zeros(group.size, dtype=torch.int64, device=self.device)
        self.all_gather(lengths, torch.tensor([len(raw)], dtype=torch.int64, device=self.device), group, phase)
        sizes = lengths.cpu().tolist()
        words = max(-(-max(sizes) // 8), 1)
        send = _words_of(raw, words).to(self.device)
        out = torch.empty(words * group.size, dtype=torch.int64, device=self.device)
        self.all_gather(out, send, group, phase)
        table = out.cpu().view(group.size, words)
        return [pickle.loads(table[i].view(torch.uint8)[:sizes[i]].numpy().tobytes()) for i in range(group.size)]

    def broadcast_object(self, obj, group: RankGroup, phase: str):
        """The first member's picklable ``obj`` on every member (the others pass anything): its
        length, then its pickle, each broadcast from the first member, charged to ``phase``."""
        if group.size == 1:
            return obj
        root = group.ranks[0]
        raw = pickle.dumps(obj) if self.rank == root else b""
        length = torch.tensor([len(raw)], dtype=torch.int64, device=self.device)
        self.charge("broadcast", _nbytes(length), group, phase)
        if self.rules:
            self.rules.tensors("broadcast", length)
        self._issue("broadcast", group)
        dist.broadcast(length, root, group=group.handle)
        words = max(-(-int(length.item()) // 8), 1)
        buf = _words_of(raw, words).to(self.device)
        self.charge("broadcast", _nbytes(buf), group, phase)
        if self.rules:
            self.rules.tensors("broadcast", buf)
        self._issue("broadcast", group)
        dist.broadcast(buf, root, group=group.handle)
        return pickle.loads(buf.cpu().view(torch.uint8)[:int(length.item())].numpy().tobytes())

    def barrier(self) -> None:
        """World barrier (no payload, not charged); used around checkpoint commits."""
        if self.groups.world.size > 1:
            device_ids = [self.device.index or 0] if self.device.type == "cuda" else None
            if self.rules:
                self.rules.barrier(device_ids)
            self._issue("barrier", self.groups.world)
            dist.barrier(device_ids=device_ids)


def _backend(device: torch.device) -> str:
    """What runs this communicator's collectives, as ``collective_algorithm`` names it: the process
    group's backend (torch's ``fake`` stands in for NCCL/RCCL in a rehearsal, megatron/rehearsal/),
    else, before one exists, the one that moves the device's tensors."""
    if dist.is_available() and dist.is_initialized():
        return "gloo" if dist.get_backend() == "gloo" else "nccl"
    return backend_of_device(device.type)


@dataclass(frozen=True)
class _Wiring:
    """One rank's place in one group (``Communicator.wiring``)."""
    tiers: frozenset          # the tiers between any two members
    position: int             # this rank's index among the members
    next_tier: str            # the tier to the next member of the ring ("" in a group of one)
    peers_by_tier: dict       # {tier: other members reached over it}


class Pending:
    """An issued collective (or a local copy already done): ``wait()`` before reading its output.
    On GPUs the wait orders the current stream after the collective's stream. Until then it holds
    the collective's buffers, so a caller's temporary send buffer cannot be freed under it."""

    def __init__(self, work, *buffers: torch.Tensor, then: Optional[Callable[[], None]] = None):
        self._work, self._buffers, self._then = work, buffers, then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            if self._then is not None:  # the local part of the collective (a reduce-scatter's sum)
                self._then()
            self._work, self._buffers, self._then = None, (), None


def _staged(values: list[float], device: torch.device) -> torch.Tensor:
    """Python floats as one float64 host tensor, pinned when it goes to a GPU (so its copy does not
    make the host wait)."""
    host = torch.tensor(values, dtype=torch.float64)
    return host.pin_memory() if device.type == "cuda" else host


def _words_of(raw: bytes, words: int) -> torch.Tensor:
    """``raw`` zero-padded into ``words`` int64 words (collectives move whole words)."""
    buf = torch.zeros(words * 8, dtype=torch.uint8)
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else buf[:0]
    return buf.view(torch.int64)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_unless_same(out: torch.Tensor, inp: torch.Tensor) -> None:
    if out.data_ptr() != inp.data_ptr():
        out.copy_(inp.view(out.shape))
