"""Quantized collectives of the engine (docs/engine.md, "Quantized collectives").

- The bits of every quantizable phase come from the run's ``megatron.config.quant_spec.QuantSpec``.
- Messages: a chunk of n elements travels as ONE byte buffer (of the codes' dtype), its codes (n bytes at 8 bits, n/2 at
  4) followed by its n/b fp32 scales as bytes, so the ledger charges exactly what is sent. The
  kernels encode into a send buffer's messages and decode received ones where they lie (rows of
  the buffer): no message is packed or unpacked by a copy.
- ``QuantizedCollectives``: the weight gather (quantize own chunk, allgather messages, every member
  dequantizes every chunk) and the gradient reduction (a chain of all-to-all hops, each followed by
  the fused dequantize -> fp32 sum -> requantize kernel; the last hop ends in an fp32 sum), with
  optional error feedback per hop. A reduction is never a quantized ring.
- Nothing here waits for the device: the quantizer's finiteness check (a host sync per call) is off.
  A NaN/inf block keeps its NaN/inf scale, so it arrives NaN/inf: a non-finite gradient reaches the
  global norm on every rank (the engine skips the step and resets the residuals); a non-finite
  weight makes the loss NaN.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.ops.quant import codes_dtype, codes_numel, get_quantizer
from megatron.ops.quant.base import interleaved_rows, record_bytes, record_numel
from megatron.config.quant_spec import QuantSpec
from megatron.topology.groups import RankGroup
from megatron.engine.comm import Communicator, Pending
from megatron.engine.grad_reduce import Chain, run_to_end



# ---------------------------------------------------------------------------------------------------
# Messages: codes then scales, one byte buffer, written and read in place by the kernels
# ---------------------------------------------------------------------------------------------------

message_bytes = record_bytes  # a chunk of n elements travels as n x bits/8 code bytes + 4 n/block


class Outbox:
    """A new buffer of k messages (``numel`` values in all, n/k each) and ``rows``, the (codes, scales)
    rows the kernels encode into: views of the buffer, so nothing is packed. Where a message's scales
    cannot be viewed as fp32 (an odd number of blocks of 2 at INT4, an odd INT8 block), the rows are
    tensors of their own, copied into the buffer by ``sealed``."""

    __slots__ = ("k", "buf", "rows", "_staged")

    def __init__(self, k: int, numel: int, bits: int, block: int, device: torch.device):
        self.k = k
        # bytes in the codes' own dtype (int8 at INT8): one view fewer to make the rows (interleaved_rows)
        self.buf = torch.empty(k * message_bytes(numel // k, bits, block), dtype=codes_dtype(bits), device=device)
        rows = interleaved_rows(self.buf, k, bits, block)
        self._staged = rows is None
        if rows is None:
            rows = (torch.empty(k, codes_numel(numel // k, bits), dtype=codes_dtype(bits), device=device),
                    torch.empty(k, numel // k // block, dtype=torch.float32, device=device))
        self.rows = rows

    def sealed(self) -> torch.Tensor:
        """The buffer, its messages complete."""
        if self._staged:
            codes, scales = self.rows
            self.buf.view(torch.uint8).view(self.k, -1).copy_(
                torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)], dim=1))
        return self.buf


def received_rows(buf: torch.Tensor, k: int, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k messages as the (codes, scales) rows the kernels read: views of ``buf``, or copies where
    the scales cannot be viewed as fp32 (see ``Outbox``)."""
    rows = interleaved_rows(buf, k, bits, block)
    if rows is not None:
        return rows
    records = buf.view(torch.uint8).view(k, -1)
    ncodes = codes_numel(record_numel(records.shape[1], bits, block), bits)
    return records[:, :ncodes].clone().view(codes_dtype(bits)), records[:, ncodes:].clone().view(torch.float32)


def merge_messages(received: torch.Tensor, k: int, first: int, count: int, bits: int, block: int) -> torch.Tensor:
    """Messages ``first .. first+count-1`` of k received ones as ONE message of their concatenated
    chunks: the same codes and scales, no re-quantization (zeropp's INT8 secondary copy)."""
    codes, scales = received_rows(received, k, bits, block)
    chunk_numel = record_numel(received.numel() // k, bits, block)
    merged = Outbox(1, count * chunk_numel, bits, block, received.device)
    merged.rows[0].copy_(codes[first:first + count].reshape(1, -1))
    merged.rows[1].copy_(scales[first:first + count].reshape(1, -1))
    return merged.sealed()


class QuantizedCollectives:
    """Quantized weight gathers and gradient reductions through ``comm`` (so the ledger sees them)."""

    def __init__(self, comm: Communicator, settings: QuantSpec, device: torch.device):
        self.comm, self.settings, self.block = comm, settings, settings.block_size
        self.rotate_gradients = settings.gradient_rotation == "hadamard"  # gradient reductions only
        self.quantizer = get_quantizer(settings.impl, device)

    # -- encoding ---------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, bits: int, residual: Optional[torch.Tensor] = None,
               residual_scale: float = 1.0, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``x`` (+ the error-feedback ``residual``, which becomes what this quantization lost).

        The residual is kept in unscaled units: ``x`` carries the loss scale ``residual_scale``, so
        the residual is multiplied by it on the way in and divided by it on the way out (exact for
        the powers of two a dynamic loss scale takes), and a changed scale needs no rescaling.
        ``out``: the rows to encode into (an ``Outbox``'s).
        """
        x_in = x.float() + residual * residual_scale if residual is not None else x
        codes, scales = self.quantizer.quantize(x_in, bits, self.block, check_finite=False, out=out)
        if residual is not None:
            residual.copy_(x_in - self.quantizer.dequantize(codes, scales, bits, self.block))
            if residual_scale != 1.0:
                residual.div_(residual_scale)
        return codes, scales

    def roundtrip(self, x: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
        """dequantize(quantize(x)) in ``dtype``: what a member receives for ``x`` (x of whole blocks)."""
        codes, scales = self.quantizer.quantize(x.contiguous(), bits, self.block, check_finite=False)
        return self.quantizer.dequantize(codes, scales, bits, self.block, dtype=dtype)

    def message(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        """One chunk of weights as its message (a NaN/inf block travels as its NaN/inf scale)."""
        outbox = Outbox(1, x.numel(), bits, self.block, x.device)
        self.quantizer.quantize(x.contiguous(), bits, self.block, check_finite=False, out=outbox.rows)
        return outbox.sealed()

    # -- gathers ----------------------------------------------------------------------------------
    def all_gather_messages(self, message: torch.Tensor, group: RankGroup, phase: str
                            ) -> tuple[torch.Tensor, dict[str, int]]:
        """Every member's message in member order (one allgather, B = k x message), and the charges."""
        received, charges, pending = self.start_all_gather_messages(message, group, phase)
        pending.wait()
        return received, charges

    def start_all_gather_messages(self, message: torch.Tensor, group: RankGroup, phase: str
                                  ) -> tuple[torch.Tensor, dict[str, int], Pending]:
        """``all_gather_messages`` issued asynchronously: ``received`` is valid after ``wait()``."""
        received = torch.empty(message.numel() * group.size, dtype=message.dtype, device=message.device)
        charges, pending = self.comm.start_all_gather(received, message, group, phase)
        return received, charges, pending

    def dequantize_into(self, out: torch.Tensor, received: torch.Tensor, k: int, bits: int) -> None:
        """k received messages -> ``out`` (flat: their chunks in order, in ``out``'s dtype), decoded
        where they lie."""
        codes, scales = received_rows(received, k, bits, self.block)
        self.quantizer.dequantize(codes, scales, bits, self.block, out=out)

    def gather(self, out: torch.Tensor, chunk: torch.Tensor, group: RankGroup, phase: str, bits: int
               ) -> tuple[torch.Tensor, dict[str, int]]:
        """Quantized allgather of ``chunk`` into ``out``; the owner dequantizes its own chunk too, so
        every member holds identical values. Returns the received messages and the charges."""
        received, charges = self.all_gather_messages(self.message(chunk, bits), group, phase)
        self.dequantize_into(out, received, group.size, bits)
        return received, charges

    # -- reductions -------------------------------------------------------------------------------
    def reduce(self, x: torch.Tensor, hops: list[tuple[RankGroup, Optional[torch.Tensor]]], phase: str,
               bits, residual_scale: float = 1.0) -> torch.Tensor:
        """Sum ``x`` over a chain of groups; at each hop this rank keeps the chunk of its member index.

        ``hops``: (group, error-feedback residual of that hop's input or None), groups of one rank
        left out by the caller; ``bits``: one width for every hop, or one per hop (8 inside a node,
        4 across nodes). Each hop is an all-to-all of k messages of n/k elements; between hops the
        fused dequantize-sum-requantize (which also applies the next hop's residual; at a change of
        width a sum, then a quantization); the last hop ends in the fp32 sum, which is returned (n /
        prod(k) elements). With the Hadamard rotation the sum is taken in the rotated basis (sums
        commute with it) and rotated back at the end. Residuals are in unscaled units (rotated
        ones with the rotation); ``residual_scale`` is the loss scale ``x`` carries (see ``encode``).
        """
        return run_to_end(self.reduce_chain(x, hops, phase, bits, residual_scale))

    def reduce_chain(self, x: torch.Tensor, hops: list[tuple[RankGroup, Optional[torch.Tensor]]], phase: str,
                     bits, residual_scale: float = 1.0) -> Chain:
        """``reduce`` as a chain (megatron/engine/grad_reduce.py): yields each issued all-to-all."""
        if not hops:
            return x.float()
        widths = [bits] * len(hops) if isinstance(bits, int) else list(bits)
        if self.rotate_gradients:
            x = self.quantizer.rotate(x.float().contiguous(), self.block)
        block, quantizer, numel = self.block, self.quantizer, x.numel()
        # each hop's messages are encoded straight into its send buffer and read where they arrive
        send = Outbox(hops[0][0].size, numel, widths[0], block, x.device)
        self.encode(x, widths[0], hops[0][1], residual_scale, out=send.rows)
        for i, (group, _residual) in enumerate(hops):
            message = send.sealed()
            received = torch.empty_like(message)
            _charges, pending = self.comm.start_all_to_all(received, message, group, phase)
            yield pending
            numel //= group.size
            codes_k, scales_k = received_rows(received, group.size, widths[i], block)
            if i + 1 < len(hops):
                residual = hops[i + 1][1]
                send = Outbox(hops[i + 1][0].size, numel, widths[i + 1], block, x.device)
                if widths[i + 1] != widths[i]:  # another width: the sum, then a quantization at it
                    total = quantizer.dequantize_sum(codes_k, scales_k, group.size, widths[i], block)
                    self.encode(total, widths[i + 1], residual, residual_scale, out=send.rows)
                    continue
                scaled = residual is not None and residual_scale != 1.0
                if scaled:  # the kernel works in the message's (scaled) units
                    residual.mul_(residual_scale)
                quantizer.reduce_requantize(codes_k, scales_k, group.size, widths[i], block, residual=residual,
                                            check_finite=False, out=send.rows)
                if scaled:
                    residual.div_(residual_scale)
        total = quantizer.dequantize_sum(codes_k, scales_k, hops[-1][0].size, widths[-1], block)
        return quantizer.rotate(total, block) if self.rotate_gradients else total


def qgz_swizzle(x: torch.Tensor, nodes: int, ranks_per_node: int) -> torch.Tensor:
    """Reorder N = nodes x R chunks so piece l (for local rank l) holds chunks ``n*R + l`` for every
    node n: the first qgZ hop then leaves local rank l with its chunk of every node, in node order."""
    return x.view(nodes, ranks_per_node, -1).transpose(0, 1).reshape(-1)
