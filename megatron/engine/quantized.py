"""Quantized collectives of the engine (docs/engine.md, "Quantized collectives").

- The bits of every quantizable phase come from the run's ``megatron.config.quant_spec.QuantSpec``.
- Messages: a chunk of n elements travels as ONE byte buffer (of the codes' dtype), its codes (n bytes at 8 bits, n/2 at
  4) followed by its n/b fp32 scales as bytes, so the ledger charges exactly what is sent. The
  kernels' records forms (``Quantizer.*_records``) encode into a send buffer's messages and decode
  received ones where they lie: no message is packed or unpacked by a copy, and on the C++ path no
  view of a message is made in Python either (the kernels take the buffer and its geometry).
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

from megatron.ops.quant import codes_dtype, get_quantizer
from megatron.ops.quant.base import read_records, record_bytes, record_numel, write_records
from megatron.config.quant_spec import QuantSpec
from megatron.topology.groups import RankGroup
from megatron.engine.comm import Communicator, Pending
from megatron.engine.grad_reduce import Chain, run_to_end



# ---------------------------------------------------------------------------------------------------
# Messages: codes then scales, one byte buffer, written and read in place by the kernels
# ---------------------------------------------------------------------------------------------------

message_bytes = record_bytes  # a chunk of n elements travels as n x bits/8 code bytes + 4 n/block


def new_messages(k: int, numel: int, bits: int, block: int, device: torch.device) -> torch.Tensor:
    """A new buffer for k messages of ``numel`` values in all (n/k each), in the codes' dtype (int8
    at INT8): the kernels' records (``Quantizer.*_records``) encode into it."""
    return torch.empty(k * message_bytes(numel // k, bits, block), dtype=codes_dtype(bits), device=device)


def merge_messages(received: torch.Tensor, k: int, first: int, count: int, bits: int, block: int) -> torch.Tensor:
    """Messages ``first .. first+count-1`` of k received ones as ONE message of their concatenated
    chunks: the same codes and scales, no re-quantization (zeropp's INT8 secondary copy)."""
    codes, scales = read_records(received, k, bits, block)
    merged = new_messages(1, count * record_numel(received.numel() // k, bits, block), bits, block, received.device)
    write_records(merged, codes[first:first + count].reshape(1, -1), scales[first:first + count].reshape(1, -1))
    return merged


class QuantizedCollectives:
    """Quantized weight gathers and gradient reductions through ``comm`` (so the ledger sees them)."""

    def __init__(self, comm: Communicator, settings: QuantSpec, device: torch.device):
        self.comm, self.settings, self.block = comm, settings, settings.block_size
        self.rotate_gradients = settings.gradient_rotation == "hadamard"  # gradient reductions only
        self.quantizer = get_quantizer(settings.impl, device)

    # -- encoding ---------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, bits: int, buf: torch.Tensor, k: int = 1,
               residual: Optional[torch.Tensor] = None, residual_scale: float = 1.0) -> torch.Tensor:
        """Quantize ``x`` (+ the error-feedback ``residual``, which becomes what this quantization lost)
        into the k messages of ``buf`` (``new_messages``), which is returned.

        The residual is kept in unscaled units: ``x`` carries the loss scale ``residual_scale``, so
        the residual is multiplied by it on the way in and divided by it on the way out (exact for
        the powers of two a dynamic loss scale takes), and a changed scale needs no rescaling.
        """
        x_in = x.float() + residual * residual_scale if residual is not None else x
        self.quantizer.quantize_records(x_in, buf, k, bits, self.block)
        if residual is not None:
            sent = self.quantizer.dequantize_records(buf, k, bits, self.block, out=torch.empty_like(x_in))
            residual.copy_(x_in - sent)
            if residual_scale != 1.0:
                residual.div_(residual_scale)
        return buf

    def roundtrip(self, x: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
        """dequantize(quantize(x)) in ``dtype``: what a member receives for ``x`` (x of whole blocks)."""
        codes, scales = self.quantizer.quantize(x.contiguous(), bits, self.block, check_finite=False)
        return self.quantizer.dequantize(codes, scales, bits, self.block, dtype=dtype)

    def message(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        """One chunk of weights as its message (a NaN/inf block travels as its NaN/inf scale)."""
        buf = new_messages(1, x.numel(), bits, self.block, x.device)
        return self.quantizer.quantize_records(x.contiguous(), buf, 1, bits, self.block)

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
        self.quantizer.dequantize_records(received, k, bits, self.block, out)

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
        message = self.encode(x, widths[0], new_messages(hops[0][0].size, numel, widths[0], block, x.device),
                              hops[0][0].size, hops[0][1], residual_scale)
        for i, (group, _residual) in enumerate(hops):
            received = torch.empty_like(message)
            _charges, pending = self.comm.start_all_to_all(received, message, group, phase)
            yield pending
            numel //= group.size
            if i + 1 < len(hops):
                residual, k_next = hops[i + 1][1], hops[i + 1][0].size
                message = new_messages(k_next, numel, widths[i + 1], block, x.device)
                if widths[i + 1] != widths[i]:  # another width: the sum, then a quantization at it
                    total = quantizer.dequantize_sum_records(received, group.size, widths[i], block)
                    self.encode(total, widths[i + 1], message, k_next, residual, residual_scale)
                    continue
                scaled = residual is not None and residual_scale != 1.0
                if scaled:  # the kernel works in the message's (scaled) units
                    residual.mul_(residual_scale)
                quantizer.reduce_requantize_records(received, group.size, widths[i], block, message, k_next,
                                                    residual=residual)
                if scaled:
                    residual.div_(residual_scale)
        total = quantizer.dequantize_sum_records(received, hops[-1][0].size, widths[-1], block)
        return quantizer.rotate(total, block) if self.rotate_gradients else total


def qgz_swizzle(x: torch.Tensor, nodes: int, ranks_per_node: int) -> torch.Tensor:
    """Reorder N = nodes x R chunks so piece l (for local rank l) holds chunks ``n*R + l`` for every
    node n: the first qgZ hop then leaves local rank l with its chunk of every node, in node order."""
    return x.view(nodes, ranks_per_node, -1).transpose(0, 1).reshape(-1)
