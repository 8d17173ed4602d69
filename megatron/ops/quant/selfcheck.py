"""Bit-for-bit comparison of an implementation against the torch reference, on hard cases.

Used by the tests (the C++ kernels in-process, the Triton kernels under TRITON_INTERPRET=1 in a
subprocess) and on real hardware:

    python -m megatron.ops.quant check --impl triton --device cuda

Every case is small (at most a few dozen blocks) so that the Triton interpreter stays fast. For
each case and bit width it compares, byte for byte: quantize's codes and scales, dequantize to
fp32/bf16/fp16, and the fused reduce_requantize and dequantize_sum over k chunks; and it checks
that NaN, +inf and -inf are refused, or, unchecked (``check_finite=False``, the engine's hot path),
carried: the bad block decodes to non-finite values only, the other blocks exactly as the
reference's, through quantize and through reduce_requantize.

`startup_check(impl, device, block)` is the short form for a run about to train: quantize, dequantize
and the fused reductions (3 and 48 chunks) of the kernels the run will use, at its block, on its
device; None, or one line that names what failed and the `zero_optimization.quantization_impl`
values that select other kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from .base import (DEFAULT_BLOCK, INPUT_DTYPES, QuantizationError, Quantizer, codes_dtype, interleaved_rows,
                   padded_numel, qmax, read_records, record_bytes)
from .reference import ReferenceQuantizer
from .select import get_quantizer


@dataclass(frozen=True)
class Case:
    """One input: `make(bits, generator)` returns a 1-D tensor whose size is a multiple of block."""
    name: str
    block: int
    make: Callable[[int, torch.Generator], Tensor]
    chunks: int = 3  # k for the fused reduction


def _random(dtype: torch.dtype, n: int) -> Callable[[int, torch.Generator], Tensor]:
    def make(bits: int, gen: torch.Generator) -> Tensor:
        x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).mul(8).exp2()
        return x.to(dtype)
    return make


def _zeros(bits: int, gen: torch.Generator) -> Tensor:
    return torch.zeros(padded_numel(200, 40))


def _constant_blocks(bits: int, gen: torch.Generator) -> Tensor:
    values = torch.tensor([3.0, -3.0, 1e-3, -7e5, 0.0, 1.0])
    return values.repeat_interleave(32)


def _ties(bits: int, gen: torch.Generator) -> Tensor:
    """Values exactly half a step apart: scale 2^-2, values (m + 1/2) / 4 round to even m."""
    limit = qmax(bits)
    halves = torch.arange(-limit, limit, dtype=torch.float32) + 0.5
    block = torch.cat([torch.tensor([limit * 0.25]), halves * 0.25])  # amax sets scale = 1/4
    block = torch.cat([block, torch.zeros((-block.numel()) % 64)])
    return block.repeat(2)


def _bf16_ties(bits: int, gen: torch.Generator) -> Tensor:
    """Scale 1 + 2^-8, so code * scale often lies exactly between two bf16 values."""
    limit = qmax(bits)
    codes = torch.arange(-limit, limit + 1, dtype=torch.float32)
    block = codes * (1 + 2.0 ** -8)
    return torch.cat([block, torch.zeros((-block.numel()) % 32)]).repeat(2)


def _dynamic_range(bits: int, gen: torch.Generator) -> Tensor:
    """Blocks from 1e-37 to 1e36, and blocks mixing one huge value with tiny ones."""
    exponents = torch.linspace(-37, 36, 16)
    blocks = torch.randn(16, 64, generator=gen) * (10.0 ** exponents)[:, None]
    blocks[::3, 0] = 3e38
    blocks[1::3, 5] = -1e-30
    return blocks.view(-1)


def _subnormal(bits: int, gen: torch.Generator) -> Tensor:
    """Blocks whose amax is subnormal (amax / qmax underflows or loses precision)."""
    tiny = torch.tensor([2.0 ** -149, 3 * 2.0 ** -149, 190 * 2.0 ** -149, 2.0 ** -130, 2.0 ** -126])
    blocks = torch.rand(5, 16, generator=gen) * 2 - 1
    return (blocks * tiny[:, None]).view(-1)


def _odd_size(bits: int, gen: torch.Generator) -> Tensor:
    """777 values padded to whole blocks of 96 for 3 shards (non-power-of-two block)."""
    x = torch.zeros(padded_numel(777, 96, 3))
    x[:777] = torch.randn(777, generator=gen)
    return x


CASES: tuple[Case, ...] = (
    Case("random_fp32", 64, _random(torch.float32, 1024)),
    Case("random_bf16", 64, _random(torch.bfloat16, 1024)),
    Case("random_fp16", 64, _random(torch.float16, 1024)),
    Case("odd_size_padded", 96, _odd_size),
    Case("zeros", 40, _zeros),
    Case("constant_blocks", 32, _constant_blocks),
    Case("ties", 64, _ties),
    Case("bf16_ties", 32, _bf16_ties),
    Case("dynamic_range", 64, _dynamic_range),
    Case("subnormal", 16, _subnormal),
    Case("block_2", 2, _random(torch.float32, 64), chunks=4),
    Case("block_4096", 4096, _random(torch.float32, 8192), chunks=2),
    # a reduction over 48 chunks (the cross-node hop of 48 Frontier nodes): the Triton kernels' runtime
    # loop over the chunks, several of its unrolled iterations; 2 blocks keep the interpreter fast
    Case("many_chunks", 2, _random(torch.float32, 4), chunks=48),
)


def _bitwise_mismatch(what: str, got: Tensor, want: Tensor) -> Optional[str]:
    """None if got and want are identical in dtype, shape and bytes; else a one-line reason."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    got_bytes = got.detach().cpu().contiguous().view(torch.uint8)
    want_bytes = want.detach().cpu().contiguous().view(torch.uint8)
    if torch.equal(got_bytes, want_bytes):
        return None
    width = got.element_size()
    first = int((got_bytes != want_bytes).nonzero()[0, 0]) // width
    return (f"{what}: differs at element {first}: got {got.flatten()[first].item()!r}, "
            f"want {want.flatten()[first].item()!r}")


def _refuses_non_finite(quantizer: Quantizer, x: Tensor, bits: int, block: int) -> Optional[str]:
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[min(block + 1, y.numel() - 1)] = bad
        try:
            quantizer.quantize(y, bits, block)
        except QuantizationError:
            continue
        return f"quantize accepted {bad} without raising"
    return None


def _carries_non_finite(quantizer: Quantizer, x: Tensor, k_inputs: list[Tensor], bits: int, block: int
                        ) -> Optional[str]:
    """Unchecked, a NaN/inf block must come out non-finite (its scale marks it) and no other block
    may change: in quantize, and in reduce_requantize when one chunk brings the bad block."""
    reference = ReferenceQuantizer()
    spot = min(block + 1, x.numel() - 1)
    bad_block = slice(spot // block * block, (spot // block + 1) * block)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[spot] = bad
        codes, scales = quantizer.quantize(y, bits, block, check_finite=False)
        decoded = reference.dequantize(codes, scales, bits, block)
        want = reference.dequantize(*reference.quantize(y, bits, block, check_finite=False), bits, block)
        if torch.isfinite(decoded[bad_block]).any():
            return f"quantize(check_finite=False) of {bad}: its block decodes to finite values"
        decoded[bad_block] = want[bad_block] = 0.0
        mismatch = _bitwise_mismatch(f"quantize(check_finite=False) of {bad}, other blocks", decoded, want)
        if mismatch:
            return mismatch
        chunks = [reference.quantize(t, bits, block, check_finite=False) for t in [y.to(k_inputs[0].dtype),
                                                                                 *k_inputs[1:]]]
        codes_k, scales_k = torch.cat([c for c, _ in chunks]), torch.cat([s for _, s in chunks])
        got = quantizer.reduce_requantize(codes_k, scales_k, len(chunks), bits, block, check_finite=False)
        if torch.isfinite(reference.dequantize(*got, bits, block)[bad_block]).any():
            return f"reduce_requantize(check_finite=False) with {bad}: its block decodes to finite values"
    return None


def _inputs(case: Case, bits: int, device: torch.device) -> tuple[Tensor, list[Tensor]]:
    """The case's input x and its `chunks` inputs of the fused reduction, on `device`."""
    gen = torch.Generator().manual_seed(1234 + bits)
    x = case.make(bits, gen)
    # alternating signs: partial sums cancel instead of overflowing in the dynamic-range case
    k_inputs = [case.make(bits, gen).to(torch.float32) * (-1) ** j for j in range(case.chunks)]
    return x.to(device), [t.to(device) for t in k_inputs]


def _kernel_mismatches(quantizer: Quantizer, x: Tensor, k_inputs: list[Tensor], bits: int,
                       block: int) -> list[Optional[str]]:
    """quantize, dequantize to each dtype, and the fused reductions over len(k_inputs) chunks."""
    reference = ReferenceQuantizer()
    problems: list[Optional[str]] = []

    codes, scales = quantizer.quantize(x, bits, block)
    ref_codes, ref_scales = reference.quantize(x, bits, block)
    problems.append(_bitwise_mismatch("quantize codes", codes, ref_codes))
    problems.append(_bitwise_mismatch("quantize scales", scales, ref_scales))
    for dtype in INPUT_DTYPES:
        problems.append(_bitwise_mismatch(
            f"dequantize to {dtype}", quantizer.dequantize(ref_codes, ref_scales, bits, block,
                                                           dtype=dtype),
            reference.dequantize(ref_codes, ref_scales, bits, block, dtype=dtype)))

    encoded = [reference.quantize(t, bits, block) for t in k_inputs]
    codes_k = torch.cat([c for c, _ in encoded])
    scales_k = torch.cat([s for _, s in encoded])
    k = len(k_inputs)
    got = quantizer.reduce_requantize(codes_k, scales_k, k, bits, block)
    want = reference.reduce_requantize(codes_k, scales_k, k, bits, block)
    problems.append(_bitwise_mismatch("reduce_requantize codes", got[0], want[0]))
    problems.append(_bitwise_mismatch("reduce_requantize scales", got[1], want[1]))
    # error feedback in the fused pass: a residual of the size of one chunk, updated in place
    chunk_codes, chunk_blocks = codes_k.numel() // k, scales_k.numel() // k
    residual = -0.3 * reference.dequantize(codes_k[-chunk_codes:], scales_k[-chunk_blocks:], bits,
                                           block)
    got_residual, want_residual = residual.clone(), residual.clone()
    got = quantizer.reduce_requantize(codes_k, scales_k, k, bits, block, residual=got_residual)
    want = reference.reduce_requantize(codes_k, scales_k, k, bits, block, residual=want_residual)
    problems.append(_bitwise_mismatch("reduce_requantize+residual codes", got[0], want[0]))
    problems.append(_bitwise_mismatch("reduce_requantize+residual scales", got[1], want[1]))
    problems.append(_bitwise_mismatch("residual after reduce_requantize", got_residual,
                                      want_residual))
    problems.append(_bitwise_mismatch(
        "dequantize_sum", quantizer.dequantize_sum(codes_k, scales_k, k, bits, block),
        reference.dequantize_sum(codes_k, scales_k, k, bits, block)))
    return problems + _rows_mismatches(quantizer, x, k_inputs, bits, block) + _records_mismatches(
        quantizer, x, k_inputs, bits, block)


def _records(values: int, rows: int, bits: int, block: int, device: torch.device
             ) -> Optional[tuple[Tensor, Tensor]]:
    """Rows of a new interleaved buffer (each row's codes, then its scales; base.interleaved_rows)
    holding ``values`` values as ``rows`` rows, its bytes set to a pattern the kernels must overwrite;
    None where the layout cannot be viewed in place."""
    buf = torch.full((rows * record_bytes(values // rows, bits, block),), 0xA5, dtype=torch.uint8,
                     device=device)
    return interleaved_rows(buf, rows, bits, block)


def _most_rows(blocks: int) -> int:
    """Rows for a layout of ``blocks`` blocks: 3 or 2 where they divide it (rows at a stride)."""
    return next(rows for rows in (3, 2, 1) if blocks % rows == 0)


def _rows_mismatches(quantizer: Quantizer, x: Tensor, k_inputs: list[Tensor], bits: int, block: int
                     ) -> list[Optional[str]]:
    """The kernels reading and writing interleaved rows in place (the engine's messages), against
    the reference on flat tensors: quantize into rows, dequantize from them, the fused reductions
    from k rows into rows."""
    reference = ReferenceQuantizer()
    rows = _most_rows(x.numel() // block)
    out = _records(x.numel(), rows, bits, block, x.device)
    encoded = [reference.quantize(t, bits, block) for t in k_inputs]
    k = len(k_inputs)
    received = _records(k * k_inputs[0].numel(), k, bits, block, x.device)
    if out is None or received is None:
        return []  # records not viewable in place (odd tiny blocks): the engine copies there
    problems: list[Optional[str]] = []
    quantizer.quantize(x, bits, block, out=out)
    want_codes, want_scales = reference.quantize(x, bits, block)
    problems.append(_bitwise_mismatch("quantize into rows, codes", out[0].reshape(-1), want_codes))
    problems.append(_bitwise_mismatch("quantize into rows, scales", out[1].reshape(-1), want_scales))
    for dtype in (torch.float32, torch.bfloat16):
        got = torch.empty(x.numel(), dtype=dtype, device=x.device)
        quantizer.dequantize(*out, bits, block, out=got)
        problems.append(_bitwise_mismatch(f"dequantize rows to {dtype}", got,
                                          reference.dequantize(want_codes, want_scales, bits, block, dtype=dtype)))
    for j, (codes, scales) in enumerate(encoded):
        received[0][j].copy_(codes)
        received[1][j].copy_(scales)
    codes_k = torch.cat([c for c, _ in encoded])
    scales_k = torch.cat([s for _, s in encoded])
    chunk = k_inputs[0].numel()
    for residual in (None, -0.3 * reference.dequantize(*encoded[-1], bits, block)):
        into = _records(chunk, _most_rows(chunk // block), bits, block, x.device)
        got_residual = None if residual is None else residual.clone()
        want_residual = None if residual is None else residual.clone()
        quantizer.reduce_requantize(*received, k, bits, block, residual=got_residual, out=into)
        want = reference.reduce_requantize(codes_k, scales_k, k, bits, block, residual=want_residual)
        what = "reduce_requantize rows" + ("" if residual is None else "+residual")
        problems.append(_bitwise_mismatch(f"{what} codes", into[0].reshape(-1), want[0]))
        problems.append(_bitwise_mismatch(f"{what} scales", into[1].reshape(-1), want[1]))
        if residual is not None:
            problems.append(_bitwise_mismatch(f"{what}, residual", got_residual, want_residual))
    problems.append(_bitwise_mismatch("dequantize_sum rows", quantizer.dequantize_sum(*received, k, bits, block),
                                      reference.dequantize_sum(codes_k, scales_k, k, bits, block)))
    return problems


def _records_mismatches(quantizer: Quantizer, x: Tensor, k_inputs: list[Tensor], bits: int, block: int
                        ) -> list[Optional[str]]:
    """The records forms (the engine's: a message buffer and its record count) against the reference on
    flat tensors, every layout (those whose scales cannot be viewed in place go through copies)."""
    reference = ReferenceQuantizer()
    rows, k, chunk = _most_rows(x.numel() // block), len(k_inputs), k_inputs[0].numel()

    def buffer(values: int, records: int) -> Tensor:  # a pattern the kernels must overwrite
        return torch.full((records * record_bytes(values // records, bits, block),), -91, dtype=codes_dtype(bits),
                          device=x.device)

    problems: list[Optional[str]] = []
    sent = quantizer.quantize_records(x, buffer(x.numel(), rows), rows, bits, block)
    want_codes, want_scales = reference.quantize(x, bits, block)
    codes, scales = read_records(sent, rows, bits, block)
    problems.append(_bitwise_mismatch("quantize_records codes", codes.reshape(-1), want_codes))
    problems.append(_bitwise_mismatch("quantize_records scales", scales.reshape(-1), want_scales))
    got = quantizer.dequantize_records(sent, rows, bits, block, torch.empty(x.numel(), dtype=torch.bfloat16,
                                                                            device=x.device))
    problems.append(_bitwise_mismatch("dequantize_records", got, reference.dequantize(
        want_codes, want_scales, bits, block, dtype=torch.bfloat16)))
    received = reference.quantize_records(torch.cat(k_inputs), buffer(k * chunk, k), k,
                                          bits, block)
    codes_k, scales_k = (t.reshape(-1) for t in read_records(received, k, bits, block))
    problems.append(_bitwise_mismatch("dequantize_sum_records", quantizer.dequantize_sum_records(received, k, bits, block),
                                      reference.dequantize_sum(codes_k, scales_k, k, bits, block)))
    k_out = _most_rows(chunk // block)
    for residual in (None, -0.3 * reference.dequantize(codes_k[-codes_k.numel() // k:], scales_k[-scales_k.numel() // k:],
                                                       bits, block)):
        got_residual = None if residual is None else residual.clone()
        want_residual = None if residual is None else residual.clone()
        into = quantizer.reduce_requantize_records(received, k, bits, block, buffer(chunk, k_out), k_out,
                                                   residual=got_residual)
        want = reference.reduce_requantize(codes_k, scales_k, k, bits, block, residual=want_residual)
        codes, scales = read_records(into, k_out, bits, block)
        what = "reduce_requantize_records" + ("" if residual is None else "+residual")
        problems.append(_bitwise_mismatch(f"{what} codes", codes.reshape(-1), want[0]))
        problems.append(_bitwise_mismatch(f"{what} scales", scales.reshape(-1), want[1]))
        if residual is not None:
            problems.append(_bitwise_mismatch(f"{what}, residual", got_residual, want_residual))
    return problems


def check_kernels(quantizer: Quantizer, case: Case, bits: int, device: torch.device) -> list[str]:
    """The mismatches of quantize, dequantize and the fused reductions alone on one case (empty:
    bit-exact): `check_case` without the NaN/inf and rotation checks. For the start-up check, and
    for reductions over so many chunks that the whole case would cost the Triton interpreter minutes."""
    x, k_inputs = _inputs(case, bits, device)
    return [p for p in _kernel_mismatches(quantizer, x, k_inputs, bits, case.block) if p is not None]


def check_case(quantizer: Quantizer, case: Case, bits: int, device: torch.device) -> list[str]:
    """All mismatches of `quantizer` against the reference on one case (empty: bit-exact)."""
    x, k_inputs = _inputs(case, bits, device)
    block = case.block
    problems = _kernel_mismatches(quantizer, x, k_inputs, bits, block)
    problems.append(_refuses_non_finite(quantizer, x, bits, block))
    problems.append(_carries_non_finite(quantizer, x, k_inputs, bits, block))
    if block & (block - 1) == 0:  # the Hadamard rotation of gradient blocks (power-of-two blocks only)
        xf = x.to(torch.float32)
        problems.append(_bitwise_mismatch("rotate", quantizer.rotate(xf, block),
                                          ReferenceQuantizer().rotate(xf, block)))
    return [p for p in problems if p is not None]


def check_all(quantizer: Quantizer, device: torch.device,
              names: Optional[list[str]] = None) -> dict[str, list[str]]:
    """{"<case>/int<bits>": mismatches} for every case (or the named ones) and both bit widths."""
    results = {}
    for case in CASES:
        if names and case.name not in names:
            continue
        for bits in (8, 4):
            try:
                results[f"{case.name}/int{bits}"] = check_case(quantizer, case, bits, device)
            except Exception as exc:  # report, do not stop: one broken case should not hide others
                results[f"{case.name}/int{bits}"] = [f"raised {type(exc).__name__}: {exc}"]
    return results


def startup_check(impl: str, device: Union[str, torch.device],
                  block: int = DEFAULT_BLOCK) -> Optional[str]:
    """Check, before training, the kernels a run will use: None when they agree with the reference.

    Runs `check_kernels` (quantize, dequantize, and the fused reductions with and without a residual)
    of `get_quantizer(impl, device)` on two small random cases at the run's `block`, INT8 and INT4
    (INT8 only for an odd block): 3 chunks, and 48 (the cross-node hop of 48 Frontier nodes). On a
    GPU this also compiles the Triton kernels at the run's block, so a compile failure shows here
    rather than inside the first backward. Returns one line naming the implementation, the first
    case that failed and why (a mismatch, or the exception's type and the first line of its
    message), and the `zero_optimization.quantization_impl` values that select other kernels.
    Prints nothing and raises nothing.
    """
    cases = (Case("bf16_3_chunks", block, _random(torch.bfloat16, 4 * block), chunks=3),
             Case("fp32_48_chunks", block, _random(torch.float32, 2 * block), chunks=48))
    try:
        device = torch.device(device)
        quantizer = get_quantizer(impl, device)
    except Exception as exc:  # an unknown impl or device, or kernels that cannot run on this device
        return _startup_failure(impl, impl, device, f"choosing the kernels raised {_one_line(exc)}")
    for case in cases:
        for bits in (8, 4) if block % 2 == 0 else (8,):
            try:
                problems = check_kernels(quantizer, case, bits, device)
            except Exception as exc:  # a compile error, a missing driver: the run would die the same way
                return _startup_failure(impl, quantizer.name, device,
                                        f"{case.name}/int{bits} raised {_one_line(exc)}")
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                return _startup_failure(impl, quantizer.name, device,
                                        f"{case.name}/int{bits}: {problems[0]}{more}")
    return None


def _one_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _startup_failure(impl: str, name: str, device: Union[str, torch.device], what: str) -> str:
    shown = repr(impl) if name == impl else f"{impl!r} ({name})"
    # what runs on this kind of device (triton on a CPU only under the interpreter, for tests)
    runs_here = ("reference", "cpp") if str(device).startswith("cpu") else ("reference", "triton")
    others = [other for other in runs_here if other != name]
    return (f"quantization kernels {shown} on {device} failed their start-up check against the torch "
            f"reference: {what}; set zero_optimization.quantization_impl to {' or '.join(others)} "
            f"to use other kernels")
