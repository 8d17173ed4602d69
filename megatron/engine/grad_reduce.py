"""The micro-step gradient reduction as chains of collectives that can run behind the backward
(docs/engine.md, "Overlapped gradient reduction").

A unit's gradient (S elements) is reduced over a chain of hops (weight, stride; zeropp quantized:
node, rail) to this rank's 1/K share, K the product of the hop sizes. Each hop is written once, as
a generator that issues the hop's collective, yields its ``Pending`` and resumes (dequantize,
requantize, next hop) once the caller has waited for it. The same generator runs synchronously
(wait at once) or inside a ``ReductionWindow`` (overlap on), so both paths do the same arithmetic on
the same buffers in the same order: their results are bit-identical, and the ledger, charged when
a collective is issued, is the same.

Buckets. ``bucket_elements`` bounds one collective's input: a larger unit is reduced in pieces,
each the same column range [a, b) of every member's final share (the gradient viewed as K rows of
S/K), so a piece lands in ``grad_accum[a:b]`` and the bytes sent are the unit's bytes. Pieces cut
at quantization-block boundaries. gloo sums a buffer in an order that depends on its size, so
bucketed and unbucketed fp32 results agree to rounding, not bit for bit; overlap on and off with the
same bucket size agree bit for bit.

The window. At most ``max_in_flight`` pieces are issued and not yet added. Progress is made only at
deterministic points (a new piece is submitted, the window is full, the backward ends), never by
polling a collective's completion, so every rank issues every group's collectives in the same order.
On a submit each earlier piece with hops left moves one hop on (waiting for its current one, issued
a unit's backward ago), the oldest pieces are finished while the window is full, then the new piece
issues its first hop.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Generator, Optional

import torch

from megatron.topology.groups import RankGroup
from megatron.engine.comm import Communicator, Pending

# A reduction chain: yields each issued hop's Pending, returns this rank's reduced share.
Chain = Generator[Pending, None, torch.Tensor]
DEFAULT_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce_bucket_size default: one piece per unit here


def ladder_chain(comm: Communicator, grad: torch.Tensor, groups: list[RankGroup], phase: str,
                 dtypes: Optional[list[torch.dtype]] = None) -> Chain:
    """Reduce-scatter ``grad`` over each group in turn (groups of one rank left out by the caller),
    hop i in ``dtypes[i]`` when given (its input cast first; the engine asks fp32 for hops that
    cross nodes, docs/numerics.md)."""
    for i, group in enumerate(groups):
        if dtypes is not None and grad.dtype != dtypes[i]:
            grad = grad.to(dtypes[i])
        out = torch.empty(grad.numel() // group.size, dtype=grad.dtype, device=grad.device)
        _charges, pending = comm.start_reduce_scatter(out, grad, group, phase)
        yield pending
        grad = out
    return grad


def quantized_piece_chain(qcomm, grad: torch.Tensor, hops: list[tuple[RankGroup, Optional[torch.Tensor]]],
                          rows: int, a: int, b: int, phase: str, bits, residual_scale: float) -> Chain:
    """Columns [a, b) of ``grad`` (``rows`` rows) through ``qcomm.reduce_chain``. Each hop's residual
    is cut the same way: hop i's input has rows / (k_0 ... k_{i-1}) rows of the same columns. A cut
    that is not contiguous is reduced in a copy, written back once the chain is done. The piece is
    cut now, so the chain holds the piece, not the whole gradient, while it is in flight."""
    piece_hops, copies, remaining = [], [], rows
    for group, residual in hops:
        if residual is not None:
            view = residual.view(remaining, -1)[:, a:b]
            mine = view if view.is_contiguous() else view.contiguous()
            if mine is not view:
                copies.append((view, mine))
            residual = mine.view(-1)
        piece_hops.append((group, residual))
        remaining //= group.size
    chain = qcomm.reduce_chain(piece_of(grad, rows, a, b), piece_hops, phase, bits, residual_scale)
    return _write_back(chain, copies) if copies else chain  # no generator layer per hop when nothing is copied


def _write_back(chain: Chain, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Chain:
    result = yield from chain
    for view, mine in copies:
        view.copy_(mine)
    return result


def run_to_end(chain: Chain) -> torch.Tensor:
    """The synchronous path: wait for every hop as soon as it is issued."""
    while True:
        try:
            pending = next(chain)
        except StopIteration as done:
            return done.value
        pending.wait()


def column_ranges(share: int, rows: int, bucket_elements: int, quantum: int = 1) -> list[tuple[int, int]]:
    """Column ranges [a, b) of a (rows x share) gradient whose pieces hold at most ``bucket_elements``
    (at least one ``quantum`` of columns each; ``share`` is a multiple of ``quantum``)."""
    width = max(quantum, bucket_elements // rows // quantum * quantum)
    return [(a, min(a + width, share)) for a in range(0, share, width)]


def piece_of(x: torch.Tensor, rows: int, a: int, b: int) -> torch.Tensor:
    """Columns [a, b) of ``x`` viewed as ``rows`` rows, flat; ``x`` itself when that is all of it."""
    view = x.view(rows, -1)
    if a == 0 and b == view.shape[1]:
        return x
    return view[:, a:b].reshape(-1)  # a copy: the piece's send buffer


@dataclass
class _InFlight:
    chain: Chain
    hops_left: int
    pending: Optional[Pending]
    done: Callable[[torch.Tensor], None]


class ReductionWindow:
    """Reduction chains in flight behind the backward (overlap on) or run at once (overlap off)."""

    def __init__(self, overlap: bool, max_in_flight: int = 2):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.overlap, self.max_in_flight = overlap, max_in_flight
        self._window: deque[_InFlight] = deque()
        self.peak_in_flight = 0  # the most pieces ever issued and not yet added (tests, memory)

    def submit(self, chain: Chain, hops: int, done: Callable[[torch.Tensor], None]) -> None:
        """Start a chain of ``hops`` collectives; ``done(result)`` runs once it has finished."""
        if not self.overlap or hops == 0:
            done(run_to_end(chain))
            return
        for entry in self._window:  # earlier pieces move one hop on, in submission order
            if entry.hops_left > 0 and entry.pending is not None:
                self._step(entry)
        while len(self._window) >= self.max_in_flight:  # room first: never more than the bound issued
            self._finish(self._window.popleft())
        entry = _InFlight(chain, hops, None, done)
        self._step(entry)
        self._window.append(entry)
        self.peak_in_flight = max(self.peak_in_flight, len(self._window))

    def drain(self) -> None:
        """Finish every chain, oldest first (the end of a backward: the optimizer reads the sums)."""
        while self._window:
            self._finish(self._window.popleft())

    def abandon(self) -> None:
        """Forget the chains without waiting (the pass failed; its gradients are never used)."""
        self._window.clear()

    @property
    def in_flight(self) -> int:
        return len(self._window)

    def _step(self, entry: _InFlight) -> None:
        """Wait for the entry's current hop (if any), then run it to its next issued hop or its end."""
        if entry.pending is not None:
            entry.pending.wait()
        try:
            entry.pending = next(entry.chain)
            entry.hops_left -= 1
        except StopIteration as finished:
            entry.pending, entry.hops_left = None, -1
            entry.done(finished.value)

    def _finish(self, entry: _InFlight) -> None:
        while entry.hops_left >= 0:
            self._step(entry)
