"""The folders of a `save` directory: which steps are complete, which one `latest` means, and
whether a new run may save there. No torch: deepy.py checks the save folder before any rank starts.

    <save>/global_stepN/         a committed step (its meta.json is the commit marker)
    <save>/.global_stepN.partial a save in progress, or one that was interrupted: ignored
    <save>/.global_stepN.old     the previous copy of step N while a new one replaces it: step N
                                 while no committed global_stepN exists (checkpointer.py)
    <save>/latest                the name of the newest committed step
"""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

STEP_DIR = re.compile(r"^global_step(\d+)$")
ASIDE_DIR = re.compile(r"^\.global_step(\d+)\.old$")
META = "meta.json"
OVERWRITE_KEY = "overwrite_checkpoints"  # the config key that lets a run replace another run's steps


def step_name(iteration: int) -> str:
    return f"global_step{iteration}"


def aside_dir(step_dir: Path) -> Path:
    """Where the old copy of a step waits while a new one replaces it."""
    return step_dir.parent / f".{step_dir.name}.old"


def complete_steps(save_dir: Path) -> dict[int, Path]:
    """Iteration -> its complete folder: `global_stepN`, or `.global_stepN.old` when a replacement
    of step N stopped between its two renames. Warns about nothing (`committed_steps` does)."""
    if not save_dir.is_dir():
        return {}
    committed: dict[int, Path] = {}
    asides: dict[int, Path] = {}
    for entry in save_dir.iterdir():
        for pattern, into in ((STEP_DIR, committed), (ASIDE_DIR, asides)):
            match = pattern.match(entry.name)
            if match and (entry / META).is_file():
                into[int(match.group(1))] = entry
    return {**asides, **committed}  # a committed global_stepN wins over its old copy


def committed_steps(save_dir: Path) -> list[int]:
    """Iterations with a complete step folder, ascending; warns about the folders it skips."""
    steps = complete_steps(save_dir)
    for entry in sorted(save_dir.iterdir()) if save_dir.is_dir() else []:
        if entry.name.endswith(".partial"):
            warnings.warn(f"ignoring half-written checkpoint folder {entry} (a save was interrupted)")
        elif STEP_DIR.match(entry.name) and not (entry / META).is_file():
            warnings.warn(f"ignoring incomplete checkpoint folder {entry} (no {META})")
    for step, path in sorted(steps.items()):
        if ASIDE_DIR.match(path.name):
            warnings.warn(f"the replacement of {step_name(step)} was interrupted: using its previous copy {path}")
    return sorted(steps)


def latest_step_dir(load_dir: str | os.PathLike) -> Path | None:
    """The step folder `latest` names, falling back to the newest complete one."""
    root = Path(load_dir)
    steps = committed_steps(root)  # also warns about interrupted saves it skips
    folders = complete_steps(root)
    pointer = root / "latest"
    if pointer.is_file():
        name = pointer.read_text().strip()
        match = STEP_DIR.match(name)
        if match and int(match.group(1)) in folders:
            return folders[int(match.group(1))]
        warnings.warn(f"`latest` in {root} names {name}, which is incomplete; using the newest complete step")
    return folders[steps[-1]] if steps else None


def save_folder_conflict(save: str | None, load: str | None, overwrite: bool) -> str | None:
    """Why a run must not start saving into `save` (None: it may). A run that neither resumes from
    `save` nor sets `overwrite_checkpoints` would write its steps among another run's, under the
    same names: refused before it trains, since its first save is where the loss would happen."""
    if not save or overwrite:
        return None
    steps = complete_steps(Path(save))
    if not steps or (load and Path(load).resolve() == Path(save).resolve()):
        return None
    return (f"the save folder {save} already holds checkpoints of another run (newest {step_name(max(steps))}); "
            f"to continue that run set `load: {save}`, or to replace its steps as this run saves them "
            f"set `{OVERWRITE_KEY}: true`")
