"""A step folder's files, read and written durably: the rank files, ``meta.json``, and the error
every checkpoint failure is reported as. The lowest module of the package: the checkpointer, the
index and the piece maps all build on it.

Checksums. Each rank file's CRC-32 and length are computed from the bytes as torch.save hands them
to the file (no second pass over a multi-GB file at save), and the committing rank records them in
``meta.json`` under ``rank_files``. Every read of a rank file (resume, resharding, the HF export,
tools) first checks the file against them, streaming, and refuses a damaged one in one line: torch
would otherwise load flipped bytes inside a tensor as wrong weights without a word. Why CRC-32: it
is a check against damage, not against an adversary, and zlib's runs at ~2.3 GB/s here against
~1.1 for SHA-256 and ~0.6 for BLAKE2b (docs/checkpoints.md has the measurement). A step saved
before checksums existed has no ``rank_files`` and loads unchecked.
"""
from __future__ import annotations

import json
import os
import pickle
import zlib
from pathlib import Path
from typing import Optional

import torch

from megatron.checkpointing.folders import CHECKSUMS, META, complete_steps, step_name

CHUNK = 16 << 20  # bytes read at a time when verifying: large enough to stream at disk speed


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read; the message says what to do."""


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_file(step_dir: Path, rank: int) -> Path:
    return step_dir / f"rank_{rank:05d}.pt"


def read_rank_file(path: Path, mmap: bool = False) -> dict:
    """torch.load of a rank file, after checking it against the checksum its step recorded; one that
    is damaged, cut short or overwritten is a CheckpointError, not wrong weights or torch's multi-line
    zip or unpickling error. ``weights_only``: a rank file holds only dicts, lists, tensors, strings
    and numbers, so loading one never runs code a file could smuggle in."""
    verify_rank_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        if str(err).startswith("Weights only load failed"):
            raise CheckpointError(f"{path} holds objects other than tensors, dicts, lists, strings and numbers: "
                                  "refused (unpickling them could run code); it was not written by this "
                                  "trainer's checkpointer") from err
        raise _damaged(path, err) from err
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        raise _damaged(path, err) from err


def _damaged(path: Path, err: BaseException) -> CheckpointError:
    reason = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else type(err).__name__
    return CheckpointError(f"{path} cannot be read ({reason}): the checkpoint is damaged; to resume from "
                           f"an earlier step write its name into {Path(path).parent.parent / 'latest'}")


def file_checksum(path: Path) -> dict:
    """``{"bytes": n, "crc32": "xxxxxxxx"}`` of a file, read in CHUNK-sized pieces (never whole)."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"bytes": size, "crc32": f"{crc:08x}"}


def recorded_checksum(path: Path) -> Optional[dict]:
    """The checksum the step's meta.json recorded for rank file ``path`` (None: a folder without a
    meta.json, as a save in progress, or a step saved before checksums existed)."""
    meta_path = Path(path).parent / META
    try:
        with open(meta_path) as f:
            recorded = json.load(f).get(CHECKSUMS)
    except (OSError, ValueError, AttributeError):
        return None  # no meta (a .partial folder) or an unreadable one: loading it reports that
    return recorded.get(Path(path).name) if isinstance(recorded, dict) else None


def verify_rank_file(path: Path) -> None:
    """Refuse ``path`` in one line when its length or CRC-32 is not what its save recorded. The
    length first: a stat, so a cut file costs no read."""
    expected = recorded_checksum(path)
    if expected is None or not Path(path).is_file():
        return  # unchecked (old step), or missing: the caller's own message names that
    size = Path(path).stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{path} is damaged: it holds {size} bytes, its save wrote {expected['bytes']}; "
                              f"{_earlier_step_hint(path)}")
    found = file_checksum(path)["crc32"]
    if found != expected["crc32"]:
        raise CheckpointError(f"{path} is damaged: crc32 {found}, its save recorded {expected['crc32']}; "
                              f"{_earlier_step_hint(path)}")


def _earlier_step_hint(path: Path) -> str:
    """What to do about a damaged step: resume from the complete step before it, named."""
    step_dir = Path(path).parent
    root = step_dir.parent
    steps = complete_steps(root)
    this = next((step for step, folder in steps.items() if folder.name == step_dir.name), None)
    earlier = [step for step in steps if this is None or step < this]
    if not earlier:
        return "no earlier step is complete: this run must start again"
    return f"to resume from the step before it write {step_name(max(earlier))} into {root / 'latest'}"


class _ChecksummingFile:
    """What torch.save writes to: the file, plus the CRC-32 and length of every byte on its way
    (torch.save writes a file-like object front to back, so this is the file's checksum); and the
    OSError behind a failed write (No space left on device, File too large), which torch.save
    reports as a bare RuntimeError ("unexpected pos ...")."""

    def __init__(self, f):
        self.f = f
        self.error: OSError | None = None
        self.crc = 0
        self.size = 0

    def write(self, data) -> int:
        try:
            written = self.f.write(data)
        except OSError as err:
            self.error = err
            raise
        view = memoryview(data)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return written

    def flush(self) -> None:
        self.f.flush()


def rename_durably(src: Path, dst: Path) -> None:
    """fsync ``src`` (a file's data, or a folder's entries), os.replace, then fsync the parent folder.
    Why both: a rename can reach the disk before the data it names (ext4 delalloc, XFS), so after a
    power loss the new name could point at an empty file; and the rename itself lives in the parent."""
    fsync_path(src)
    os.replace(src, dst)
    fsync_path(dst.parent)


def write_text_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it (a file about to be renamed into place)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_rank_state(path: Path, rank_state: dict) -> dict:
    """torch.save + fsync; returns the file's checksum (``file_checksum``'s form), computed as it was
    written. Raises OSError (the real cause) when the file cannot be written."""
    with open(path, "wb") as f:
        recording = _ChecksummingFile(f)
        try:
            torch.save(rank_state, recording)
        except RuntimeError:
            if recording.error is None:
                raise
            raise recording.error from None
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": recording.size, "crc32": f"{recording.crc:08x}"}


def load_meta(step_dir: Path) -> dict:
    with open(step_dir / META) as f:
        return json.load(f)


def load_rank_state(step_dir: Path, rank: int, mmap: bool = False) -> dict:
    """One rank file; ``mmap``: map it, so only the entries touched are read (not its tensors)."""
    path = rank_file(step_dir, rank)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint was saved with a different layout")
    return read_rank_file(path, mmap=mmap)
