"""Every rename of a checkpoint save is durable: what is renamed was fsynced before os.replace (a
rename may reach the disk before the data it names), and the folder holding the new name after.

os.fsync and os.replace are wrapped to record, in order, which path each fsync was for (resolved
from the file descriptor) and each replace; a save of a new step and a save that replaces it
(old copy aside, new copy in, `latest`) are checked.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron.checkpointing.checkpointer import Checkpointer
from megatron.checkpointing.param_slices import make_engine_state


def _state(value: float) -> dict:
    piece = {"name": "w", "offset": 0, "length": 4, "master": torch.full((4,), value),
             "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    return {"engine": make_engine_state([piece], {"w": (4,)}, 3, {"loss_scaler": None}),
            "rng": {"torch": torch.get_rng_state()}}


def _record(monkeypatch) -> list[tuple]:
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        events.append(("replace", Path(src).resolve(), Path(dst).resolve()))
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def _check(events: list[tuple]) -> int:
    """Each replace: its source fsynced since the previous replace of that path, and the
    destination's folder fsynced before the next replace. Returns how many replaces were seen."""
    replaces = [i for i, e in enumerate(events) if e[0] == "replace"]
    for n, i in enumerate(replaces):
        _, src, dst = events[i]
        start = max([j for j in replaces[:n] if src in events[j][1:]], default=-1)
        synced = {e[1] for e in events[start + 1:i] if e[0] == "fsync"}
        assert src in synced, f"{src} was renamed to {dst.name} without an fsync of it first"
        end = replaces[n + 1] if n + 1 < len(replaces) else len(events)
        after = {e[1] for e in events[i + 1:end] if e[0] == "fsync"}
        assert dst.parent in after, f"the folder of {dst} was not fsynced after the rename"
    return len(replaces)


def _files_synced_before_the_folder_moves(events: list[tuple], step: Path) -> None:
    """Every file of the step (rank file, index.json, meta.json) was fsynced before its folder was
    renamed into place."""
    into = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == step.resolve())
    partial = events[into][1]
    synced = {e[1] for e in events[:into] if e[0] == "fsync"}
    names = sorted(p.name for p in step.iterdir())
    assert names == ["index.json", "meta.json", "rank_00000.pt"], names
    for name in names:
        assert partial / name in synced, f"{name} was not fsynced before its folder was renamed"


def test_every_replace_follows_an_fsync_of_what_it_renames(tmp_path, monkeypatch):
    save = tmp_path / "ck"
    checkpointer = Checkpointer(str(save), rank=0, world_size=1, barrier=lambda: None)
    events = _record(monkeypatch)
    step = checkpointer.save(3, _state(1.0), {"consumed_samples": 0})
    assert _check(events) == 2  # the folder in, `latest`
    _files_synced_before_the_folder_moves(events, step)

    events.clear()
    checkpointer.save(3, _state(2.0), {"consumed_samples": 0})  # replaces the step
    assert _check(events) == 3  # the old copy aside, the new copy in, `latest`
    _files_synced_before_the_folder_moves(events, step)
    assert (save / "latest").read_text() == "global_step3"
    assert not (save / ".latest.tmp").exists() and not (save / ".global_step3.old").exists()
