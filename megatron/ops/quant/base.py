"""The block-quantization format and the interface every implementation follows.

Format (identical in every implementation, checked bit for bit against `reference.py`):
- a flat buffer of n elements is cut into blocks of `block` consecutive elements; n must be a
  multiple of `block` (callers pad with `padded_numel`, so no block straddles a shard);
- each block has one fp32 scale `amax / qmax` (IEEE division), where amax is the largest |x| in the
  block and qmax is 127 (INT8) or 7 (INT4); a scale of 0 (amax = 0, or an amax so small that the
  division underflows) is replaced by 1;
- code = clamp(round_half_even(x / scale), -qmax, qmax), x / scale again by IEEE division in fp32;
- INT8 codes are int8, one per element; INT4 codes are 4-bit two's complement packed two per uint8
  byte, the even-index element in the low nibble (so `block` must be even for INT4);
- dequantized value = code * scale in fp32, then cast to the requested dtype;
- a block whose amax is NaN or inf is refused with `QuantizationError`, never encoded; or, for a
  caller that asks not to be stopped (``check_finite=False``: no host synchronisation), encoded with
  its NaN/inf scale, which marks it: it decodes to NaN/inf, whatever its codes.

Rotation (``rotate``, for ``zero_quantized_gradients_rotation: hadamard``): each block of b
elements (b a power of two) is multiplied by the orthonormal Walsh-Hadamard matrix H_b / sqrt(b),
which spreads an outlier over the whole block before the block's scale is taken. Computed the same
way everywhere, so every implementation gives the same bits: log2(b) butterfly stages, stage s
pairing elements i and i + 2^s inside each group of 2^(s+1) as (u, v) -> (u + v, u - v) in fp32,
stages in increasing s, then one multiply by the fp32 constant ``rotation_scale(b)``. The matrix
is its own inverse, so rotating twice gives back the input up to fp32 rounding.

`Quantizer` validates arguments once, here, and leaves the arithmetic to its subclasses.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Elements per block unless configured otherwise; chosen by `bench/quant_kernels.py`, see
# docs/quantization.md for the numbers.
DEFAULT_BLOCK = 2048


class QuantizationError(ValueError):
    """A misuse of the quantization kernels (bad size, dtype, bits) or non-finite input: one line
    saying what is wrong."""


def qmax(bits: int) -> int:
    """Largest code magnitude for `bits`: 127 for INT8, 7 for INT4 (symmetric, -qmax..qmax)."""
    if bits == 8:
        return 127
    if bits == 4:
        return 7
    raise QuantizationError(f"bits must be 8 or 4, got {bits!r}")


def codes_dtype(bits: int) -> torch.dtype:
    """int8 for INT8 codes; uint8 for packed INT4 bytes."""
    qmax(bits)
    return torch.int8 if bits == 8 else torch.uint8


def codes_numel(numel: int, bits: int) -> int:
    """Number of code entries (int8 elements or uint8 bytes) that encode `numel` values."""
    qmax(bits)
    return numel if bits == 8 else numel // 2


def padded_numel(n: int, block: int, multiple: int = 1) -> int:
    """Smallest m >= n that is a multiple of `block * multiple`.

    Pass the number of shards as `multiple` (e.g. os, or the all-to-all group size) so that every
    shard holds whole blocks. With an even `block` (required for INT4) m is even, so INT4 shards
    also hold whole bytes.
    """
    if n < 0 or block < 1 or multiple < 1:
        raise QuantizationError(
            f"padded_numel needs n >= 0, block >= 1, multiple >= 1; got n={n}, block={block}, "
            f"multiple={multiple}")
    unit = block * multiple
    return -(-n // unit) * unit


def check_rotation_block(block: int) -> None:
    """A rotation block must be a power of two of at least 2 elements."""
    if not isinstance(block, int) or block < 2 or block & (block - 1):
        raise QuantizationError(f"a Hadamard rotation needs a power-of-two block >= 2, got {block!r}")


def rotation_scale(block: int) -> float:
    """fp32(1 / sqrt(block)): exact for blocks that are powers of four."""
    return float(torch.tensor(block, dtype=torch.float64).rsqrt().to(torch.float32))


def check_block(bits: int, block: int) -> None:
    """Refuse a block size the format cannot use."""
    qmax(bits)
    if not isinstance(block, int) or block < 1:
        raise QuantizationError(f"block must be a positive int, got {block!r}")
    if bits == 4 and block % 2:
        raise QuantizationError(f"INT4 packs two codes per byte, so block must be even, got {block}")


def _check_flat(t: Tensor, name: str) -> None:
    if not isinstance(t, Tensor):
        raise QuantizationError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or not t.is_contiguous():
        raise QuantizationError(
            f"{name} must be a contiguous 1-D tensor (flatten it first), got shape {tuple(t.shape)}")


def _check_numel(numel: int, block: int, what: str) -> None:
    if numel % block:
        raise QuantizationError(
            f"{what}: {numel} elements is not a multiple of block={block}; pad the buffer to "
            f"padded_numel(n, block, multiple) first")


def as_rows(t: Tensor, name: str, rows: int) -> Tensor:
    """``t`` seen as ``rows`` rows: a contiguous 1-D tensor is viewed so; a 2-D one (each row
    contiguous, rows at any stride: e.g. the codes or the scales of k messages inside one buffer)
    must have that many rows."""
    if not isinstance(t, Tensor):
        raise QuantizationError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 1 and t.is_contiguous():
        if rows < 1 or t.numel() % rows:
            raise QuantizationError(f"cannot split {t.numel()} {name} into k={rows} chunks")
        return t.view(rows, -1)
    if t.dim() == 2 and t.shape[0] == rows and (t.stride(1) == 1 or t.shape[1] < 2):
        return t
    raise QuantizationError(f"{name} must be a contiguous 1-D tensor (flatten it first), or {rows} rows each "
                            f"contiguous; got shape "
                            f"{tuple(t.shape)}, strides {t.stride()}")


def _check_codes(codes: Tensor, scales: Tensor, bits: int, block: int, rows: int
                 ) -> tuple[Tensor, Tensor, int]:
    """Validate encoded data as ``rows`` rows (chunks, or messages); returns (codes rows, scales rows,
    values per row)."""
    codes, scales = as_rows(codes, "codes", rows), as_rows(scales, "scales", rows)
    want = codes_dtype(bits)
    if codes.dtype != want:
        raise QuantizationError(f"INT{bits} codes must be {want}, got {codes.dtype}")
    if scales.dtype != torch.float32:
        raise QuantizationError(f"scales must be float32, got {scales.dtype}")
    if codes.device != scales.device:
        raise QuantizationError(f"codes on {codes.device} but scales on {scales.device}")
    per_row = codes.shape[1] * (1 if bits == 8 else 2)
    if per_row != scales.shape[1] * block:
        raise QuantizationError(
            f"{codes.numel()} INT{bits} codes and {scales.numel()} scales do not form k={rows} "
            f"chunks of whole blocks of {block}")
    return codes, scales, per_row


def _rows_of(t: Tensor) -> int:
    return t.shape[0] if t.dim() == 2 else 1


def _new_rows(rows: int, per_row: int, bits: int, block: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """New (codes, scales) rows for ``rows`` rows of ``per_row`` values (the records forms' copies)."""
    return (torch.empty(rows, codes_numel(per_row, bits), dtype=codes_dtype(bits), device=device),
            torch.empty(rows, per_row // block, dtype=torch.float32, device=device))


def _check_out_codes(out, numel: int, bits: int, block: int, device: torch.device
                     ) -> tuple[Tensor, Tensor]:
    """``out`` = (codes, scales) to write ``numel`` values' encoding into (1-D, or rows of a
    message layout), or None: new 1-D tensors."""
    if out is None:
        return _new_rows(1, numel, bits, block, device)
    codes, scales = out
    codes, scales, per_row = _check_codes(codes, scales, bits, block, _rows_of(codes))
    if per_row * codes.shape[0] != numel or codes.device != device:
        raise QuantizationError(f"out holds {per_row * codes.shape[0]} INT{bits} values on "
                                f"{codes.device}; {numel} on {device} are encoded")
    return codes, scales


def _check_out_values(out: Optional[Tensor], numel: int, dtype: torch.dtype, device: torch.device
                      ) -> Tensor:
    """A flat contiguous ``out`` of ``numel`` values of ``dtype``, or a new one."""
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    _check_flat(out, "out")
    if out.numel() != numel or out.dtype != dtype or out.device != device:
        raise QuantizationError(f"out must hold {numel} {dtype} values on {device}; got {out.numel()} "
                                f"{out.dtype} on {out.device}")
    return out


def _check_residual(residual: Optional[Tensor], per_chunk: int, device: torch.device) -> None:
    """An error-feedback residual (or None): flat fp32 of one chunk, on the data's device."""
    if residual is None:
        return
    _check_flat(residual, "residual")
    if residual.dtype != torch.float32 or residual.numel() != per_chunk or residual.device != device:
        raise QuantizationError(f"residual must be float32 with {per_chunk} elements on {device}; got "
                                f"{residual.dtype} with {residual.numel()} on {residual.device}")


def _returned(t: Tensor, given) -> Tensor:
    """What a call returns for an output it allocated (flat) or was given (as given)."""
    return t.view(-1) if given is None else t


def record_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes of one record of ``interleaved_rows``: ``numel`` values' codes then their fp32 scales."""
    return codes_numel(numel, bits) + 4 * (numel // block)


@functools.lru_cache(maxsize=None)
def record_numel(size: int, bits: int, block: int) -> int:
    """Values encoded by a record of ``size`` bytes (the inverse of ``record_bytes``; cached: the
    engine asks per hop, for few distinct sizes)."""
    per_block = record_bytes(block, bits, block)
    if size % per_block:
        raise QuantizationError(f"a record of {size} bytes is not whole INT{bits} blocks of {block}")
    return size // per_block * block


@functools.lru_cache(maxsize=None)
def record_geometry(nbytes: int, rows: int, bits: int, block: int) -> tuple[int, bool]:
    """(code bytes of a record, whether its scales can be viewed as fp32) for ``rows`` equal records
    in ``nbytes`` bytes (cached: the engine asks per message, for few distinct sizes). Not viewable:
    a record or its codes not a multiple of 4 bytes (e.g. INT4 with an odd number of blocks of 2)."""
    if rows < 1 or nbytes % rows:
        raise QuantizationError(f"{nbytes} bytes are not {rows} equal records")
    size = nbytes // rows
    code_bytes = codes_numel(record_numel(size, bits, block), bits)
    return code_bytes, size % 4 == 0 and code_bytes % 4 == 0


def _check_records(buf: Tensor, rows: int, bits: int, block: int) -> tuple[int, bool]:
    """``record_geometry`` of a buffer of records, which must be a contiguous 1-D byte tensor; viewable
    only where the buffer's first byte is 4-byte aligned too."""
    if not isinstance(buf, Tensor) or buf.element_size() != 1 or buf.dim() != 1 or not buf.is_contiguous():
        raise QuantizationError(f"records must be a contiguous 1-D byte buffer of {rows} equal records")
    code_bytes, viewable = record_geometry(buf.numel(), rows, bits, block)
    return code_bytes, viewable and buf.storage_offset() % 4 == 0


def interleaved_rows(buf: Tensor, rows: int, bits: int, block: int) -> Optional[tuple[Tensor, Tensor]]:
    """A flat byte buffer (uint8, or int8) of ``rows`` equal records, each a row's codes followed by
    its fp32 scales (the engine's messages), as (codes rows, scales rows): views the kernels read and
    write in place. None when the scales cannot be viewed as fp32 (``record_geometry``); the caller
    then copies (``record_copies``)."""
    code_bytes, viewable = _check_records(buf, rows, bits, block)
    return _record_views(buf, rows, code_bytes, bits) if viewable else None


def record_copies(buf: Tensor, rows: int, bits: int, block: int) -> tuple[Tensor, Tensor]:
    """The (codes, scales) rows of ``rows`` records as copies (any layout, ``interleaved_rows``'
    None included)."""
    code_bytes, _ = _check_records(buf, rows, bits, block)
    return _record_copies(buf, rows, code_bytes, bits)


def _record_views(buf: Tensor, rows: int, code_bytes: int, bits: int) -> tuple[Tensor, Tensor]:
    """``interleaved_rows`` of a buffer already checked (its scales on 4-byte bounds)."""
    size = buf.numel() // rows
    want = torch.int8 if bits == 8 else torch.uint8
    codes = (buf if buf.dtype == want else buf.view(want)).as_strided((rows, code_bytes), (size, 1))
    as_floats = buf.view(torch.float32)
    scales = as_floats.as_strided((rows, (size - code_bytes) // 4), (size // 4, 1),
                                  as_floats.storage_offset() + code_bytes // 4)
    return codes, scales


def _record_copies(buf: Tensor, rows: int, code_bytes: int, bits: int) -> tuple[Tensor, Tensor]:
    """``record_copies`` of a buffer already checked."""
    records = buf.view(torch.uint8).view(rows, -1)
    dense = torch.contiguous_format  # strides (n, 1) even for one row (a plain clone keeps the record's)
    return (records[:, :code_bytes].clone(memory_format=dense).view(codes_dtype(bits)),
            records[:, code_bytes:].clone(memory_format=dense).view(torch.float32))


def _checked_record_rows(buf: Tensor, rows: int, bits: int, block: int, viewable: bool) -> tuple[Tensor, Tensor]:
    """The rows of records a public records method has checked (``viewable`` from it): views, or
    copies; not checked again (the hooks run per message)."""
    code_bytes = record_geometry(buf.numel(), rows, bits, block)[0]
    return (_record_views if viewable else _record_copies)(buf, rows, code_bytes, bits)


def write_records(buf: Tensor, codes: Tensor, scales: Tensor) -> None:
    """Rows (codes, scales) copied into the records of ``buf`` (the inverse of ``record_copies``)."""
    rows = codes.shape[0] if codes.dim() == 2 else 1
    buf.view(torch.uint8).view(rows, -1).copy_(
        torch.cat([codes.reshape(rows, -1).view(torch.uint8), scales.reshape(rows, -1).view(torch.uint8)], dim=1))


def read_records(buf: Tensor, rows: int, bits: int, block: int) -> tuple[Tensor, Tensor]:
    """The (codes, scales) rows of ``rows`` records to read: views, or copies (``record_copies``)."""
    views = interleaved_rows(buf, rows, bits, block)
    return views if views is not None else record_copies(buf, rows, bits, block)


def check_finite_scales(scales: Tensor, block: int, what: str) -> None:
    """Raise if any block's scale is NaN or inf, which happens exactly when its amax is.

    One reduction over n / block scales; on a GPU this is one host synchronisation per call.
    """
    finite = torch.isfinite(scales)
    if not bool(finite.all()):
        first = int((~finite).nonzero()[0, 0])
        raise QuantizationError(
            f"{what}: NaN or inf in block {first} (elements {first * block}..{(first + 1) * block - 1});"
            f" refusing to encode it")


class Quantizer:
    """Block quantization: quantize, dequantize and the fused k-chunk reduction.

    Subclasses implement the underscore methods on already validated, contiguous 1-D arguments;
    they must write a NaN/inf scale for a block whose amax is NaN/inf (the check is done here).
    """

    name = "abstract"

    # -- public API ---------------------------------------------------------------------------
    # Encoded data (codes, scales) is 1-D and contiguous, or given as rows: 2-D views whose rows are
    # contiguous and may lie at any stride, e.g. k messages of one buffer, each its chunk's codes
    # then its scales (megatron/engine/quantized.py). The kernels read such rows in place and write
    # into them (``out``), so a message is never packed or unpacked by a copy.

    def quantize(self, x: Tensor, bits: int, block: int, check_finite: bool = True,
                 out: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor]:
        """Encode x (fp32/bf16/fp16, n a multiple of block) -> (codes, fp32 scales of n / block);
        into ``out`` = (codes, scales) when given (1-D, or rows: block i of x goes to row
        i // (blocks per row)), which is returned.

        ``check_finite``: refuse a NaN/inf block (one host sync on a GPU). Off, the block keeps its
        NaN/inf scale (module docstring) and nothing waits for the device: the engine's hot path,
        where a non-finite gradient reaches the global norm through that scale and skips the step."""
        check_block(bits, block)
        _check_flat(x, "x")
        if x.dtype not in INPUT_DTYPES:
            raise QuantizationError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
        _check_numel(x.numel(), block, "quantize")
        codes, scales = _check_out_codes(out, x.numel(), bits, block, x.device)
        self._quantize(x, bits, block, codes, scales)
        if check_finite:
            check_finite_scales(scales.reshape(-1), block, "quantize")
        return _returned(codes, out), _returned(scales, out)

    def dequantize(self, codes: Tensor, scales: Tensor, bits: int, block: int,
                   numel: Optional[int] = None, dtype: torch.dtype = torch.float32,
                   out: Optional[Tensor] = None) -> Tensor:
        """Decode to `dtype` (every row in order); `numel` (default: all) keeps only the first numel
        values (unpadding); into ``out`` (flat, contiguous, all the values; its dtype) when given."""
        check_block(bits, block)
        codes, scales, per_row = _check_codes(codes, scales, bits, block, _rows_of(codes))
        total = per_row * codes.shape[0]
        dtype = dtype if out is None else out.dtype
        if dtype not in INPUT_DTYPES:
            raise QuantizationError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        if numel is not None and not 0 <= numel <= total:
            raise QuantizationError(f"numel={numel} but the codes hold {total} values")
        result = _check_out_values(out, total, dtype, codes.device)
        self._dequantize(codes, scales, bits, block, result)
        return result if numel is None or numel == total else result[:numel]

    def reduce_requantize(self, codes_k: Tensor, scales_k: Tensor, k: int, bits: int,
                          block: int, residual: Optional[Tensor] = None,
                          check_finite: bool = True,
                          out: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor]:
        """Fused: dequantize k chunks (1-D concatenated, or k rows), sum them in fp32 (chunk 0
        first), quantize (into ``out`` when given, as ``quantize``'s).

        This is the local step of an all-to-all reduction: codes_k/scales_k are what arrived from
        the k peers, the result is one chunk (codes, scales) ready for the next hop.

        With `residual` (fp32, one chunk long; error feedback for this hop) the sum plus the
        residual is quantized and the residual is overwritten, in the same pass, with what that
        quantization lost: exactly adding the residual, quantizing, and keeping the difference, on the
        unfused sum (tests/quant_oracles.py states that unfused form).
        """
        check_block(bits, block)
        codes_k, scales_k, per_chunk = _check_codes(codes_k, scales_k, bits, block, k)
        _check_residual(residual, per_chunk, codes_k.device)
        codes, scales = _check_out_codes(out, per_chunk, bits, block, codes_k.device)
        self._reduce_requantize(codes_k, scales_k, bits, block, residual, codes, scales)
        if check_finite:  # as quantize's
            check_finite_scales(scales.reshape(-1), block, "reduce_requantize")
        return _returned(codes, out), _returned(scales, out)

    def dequantize_sum(self, codes_k: Tensor, scales_k: Tensor, k: int, bits: int,
                       block: int) -> Tensor:
        """Fused: dequantize k chunks (1-D concatenated, or k rows) and sum them in fp32 (the last
        hop's step)."""
        check_block(bits, block)
        codes_k, scales_k, per_chunk = _check_codes(codes_k, scales_k, bits, block, k)
        out = torch.empty(per_chunk, dtype=torch.float32, device=codes_k.device)
        self._dequantize_sum(codes_k, scales_k, bits, block, out)
        return out

    def rotate(self, x: Tensor, block: int) -> Tensor:
        """The blockwise orthonormal Walsh-Hadamard transform of fp32 ``x`` (module docstring); a new
        fp32 tensor. Its own inverse: ``rotate(rotate(x))`` is ``x`` up to fp32 rounding."""
        check_rotation_block(block)
        _check_flat(x, "x")
        if x.dtype != torch.float32:
            raise QuantizationError(f"rotate takes float32, got {x.dtype}")
        _check_numel(x.numel(), block, "rotate")
        return self._rotate(x, block)

    # -- records: k messages of one byte buffer ----------------------------------------------
    # The engine's messages: k records of one contiguous byte buffer, each a chunk's codes then its
    # fp32 scales (``record_bytes``). The same arithmetic as the forms above; the buffer is read
    # and written in place (views made here, or by an implementation none at all: the C++ kernels
    # take the buffer and its geometry), copies only where the scales cannot be viewed as fp32.

    def quantize_records(self, x: Tensor, buf: Tensor, k: int, bits: int, block: int) -> Tensor:
        """Encode ``x`` as the k records of ``buf`` (chunk i of x into record i), no finiteness check
        (a NaN/inf block keeps its NaN/inf scale); returns ``buf``."""
        check_block(bits, block)
        _check_flat(x, "x")
        if x.dtype not in INPUT_DTYPES:
            raise QuantizationError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
        code_bytes, viewable = _check_records(buf, k, bits, block)
        if x.numel() != k * record_numel(buf.numel() // k, bits, block) or x.device != buf.device:
            raise QuantizationError(f"{x.numel()} values on {x.device} do not fill {k} records of "
                                    f"{buf.numel() // k} bytes on {buf.device}")
        self._quantize_records(x, buf, k, bits, block, viewable)
        return buf

    def dequantize_records(self, buf: Tensor, k: int, bits: int, block: int, out: Tensor) -> Tensor:
        """Decode the k records of ``buf``, in order, into the flat ``out`` (its dtype); returns it."""
        check_block(bits, block)
        _code_bytes, viewable = _check_records(buf, k, bits, block)
        if out.dtype not in INPUT_DTYPES:
            raise QuantizationError(f"out must be float32, bfloat16 or float16, got {out.dtype}")
        _check_out_values(out, k * record_numel(buf.numel() // k, bits, block), out.dtype, buf.device)
        self._dequantize_records(buf, k, bits, block, viewable, out)
        return out

    def reduce_requantize_records(self, buf_k: Tensor, k: int, bits: int, block: int, buf: Tensor,
                                  k_out: int = 1, residual: Optional[Tensor] = None) -> Tensor:
        """``reduce_requantize`` from the k records of ``buf_k`` into the ``k_out`` records of ``buf``
        (same width: the next hop's messages, block i of the sum in record i // blocks per record),
        no finiteness check; returns ``buf``."""
        check_block(bits, block)
        _c, viewable_in = _check_records(buf_k, k, bits, block)
        _c, viewable_out = _check_records(buf, k_out, bits, block)
        per_chunk = record_numel(buf_k.numel() // k, bits, block)
        if k_out * record_numel(buf.numel() // k_out, bits, block) != per_chunk or buf.device != buf_k.device:
            raise QuantizationError(f"{k_out} records of {buf.numel() // k_out} bytes on {buf.device} do not hold "
                                    f"one of the {k} input records ({per_chunk} values on {buf_k.device})")
        _check_residual(residual, per_chunk, buf_k.device)
        self._reduce_requantize_records(buf_k, k, bits, block, residual, buf, k_out, viewable_in and viewable_out)
        return buf

    def dequantize_sum_records(self, buf_k: Tensor, k: int, bits: int, block: int) -> Tensor:
        """``dequantize_sum`` of the k records of ``buf_k``: a new fp32 chunk."""
        check_block(bits, block)
        _code_bytes, viewable = _check_records(buf_k, k, bits, block)
        out = torch.empty(record_numel(buf_k.numel() // k, bits, block), dtype=torch.float32, device=buf_k.device)
        self._dequantize_sum_records(buf_k, k, bits, block, viewable, out)
        return out

    # -- implementation hooks -----------------------------------------------------------------
    # Arguments are validated. Encoded data comes as rows (2-D, each row contiguous, rows at any
    # stride); block i of a flat sequence of blocks is block i % (blocks per row) of row
    # i // (blocks per row). Outputs are written in place.

    def _quantize(self, x: Tensor, bits: int, block: int, codes: Tensor, scales: Tensor) -> None:
        """Encode the flat ``x`` into the rows ``codes``/``scales``."""
        raise NotImplementedError

    def _dequantize(self, codes: Tensor, scales: Tensor, bits: int, block: int, out: Tensor) -> None:
        """Decode every row, in order, into the flat ``out`` (its dtype)."""
        raise NotImplementedError

    def _reduce_requantize(self, codes_k: Tensor, scales_k: Tensor, bits: int, block: int,
                           residual: Optional[Tensor], codes: Tensor, scales: Tensor) -> None:
        """Sum the k rows (chunks) of ``codes_k``/``scales_k`` in fp32, row 0 first, (+ residual,
        which keeps what the quantization lost) and encode the sum into the rows ``codes``/``scales``."""
        raise NotImplementedError

    def _dequantize_sum(self, codes_k: Tensor, scales_k: Tensor, bits: int, block: int,
                        out: Tensor) -> None:
        """Sum the k rows (chunks) in fp32, row 0 first, into the flat fp32 ``out``."""
        raise NotImplementedError

    def _rotate(self, x: Tensor, block: int) -> Tensor:
        raise NotImplementedError

    # The records forms, by default through the rows hooks on views of the buffer (``viewable``:
    # the scales lie on 4-byte bounds), or on copies written back. An implementation that reads the
    # buffer directly overrides them.

    def _quantize_records(self, x: Tensor, buf: Tensor, k: int, bits: int, block: int, viewable: bool) -> None:
        if viewable:
            self._quantize(x, bits, block, *_checked_record_rows(buf, k, bits, block, viewable))
            return
        codes, scales = _new_rows(k, x.numel() // k, bits, block, x.device)
        self._quantize(x, bits, block, codes, scales)
        write_records(buf, codes, scales)

    def _dequantize_records(self, buf: Tensor, k: int, bits: int, block: int, viewable: bool, out: Tensor) -> None:
        self._dequantize(*_checked_record_rows(buf, k, bits, block, viewable), bits, block, out)

    def _reduce_requantize_records(self, buf_k: Tensor, k: int, bits: int, block: int, residual: Optional[Tensor],
                                   buf: Tensor, k_out: int, viewable: bool) -> None:
        if viewable:  # input and output records both in place
            self._reduce_requantize(*_checked_record_rows(buf_k, k, bits, block, True), bits, block, residual,
                                    *_checked_record_rows(buf, k_out, bits, block, True))
            return
        out = _new_rows(k_out, record_numel(buf.numel() // k_out, bits, block), bits, block, buf.device)
        self._reduce_requantize(*read_records(buf_k, k, bits, block), bits, block, residual, *out)
        write_records(buf, *out)

    def _dequantize_sum_records(self, buf_k: Tensor, k: int, bits: int, block: int, viewable: bool,
                                out: Tensor) -> None:
        self._dequantize_sum(*_checked_record_rows(buf_k, k, bits, block, viewable), bits, block, out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
