"""The input files of preprocessing, plain or compressed, read as text streams.

A name is ``<stem>.<type>[.<compression>]``: the type is ``.jsonl``/``.json`` (one JSON object per
line) or ``.txt``; the compression ``.gz`` (the stdlib's gzip) or ``.zst``/``.zstd`` (the
``zstandard`` package: how the Pile and most GPT-NeoX corpora ship). Other compressions (``.xz``,
``.bz2``, ...) are refused by name rather than read as garbage, and so is a file whose first bytes
say it is compressed when its name says it is not (or compressed another way).

Decompression streams: memory holds one read's worth of output, never the file. zstd input is fed
to the decompressor ``ZSTD_FEED_BYTES`` (256) at a time; a zstd block takes at least 4 bytes and
holds at most 128 KiB, so one feed yields at most 8 MiB even for the most compressible input, and
about 1 KiB for text (which compresses ~3x). zstandard's ``decompressobj`` has no bound on its
output (no ``max_length``), hence the small feeds; they cost little: 200 MB of text decompress in
2.7 s this way against 1.6 s through zstandard's stream reader, next to minutes of tokenizing.
Frames are read one after another (files made by ``cat a.zst b.zst`` or by parallel compressors),
with windows up to 2 GiB (``zstd --long=31``).

Measured by ``tools/check_compressed_inputs.py --size-mb 200``: the .bin/.idx from 200 MB of jsonl
are byte-equal read from .jsonl, .jsonl.zst and .jsonl.gz, at a peak RSS of 53.2, 54.1 and 53.7 MiB
(one process; 60.7, 61.9, 60.2 MiB with ``--workers 2``) against 30 MiB on a 0.3 MB input; the
difference is the index's per-document sizes, which any reader keeps.

A corrupt or truncated file is a :class:`DataError` naming the file, how far into its compressed
bytes the reader got, and the last whole line read. zstd finds corruption inside a frame only when
the frame carries a checksum (the ``zstd`` command writes one unless ``--no-check``); truncation is
found always.
"""
from __future__ import annotations

import contextlib
import gzip
import io
import os
import zlib
from typing import Iterator, Optional

from megatron.data.errors import DataError

TYPES = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
OTHER_COMPRESSIONS = (".bz2", ".xz", ".lzma", ".lz4", ".br", ".zip", ".7z", ".Z")
MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}
CHECK_COMMAND = {"gzip": "gzip -t", "zstd": "zstd -t"}
ZSTD_FEED_BYTES = 256
ZSTD_MAX_WINDOW = 1 << 31


def split_name(path: str) -> tuple[str, Optional[str], str]:
    """``(type suffix or "", compression or None, compression suffix or "")`` of a file name."""
    stem, last = os.path.splitext(path)
    compression = COMPRESSIONS.get(last)
    if compression is None and last not in OTHER_COMPRESSIONS:
        stem, last = path, ""
    kind = os.path.splitext(stem)[1]
    return kind, compression, last


def is_input_name(path: str) -> bool:
    """Whether a folder's file is an input (other compressions included, so they are refused by name)."""
    return split_name(path)[0] in TYPES


def input_kind(path: str) -> tuple[str, Optional[str]]:
    """``("jsonl" | "txt", compression or None)``; DataError for an unknown type or compression."""
    kind, compression, suffix = split_name(path)
    if suffix and compression is None:
        raise DataError(f"{path}: {suffix} compression is not supported; use .gz or .zst "
                        f"(e.g. {os.path.splitext(path)[0]}.zst), or decompress it first")
    if kind not in TYPES:
        raise DataError(f"{path}: unknown input type; use .jsonl (one JSON object per line) or .txt, "
                        "optionally compressed as .gz or .zst")
    return TYPES[kind], compression


class ZstdStream(io.RawIOBase):
    """The decompressed bytes of a zstd file (any number of frames), a small feed at a time.

    ``zstandard``'s own stream reader ends quietly at a truncated frame; a ``decompressobj`` per
    frame says whether its frame reached its end (``eof``), so truncation is an ``EOFError``."""

    def __init__(self, raw: io.BufferedReader):
        try:
            import zstandard
        except ImportError as error:
            raise DataError("reading .zst input needs the zstandard package: run `make venv` "
                            "(or pip install zstandard)") from error
        self._raw = raw
        self._context = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        self._frame = None
        self._output = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._output:
            data = self._raw.read(ZSTD_FEED_BYTES)
            if not data:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            parts = []
            while data:
                if self._frame is None or self._frame.eof:
                    self._frame = self._context.decompressobj()
                parts.append(self._frame.decompress(data))
                data = self._frame.unused_data if self._frame.eof else b""
            self._output = memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
        count = min(len(buffer), len(self._output))
        buffer[:count] = self._output[:count]
        self._output = self._output[count:]
        return count


def check_input(path: str) -> None:
    """Refuse, before any work, a file of an unknown type or compression, or one named for another."""
    with open(path, "rb") as file:
        check_contents(path, input_kind(path)[1], file.read(4))


def check_contents(path: str, compression: Optional[str], head: bytes) -> None:
    """DataError when the first bytes ``head`` are gzip or zstd and the name says otherwise."""
    found = next((name for name, magic in MAGIC.items() if head.startswith(magic)), None)
    if found is None or found == compression:
        return  # plain text, or what the name says (a .zst that is not zstd fails when read)
    stem = os.path.splitext(path)[0] if compression else path
    named = f"{compression}-compressed" if compression else "uncompressed"
    raise DataError(f"{path} holds {found}-compressed data but its name says {named}; "
                    f"rename it to {stem}{'.gz' if found == 'gzip' else '.zst'}")


def _corrupt_errors() -> tuple:
    """The exceptions that mean bad compressed data (zstandard's only where it is installed)."""
    errors = (EOFError, gzip.BadGzipFile, zlib.error)
    try:
        import zstandard
    except ImportError:
        return errors
    return errors + (zstandard.ZstdError,)


class InputFile:
    """One input file as text: :meth:`lines` or :meth:`read`; :attr:`position` is the bytes read from
    disk so far (compressed bytes for a compressed file), what preprocessing's progress counts."""

    def __init__(self, path: str):
        self.path = path
        self.kind, self.compression = input_kind(path)
        self.size = os.path.getsize(path)
        self.lines_read = 0
        self._raw = open(path, "rb")
        try:
            check_contents(path, self.compression, self._raw.read(4))
            self._raw.seek(0)
            if self.compression == "gzip":
                binary = gzip.GzipFile(fileobj=self._raw, mode="rb")
            elif self.compression == "zstd":
                binary = io.BufferedReader(ZstdStream(self._raw))
            else:
                binary = self._raw
        except BaseException:
            self._raw.close()
            raise
        self._text = io.TextIOWrapper(binary, encoding="utf-8", errors="replace")

    @property
    def position(self) -> int:
        return self._raw.tell()

    def lines(self) -> Iterator[str]:
        """The file's lines, each ending in its newline (the last one may not)."""
        with self._decoding():
            for line in self._text:
                self.lines_read += 1
                yield line

    def read(self) -> str:
        """The whole text (a .txt input is one document, so it is held whole)."""
        with self._decoding():
            return self._text.read()

    @contextlib.contextmanager
    def _decoding(self) -> Iterator[None]:
        """Turns a decompression failure inside it into the file's one-line DataError."""
        try:
            yield
        except _corrupt_errors() as error:
            if self.compression is None:
                raise
            raise self._corrupt(error) from error

    def _corrupt(self, error: BaseException) -> DataError:
        truncated = isinstance(error, EOFError)
        what, reason = ("truncated", "it ends inside a compressed stream") if truncated else ("corrupt", str(error))
        where = f", after line {self.lines_read}" if self.kind == "jsonl" else ""
        return DataError(f"{self.path}: {what} {self.compression} data at or before compressed byte "
                         f"{self.position} of {self.size}{where} ({reason}); "
                         f"check it with `{CHECK_COMMAND[self.compression]} {self.path}` and fetch it again")

    def check_hint(self) -> str:
        """For a compressed file, how to tell whether a bad line is damage to the file: gzip checks
        its CRC only at a member's end, so a flipped bit often shows first as a line that is not JSON."""
        if self.compression is None:
            return ""
        return f"; `{CHECK_COMMAND[self.compression]} {self.path}` says whether the file is corrupt"

    def close(self) -> None:
        try:
            self._text.close()
        finally:
            self._raw.close()

    def __enter__(self) -> "InputFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

