"""The folders of a `save` directory: which steps are complete, which one `latest` means, and
whether a new run may save there. No torch: deepy.py checks the save folder before any rank starts.

    <save>/global_stepN/         a committed step (its meta.json is the commit marker)
    <save>/.global_stepN.partial a save in progress, or one that was interrupted: ignored
    <save>/.global_stepN.old     the previous copy of step N while a new one replaces it: step N
                                 while no committed global_stepN exists (checkpointer.py)
    <save>/latest                the name of the newest committed step
    <save>/.lock                 held by the run saving here (megatron/checkpointing/lock.py)

A `latest` that cannot be used (binary garbage, empty, a name that is not a step, a step that is
not complete) is treated as a missing one, with one warning line: the newest complete step is
loaded, as when `latest` is absent (passing over steps whose files are not all there at their
saved length). Why not start from scratch, as DeepSpeed does without `latest`:
the run would then save over the steps it ignored.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

from megatron.checkpointing.lock import in_use

STEP_DIR = re.compile(r"^global_step(\d+)$")
ASIDE_DIR = re.compile(r"^\.global_step(\d+)\.old$")
META = "meta.json"
CHECKSUMS = "rank_files"  # meta.json: rank file name -> {"bytes": n, "crc32": "xxxxxxxx"} (rank_files.py)
OVERWRITE_KEY = "overwrite_checkpoints"  # the config key that lets a run replace another run's steps
LATEST_MAX_BYTES = 256  # a step name is ~20 bytes: anything longer is not a pointer


class CheckpointWarning(UserWarning):
    """Something in a save folder was skipped or worked around; shown as one line."""


_format_other_warnings = warnings.formatwarning


def _one_line(message, category, filename, lineno, line=None) -> str:
    """A CheckpointWarning as `warning: ...` alone (Python's form adds the file and a source line)."""
    if issubclass(category, CheckpointWarning):
        return f"warning: {message}\n"
    return _format_other_warnings(message, category, filename, lineno, line)


warnings.formatwarning = _one_line


def warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=2)


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
            warn(f"ignoring half-written checkpoint folder {entry} (a save was interrupted)")
        elif STEP_DIR.match(entry.name) and not (entry / META).is_file():
            warn(f"ignoring incomplete checkpoint folder {entry} (no {META})")
    for step, path in sorted(steps.items()):
        if ASIDE_DIR.match(path.name):
            warn(f"the replacement of {step_name(step)} was interrupted: using its previous copy {path}")
    return sorted(steps)


def read_latest(root: Path) -> tuple[str | None, str | None]:
    """(the step name `latest` holds, None) or (None, why it holds none usable); (None, None) when
    there is no `latest`. Never raises: a pointer is a hint, the step folders are the truth."""
    pointer = Path(root) / "latest"
    try:
        with open(pointer, "rb") as f:
            raw = f.read(LATEST_MAX_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as err:
        return None, f"cannot be read ({err.strerror or err})"
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None, "is not text (binary data)"
    if not name:
        return None, "is empty"
    if len(raw) > LATEST_MAX_BYTES or not STEP_DIR.match(name):
        return None, f"holds {name[:40]!r}, not a step name (global_stepN)"
    return name, None


def latest_step_dir(load_dir: str | os.PathLike) -> Path | None:
    """The step folder `latest` names; when `latest` is missing, the newest complete step; when it is
    unusable (module docstring), the newest complete and intact one, with one warning line."""
    root = Path(load_dir)
    steps = committed_steps(root)  # also warns about interrupted saves it skips
    folders = complete_steps(root)
    name, problem = read_latest(root)
    if name is not None:
        step = int(STEP_DIR.match(name).group(1))
        if step in folders:
            return folders[step]
        problem = f"names {name}, which is {'incomplete' if (root / name).is_dir() else 'not there'}"
    if problem is None:  # no `latest` at all: the newest complete step, as always
        return folders[steps[-1]] if steps else None
    # a guess replaces the pointer: skip steps whose files are not all there at their saved length
    # (a stat each; flipped bytes are left to the read's crc32, which names the step before)
    skipped = []
    for step in reversed(steps):
        damage = intact(folders[step])
        if damage is None:
            also = f" ({'; '.join(skipped)})" if skipped else ""
            warn(f"`latest` in {root} {problem}: using the newest complete step, {step_name(step)}{also}")
            return folders[step]
        skipped.append(f"{step_name(step)} is not intact: {damage}")
    warn(f"`latest` in {root} {problem}: no complete step to use" + (f" ({'; '.join(skipped)})" if skipped else ""))
    return None


def intact(step_dir: Path) -> str | None:
    """Why a complete step is not usable as it stands (a rank file missing, or not the length its save
    recorded), or None. A stat per file, no read: what pruning can afford at every save. Flipped
    bytes keep the length; the full check (crc32) is made when a file is read (rank_files.py)."""
    try:
        with open(step_dir / META) as f:
            recorded = json.load(f).get(CHECKSUMS) or {}
    except (OSError, ValueError, AttributeError) as err:
        return f"its {META} cannot be read ({err})"
    for name, expected in sorted(recorded.items()):
        try:
            size = (step_dir / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != expected.get("bytes"):
            return f"{name} holds {size} bytes, its save wrote {expected.get('bytes')}"
    return None


def save_folder_conflict(save: str | None, load: str | None, overwrite: bool) -> str | None:
    """Why a run must not start saving into `save` (None: it may). A run that neither resumes from
    `save` nor sets `overwrite_checkpoints` would write its steps among another run's, under the
    same names: refused before it trains, since its first save is where the loss would happen."""
    if not save:
        return None
    busy = in_use(save)  # refused even with overwrite or load: two live runs would mix their steps
    if busy or overwrite:
        return busy
    steps = complete_steps(Path(save))
    if not steps or (load and Path(load).resolve() == Path(save).resolve()):
        return None
    return (f"the save folder {save} already holds checkpoints of another run (newest {step_name(max(steps))}); "
            f"to continue that run set `load: {save}`, or to replace its steps as this run saves them "
            f"set `{OVERWRITE_KEY}: true`")
