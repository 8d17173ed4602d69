"""A step folder's files, read and written durably: the rank files, ``meta.json``, and the error
every checkpoint failure is reported as. The lowest module of the package: the checkpointer, the
index and the piece maps all build on it.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch

from megatron.checkpointing.folders import META


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
    """torch.load of a rank file; one that is cut short or overwritten is a CheckpointError, not
    torch's multi-line zip or unpickling error. ``weights_only``: a rank file holds only dicts, lists,
    tensors, strings and numbers, so loading one never runs code a file could smuggle in."""
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


class _ErrorRecordingFile:
    """torch.save reports a failed write as a bare RuntimeError ("unexpected pos ..."); this keeps
    the OSError behind it (No space left on device, File too large) for the message."""

    def __init__(self, f):
        self.f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

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


def write_rank_state(path: Path, rank_state: dict) -> None:
    """torch.save + fsync; raises OSError (the real cause) when the file cannot be written."""
    with open(path, "wb") as f:
        recording = _ErrorRecordingFile(f)
        try:
            torch.save(rank_state, recording)
        except RuntimeError:
            if recording.error is None:
                raise
            raise recording.error from None
        f.flush()
        os.fsync(f.fileno())


def load_meta(step_dir: Path) -> dict:
    with open(step_dir / META) as f:
        return json.load(f)


def load_rank_state(step_dir: Path, rank: int, mmap: bool = False) -> dict:
    """One rank file; ``mmap``: map it, so only the entries touched are read (not its tensors)."""
    path = rank_file(step_dir, rank)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint was saved with a different layout")
    return read_rank_file(path, mmap=mmap)
