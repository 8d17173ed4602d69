"""Sharded, atomic checkpoints in NeoX's layout: `<save>/global_stepN/` plus a `latest` pointer.

Commit protocol (why: a killed job must never leave a half-written step as `latest`):
1. every rank writes its own `rank_XXXXX.pt` into the hidden folder `.global_stepN.partial` and
   fsyncs it; 2. barrier; 3. the ranks' piece lists reach rank 0 (the `gather` callable, or rank 0
   reads each file's list once) and rank 0 writes `index.json` (megatron/checkpointing/index.py),
   fsyncs it; 4. rank 0 writes `meta.json`, fsyncs, renames the folder to `global_stepN` (atomic on
   POSIX), then replaces `latest` by rename of a fsynced temporary file; 5. barrier. Every rename
   fsyncs what it renames first and the parent folder after (`rename_durably`). A folder without
   `meta.json` or a leftover `.partial` is ignored with a warning. Old steps are pruned only after
   the new one is committed. A step without `index.json` (saved before it existed) still loads.

Saving a step that exists (a run with `overwrite_checkpoints`, a resumed run saving a step again)
replaces it only once the new folder is complete: the old `global_stepN` is renamed aside to
`.global_stepN.old`, the new one renamed in, then the old one deleted. POSIX cannot rename a folder
onto a non-empty one, so between the two renames step N lives in `.global_stepN.old`; readers take
it from there (folders.complete_steps), and a crash anywhere leaves one complete copy of step N.

A write that fails (a full disk, a file-size limit) raises CheckpointError naming the step and the
cause; the half-written folder is removed and `latest` still names the previous step.

Each rank file's checksum (CRC-32 and length, computed as it is written) travels to rank 0 with its
piece list and is recorded in meta.json (`rank_files`); every read checks it (rank_files.py).
Pruning keeps `keep_last_n` steps that are intact (every rank file there, at its recorded length):
a damaged step does not count, so the good steps before it stay in its place.

The committing process holds the save folder's lock (lock.py) once `lock()` is called (the trainer
does, before training): a second run is refused, and a save after another run took the lock over
fails instead of mixing the two runs' files.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable


from megatron.checkpointing.folders import (CHECKSUMS, META, aside_dir, complete_steps, intact, read_latest,
                                            step_name, warn)
from megatron.checkpointing.lock import FolderInUse, SaveFolderLock
from megatron.checkpointing.rank_files import (CheckpointError, file_checksum, fsync_path, rank_file,
                                               rename_durably, write_rank_state, write_text_durably)

CHECKSUM = "checksum"  # the key of a rank's checksum in what it sends rank 0 beside its piece list


class Checkpointer:
    def __init__(self, save_dir: str, *, rank: int, world_size: int,
                 barrier: Callable[[], None], keep_last_n: int | None = None, commits: bool | None = None):
        """``commits``: this process does rank 0's part (the step folder, index.json, the commit,
        pruning); default: rank 0 does. A rehearsal playing one rank of a world whose other ranks are
        absent (tools/rehearse.py) does it for its absent rank 0."""
        self.save_dir = Path(save_dir)
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.keep_last_n = keep_last_n
        self.commits = rank == 0 if commits is None else commits
        self._lock: SaveFolderLock | None = None

    def lock(self) -> None:
        """Take the save folder's lock (the committing process; lock.py): a live holder is refused in
        one line, a stale one taken over with one warning line."""
        lock = SaveFolderLock(self.save_dir)
        try:
            notice = lock.acquire()
        except FolderInUse as err:
            raise CheckpointError(str(err)) from None
        if notice:
            warn(notice)
        self._lock = lock

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def ensure_writable(self) -> None:
        """Fail before training, not after hours of it, when the folder cannot be written."""
        try:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            probe = self.save_dir / f".write_probe.{self.rank}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise CheckpointError(f"cannot write checkpoints to {self.save_dir}: {err.strerror}; "
                                  "set `save` to a writable folder") from err

    def save(self, iteration: int, rank_state: dict, meta: dict, gather=None) -> Path:
        """Write this rank's state as step ``iteration``; all ranks call this together. A step that
        exists is replaced only once the new copy is complete (module docstring). A write that
        fails raises CheckpointError: nothing of it is committed and `latest` is unchanged.

        ``gather(obj)`` (optional, collective): every rank's ``obj`` in rank order, at least on rank 0
        (``Engine.gather_objects``); it brings the ranks' piece lists to rank 0 for
        ``index.json`` without reopening their files. Without it rank 0 reads each file's list once.
        """
        final = self.save_dir / step_name(iteration)
        partial = self.save_dir / f".{final.name}.partial"
        if self.commits:
            self.ensure_writable()
            try:
                if partial.exists():
                    shutil.rmtree(partial)
                partial.mkdir()
            except OSError as err:
                raise self._write_failed(final, partial, err) from None
        self.barrier()
        try:
            checksum = write_rank_state(rank_file(partial, self.rank), rank_state)
        except OSError as err:
            raise self._write_failed(final, partial, err, rank_file(partial, self.rank).name) from None
        self.barrier()
        entries = None
        if gather is not None:
            from megatron.checkpointing.index import index_entry
            entries = gather({**(index_entry(rank_state) or {}), CHECKSUM: checksum})
        if self.commits:
            taken = self._lock.held() if self._lock is not None else None
            if taken:  # committing now would mix this run's step with the other run's
                shutil.rmtree(partial, ignore_errors=True)
                raise CheckpointError(f"could not save checkpoint {final}: {taken}")
            try:
                self._commit(iteration, partial, final, rank_state, checksum, entries, meta)
            except OSError as err:
                raise self._write_failed(final, partial, err) from None
            self._prune(iteration)
        self.barrier()
        return final

    def _commit(self, iteration: int, partial: Path, final: Path, rank_state: dict, checksum: dict, entries,
                meta: dict) -> None:
        """Rank 0, once every rank file is written: index.json, meta.json, the folder in place, `latest`."""
        checksums, entries = _split_checksums(entries)
        self._write_index(partial, rank_state, entries)
        meta = {**meta, "iteration": iteration, "world_size": self.world_size,
                CHECKSUMS: self._checksums(partial, checksum, checksums)}
        with open(partial / META, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(partial)
        aside = aside_dir(final)
        if final.exists():
            if aside.exists():  # left by a replacement that had already moved its new copy in
                shutil.rmtree(aside)
            rename_durably(final, aside)
        rename_durably(partial, final)
        tmp_pointer = self.save_dir / ".latest.tmp"
        write_text_durably(tmp_pointer, final.name)
        rename_durably(tmp_pointer, self.save_dir / "latest")
        shutil.rmtree(aside, ignore_errors=True)

    def _write_failed(self, final: Path, partial: Path, err: OSError, what: str | None = None) -> CheckpointError:
        """The one-line error for a save that did not happen; rank 0 removes its half-written folder
        (on a full disk that is the space the next attempt needs)."""
        if self.commits:
            shutil.rmtree(partial, ignore_errors=True)
        latest, _ = read_latest(self.save_dir)
        what = what or (Path(err.filename).name if err.filename else None)
        where = f" writing {what}" if what else ""
        kept = f"`latest` still names {latest}" if latest else "there is no `latest` yet"
        return CheckpointError(f"could not save checkpoint {final}: {err.strerror or err}{where}; {kept}; "
                               "free space on that file system (or point `save` elsewhere) and resume from `latest`")

    def _write_index(self, partial: Path, rank_state: dict, entries) -> None:
        """index.json for a step of engine states (nothing for other rank states)."""
        from megatron.checkpointing import index as idx
        mine = idx.index_entry(rank_state)
        if mine is None:
            return
        if entries is not None:
            index = idx.build_index(list(entries), rank_state["engine"], self.world_size)
        elif self.world_size == 1:
            index = idx.build_index([mine], rank_state["engine"], 1)
        else:
            index = idx.scan_step(partial, self.world_size)
        if index is not None:
            idx.write_index(partial, index)

    def _checksums(self, partial: Path, mine: dict, gathered: list | None) -> dict:
        """File name -> checksum for meta.json: the ranks' own (gathered), rank 0's alone in a world of
        one, else (a caller without a gather: tools, tests) read back from each file once."""
        if gathered is None and self.world_size == 1:
            gathered = [mine]
        if gathered is None:
            gathered = [file_checksum(rank_file(partial, r)) for r in range(self.world_size)]
        return {rank_file(partial, r).name: c for r, c in enumerate(gathered) if c is not None}

    def _prune(self, newest: int) -> None:
        """Delete the steps older than the keep_last_n-th newest intact one (the step just saved
        counts: its files were checksummed as written). A damaged step is not counted, so it never
        pushes a good step out; it goes once keep_last_n intact steps are newer."""
        if not self.keep_last_n:
            return
        folders = complete_steps(self.save_dir)
        good = 0
        for step in sorted(folders, reverse=True):
            if good >= self.keep_last_n and step != newest:  # a run saving below older steps keeps its own
                shutil.rmtree(folders[step], ignore_errors=True)
                shutil.rmtree(aside_dir(self.save_dir / step_name(step)), ignore_errors=True)
                continue
            problem = None if step == newest else intact(folders[step])
            if problem is None:
                good += 1
            else:
                warn(f"keeping {folders[step]} out of keep_last_n_checkpoints' count: {problem}")


def _split_checksums(entries: list | None) -> tuple[list | None, list | None]:
    """The gathered ranks' (checksums, index entries): each rank sent its piece list (or nothing, for
    a state that is not an engine's) with its file's checksum beside it."""
    if entries is None:
        return None, None
    checksums, index_entries = [], []
    for entry in entries:
        entry = dict(entry or {})
        checksums.append(entry.pop(CHECKSUM, None))
        index_entries.append(entry or None)
    return checksums, index_entries
