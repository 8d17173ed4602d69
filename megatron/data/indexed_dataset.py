"""Memory-mapped indexed dataset in the exact GPT-NeoX / Megatron ``mmap`` format (.bin + .idx).

``<prefix>.bin`` holds the token ids of every sequence back to back, in the dtype named by the index.
``<prefix>.idx`` is, all little-endian:

=====================  =============================================================
``MMIDIDX\\x00\\x00``    9-byte magic
``<Q`` version         always 1
``<B`` dtype code      1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f32, 7 f64, 8 u16
``<Q`` sequence count  n
``<Q`` doc-index len   d = number of documents + 1 (NeoX writes ``len(doc_idx)``)
int32[n]               sizes: tokens per sequence
int64[n]               pointers: byte offset of each sequence in the .bin
int64[d]               doc_idx: first sequence of each document, starting at 0, ending at n
=====================  =============================================================

NeoX's preprocessing writes one sequence per document, so "sequence" and "document" coincide for
everything this project makes; the GPT sample index treats each sequence as a document, as NeoX does.

Files are validated when opened (magic, version, dtype, sizes against the files' lengths) so a
truncated or foreign file fails with a one-line :class:`DataError` instead of garbage tokens.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import List, Optional, Union

import numpy as np

from megatron.data.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# NeoX/Megatron dtype codes (code 6 is float32: NeoX's `np.float` alias meant float64 in old numpy,
# but the on-disk code table that NeoX and Megatron-LM share maps 6 to a 4-byte float).
DTYPE_BY_CODE = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float32),
    7: np.dtype(np.float64),
    8: np.dtype(np.uint16),
}
CODE_BY_DTYPE = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}
# magic + version + dtype code + sequence count + doc-index length
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
# Token ids below this fit uint16 (NeoX's threshold, leaving room for a few added special tokens).
UINT16_VOCAB_LIMIT = 65500
# check_token_range scans files up to this size at open; larger ones are checked sample by sample.
DEFAULT_EAGER_SCAN_BYTES = 2 << 30

PathLike = Union[str, os.PathLike]


def data_file_path(prefix: PathLike) -> str:
    """The ``.bin`` file of a dataset prefix."""
    return f"{os.fspath(prefix)}.bin"


def index_file_path(prefix: PathLike) -> str:
    """The ``.idx`` file of a dataset prefix."""
    return f"{os.fspath(prefix)}.idx"


def best_fitting_dtype(vocab_size: Optional[int]) -> np.dtype:
    """uint16 tokens when the vocabulary is under 65,500 ids, else int32 (NeoX's rule)."""
    if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def write_index(path: PathLike, dtype: np.dtype, sizes, doc_idx) -> None:
    """Write a ``.idx`` file for sequences of ``sizes`` tokens of ``dtype`` (pointers derived)."""
    dtype = np.dtype(dtype)
    if dtype not in CODE_BY_DTYPE:
        raise DataError(f"token dtype {dtype} has no NeoX dtype code; use uint16 or int32")
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    with open(path, "wb") as stream:
        stream.write(INDEX_MAGIC)
        stream.write(struct.pack("<Q", INDEX_VERSION))
        stream.write(struct.pack("<B", CODE_BY_DTYPE[dtype]))
        stream.write(struct.pack("<Q", len(sizes)))
        stream.write(struct.pack("<Q", len(doc_idx)))
        stream.write(sizes.tobytes(order="C"))
        stream.write(pointers.tobytes(order="C"))
        stream.write(doc_idx.tobytes(order="C"))


class MMapIndexedDatasetBuilder:
    """Writes ``<prefix>.bin/.idx``; both appear (atomically renamed) only on :meth:`finalize`.

    Use as a context manager so an exception leaves no half-written pair behind::

        with MMapIndexedDatasetBuilder(prefix, best_fitting_dtype(vocab)) as builder:
            for ids in documents:
                builder.add_document(ids)
    """

    def __init__(self, prefix: PathLike, dtype: np.dtype = np.dtype(np.uint16)):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_BY_DTYPE:
            raise DataError(f"token dtype {self.dtype} has no NeoX dtype code; use uint16 or int32")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        self._tmp_bin = data_file_path(self.prefix) + suffix
        self._tmp_idx = index_file_path(self.prefix) + suffix
        self._data_file = open(self._tmp_bin, "wb")
        self._sizes: List[int] = []
        self._doc_idx: List[int] = [0]
        self._max_id = np.iinfo(self.dtype).max if self.dtype.kind in "iu" else None

    def add_item(self, tokens) -> None:
        """Append one sequence (NeoX's add_item); call :meth:`end_document` after a document's items."""
        array = np.asarray(tokens)
        if array.size and self._max_id is not None and (array.max() > self._max_id or array.min() < 0):
            raise DataError(f"token ids in [{array.min()}, {array.max()}] do not fit {self.dtype} "
                            f"while writing {self.prefix}; pick the dtype with best_fitting_dtype(vocab_size)")
        self._data_file.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(array.size))

    def end_document(self) -> None:
        """Close the current document: the items added since the last call form one document."""
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens) -> None:
        """Append one document made of one sequence (what preprocessing does)."""
        self.add_item(tokens)
        self.end_document()

    @property
    def num_tokens(self) -> int:
        return int(sum(self._sizes))

    def finalize(self) -> None:
        """Write the index and move both files into place (.bin first, .idx last)."""
        self._data_file.close()
        write_index(self._tmp_idx, self.dtype, self._sizes, self._doc_idx)
        os.replace(self._tmp_bin, data_file_path(self.prefix))
        os.replace(self._tmp_idx, index_file_path(self.prefix))

    def abort(self) -> None:
        """Drop the temporary files (after an error)."""
        self._data_file.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "MMapIndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class MMapIndexedDataset:
    """Read-only view of a NeoX/Megatron ``.bin/.idx`` pair through ``np.memmap``.

    ``ds[i]`` / ``ds.get(i, offset, length)`` return numpy views of sequence ``i`` (no copy).
    """

    def __init__(self, prefix: PathLike):
        self.prefix = os.fspath(prefix)
        self._open()

    # Pickle by path so spawned DataLoader workers reopen the memmaps instead of copying them.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(f"missing {path}: a dataset is a .bin/.idx pair; make one with "
                                f"tools/preprocess_data.py and pass its prefix (without extension)")
        idx_bytes = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES or header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise DataError(f"{idx_path} is not a NeoX/Megatron mmap index (bad magic bytes "
                            f"{header[:len(INDEX_MAGIC)]!r}); re-run tools/preprocess_data.py")
        version, code, count, doc_count = struct.unpack("<QBQQ", header[len(INDEX_MAGIC):])
        if version != INDEX_VERSION:
            raise DataError(f"{idx_path}: index version {version} is not supported (only {INDEX_VERSION})")
        if code not in DTYPE_BY_CODE:
            raise DataError(f"{idx_path}: unknown token dtype code {code}; the index is corrupt")
        self.dtype = DTYPE_BY_CODE[code]
        expected = HEADER_BYTES + count * (4 + 8) + doc_count * 8
        if idx_bytes < expected:
            raise DataError(f"{idx_path} is truncated ({idx_bytes} bytes, header promises {expected}); "
                            f"re-run tools/preprocess_data.py")
        index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self._sizes = np.frombuffer(index, dtype=np.int32, count=count, offset=HEADER_BYTES)
        self._pointers = np.frombuffer(index, dtype=np.int64, count=count, offset=HEADER_BYTES + 4 * count)
        self._doc_idx = np.frombuffer(index, dtype=np.int64, count=doc_count, offset=HEADER_BYTES + 12 * count)
        self._index_map = index
        self._validate_against_bin(bin_path)

    def _validate_against_bin(self, bin_path: str) -> None:
        itemsize = self.dtype.itemsize
        bin_bytes = os.path.getsize(bin_path)
        if len(self._sizes):
            if np.any(self._pointers % itemsize) or np.any(self._sizes < 0):
                raise DataError(f"{index_file_path(self.prefix)}: pointers or sizes are inconsistent; "
                                f"the index is corrupt, re-run tools/preprocess_data.py")
            end = int(self._pointers[-1]) + int(self._sizes[-1]) * itemsize
            if bin_bytes < end:
                raise DataError(f"{bin_path} is truncated ({bin_bytes} bytes, the index points up to {end}); "
                                f"re-run tools/preprocess_data.py")
        if bin_bytes >= itemsize:
            self._tokens = np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(bin_bytes // itemsize,))
        else:  # np.memmap refuses empty files
            self._tokens = np.zeros(0, dtype=self.dtype)

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise DataError("slices of an indexed dataset must be contiguous (step 1)")
            return [self.get(i) for i in range(start, stop)]
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        size = int(self._sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of sequence {idx} of {size} tokens")
        start = int(self._pointers[idx]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    @property
    def sizes(self) -> np.ndarray:
        """Tokens per sequence (int32)."""
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        """Byte offset of each sequence in the .bin (int64)."""
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """First sequence of each document, plus a final entry equal to ``len(self)`` (int64)."""
        return self._doc_idx

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the .bin as one flat memmap (includes any bytes no sequence points to)."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return int(self._sizes.sum(dtype=np.int64))

    @property
    def bin_path(self) -> str:
        return data_file_path(self.prefix)

    @staticmethod
    def exists(prefix: PathLike) -> bool:
        return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def token_range_error(dataset: MMapIndexedDataset, token: int, sequence: int, vocab_size: int) -> DataError:
    """The one-line error for a token id outside ``[0, vocab_size)``."""
    return DataError(f"{dataset.bin_path}: token id {token} in sequence {sequence} is outside the vocabulary "
                     f"[0, {vocab_size}); it was tokenized with another tokenizer — re-run "
                     f"tools/preprocess_data.py with this run's tokenizer")


def check_token_range(dataset: MMapIndexedDataset, vocab_size: int,
                      max_scan_bytes: int = DEFAULT_EAGER_SCAN_BYTES) -> bool:
    """Raise :class:`DataError` naming the file if any token id is ``>= vocab_size`` (or negative).

    Scans the whole .bin in chunks when it is at most ``max_scan_bytes`` (a max over a memmap runs at
    memory speed: ~1 s per GB warm). Larger files are not scanned here — returns False, and
    :class:`~megatron.data.gpt_dataset.GPTDataset` then checks every sample it returns (O(seq_length)).
    Returns True when the whole file was checked.
    """
    dtype = dataset.dtype
    if dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
        return True  # every representable id is in range
    if dataset.tokens.nbytes > max_scan_bytes:
        return False
    chunk = 1 << 24
    sizes = dataset.sizes
    if not len(sizes):
        return True
    first = int(dataset.pointers[0]) // dtype.itemsize
    last = int(dataset.pointers[-1]) // dtype.itemsize + int(sizes[-1])
    for start in range(first, last, chunk):
        block = dataset.tokens[start:min(start + chunk, last)]
        bad = (block >= vocab_size) | (block < 0)
        if bad.any():
            position = start + int(np.argmax(bad))
            sequence = int(np.searchsorted(dataset.pointers // dtype.itemsize, position, side="right") - 1)
            raise token_range_error(dataset, int(dataset.tokens[position]), sequence, vocab_size)
    return True
