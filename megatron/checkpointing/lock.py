"""The lock on a `save` folder: one run saves into a folder at a time (docs/checkpoints.md).

Two runs saving into one folder write steps under the same names, and a step can end up with one
run's rank files and the other's meta.json. So the process that commits the steps (rank 0) holds
`<save>/.lock` from before it resumes until it leaves, and a second run is refused in one line that
names the holder: deepy refuses it before any rank starts, and rank 0 of a run that got past deepy
(two runs started at once) when it tries to take the lock.

The lock file is JSON: host, pid, the pid's start time (from /proc, to tell a reused pid from the
holder), the Slurm job id, and when it was taken. It is created whole and atomically (written under
a private name, then hard-linked to `.lock`: link fails if the name exists, on NFS and Lustre too),
so a reader never sees half a lock. The holder touches it every HEARTBEAT_S seconds.

A lock left by a run that crashed (killed, node lost) is stale, and the next run takes it over with
one warning line. Stale means:
- same host: the holder's pid is gone, or now belongs to a process that started at another time;
- same Slurm job id and a lower restart count (a requeued job keeps its id; SLURM_RESTART_COUNT
  counts its starts): an earlier start of this very job, wherever it ran;
- another host: no heartbeat for STALE_AFTER_S seconds (its pid cannot be checked from here);
- a lock file that is not JSON (not written by this code).
Taking over renames the stale lock aside first (only one of two racing runs can), checks that what
it renamed is the lock it judged, and puts it back otherwise.

No torch here: deepy checks the lock before any rank starts.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

LOCK = ".lock"
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0  # 10 heartbeats missed: the holder's host is down or cut off


class FolderInUse(Exception):
    """Another live run holds the save folder's lock; the message names it."""


def this_process() -> dict:
    pid = os.getpid()
    job = os.environ.get("SLURM_JOB_ID") or None
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _pid_start(pid), "job": job,
            "restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0) if job else None, "since": time.time()}


def describe(holder: dict) -> str:
    job = f", Slurm job {holder['job']}" if holder.get("job") else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder["since"])) if holder.get("since") else "?"
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {since}"


def _pid_start(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # after the command name, which may hold spaces


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def read_holder(path: Path) -> tuple[Optional[dict], Optional[float]]:
    """(the lock's content, its mtime), or (None, None) with no lock; content None when unreadable."""
    try:
        mtime = path.stat().st_mtime
        holder = json.loads(path.read_bytes().decode())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError):
        return None, time.time()
    return (holder if isinstance(holder, dict) and "pid" in holder else None), mtime


def stale_reason(holder: Optional[dict], mtime: float, me: dict, now: float) -> Optional[str]:
    """Why the lock ``holder`` left is stale (module docstring), or None while its run may be alive."""
    if holder is None:
        return "the lock file cannot be read (not written by this trainer)"
    if holder.get("host") == me["host"]:
        if not _pid_alive(int(holder["pid"])):
            return "its process is gone"
        if holder.get("pid_start") is not None and _pid_start(int(holder["pid"])) != holder["pid_start"]:
            return "its pid now belongs to another process"
        return None
    if holder.get("job") and holder.get("job") == me.get("job") and (holder.get("restart") or 0) < (me["restart"] or 0):
        return "it was taken by an earlier start of this Slurm job (requeued)"  # two steps of one start: the heartbeat
    if now - mtime > STALE_AFTER_S:
        return f"no heartbeat for {now - mtime:.0f} s (a holder on another host touches it every {HEARTBEAT_S:g} s)"
    return None


def in_use(save_dir: str | os.PathLike) -> Optional[str]:
    """The one-line refusal when a live run holds the folder's lock (None: free, or stale)."""
    path = Path(save_dir) / LOCK
    holder, mtime = read_holder(path)
    if mtime is None:
        return None
    me = this_process()
    if holder is not None and _is_me(holder, me):
        return None
    if stale_reason(holder, mtime, me, time.time()) is not None:
        return None
    return busy_message(save_dir, holder, mtime, me)


def busy_message(save_dir, holder: dict, mtime: float | None = None, me: dict | None = None) -> str:
    """The refusal; for a holder on another host, also when its lock frees itself should that run be
    gone (its pid cannot be checked from here, so a lost node's lock waits out the heartbeat)."""
    free = ""
    if mtime is not None and me is not None and holder.get("host") != me["host"]:
        at = time.strftime("%H:%M:%S UTC", time.gmtime(mtime + STALE_AFTER_S))
        free = f" (if that run is gone, its lock is free from {at}, {STALE_AFTER_S / 60:g} min after its last heartbeat)"
    return (f"the save folder {save_dir} is in use by another run ({describe(holder)}){free}; two runs saving "
            f"into one folder mix their steps: wait for that run to end, or set `save` to another folder")


def _is_me(holder: dict, me: dict) -> bool:
    return holder.get("host") == me["host"] and holder.get("pid") == me["pid"]


class SaveFolderLock:
    """The committing rank's hold on ``<save>/.lock``; ``acquire`` before training, ``release`` on the
    way out (a crash leaves it stale, see the module docstring)."""

    def __init__(self, save_dir: str | os.PathLike):
        self.save_dir = Path(save_dir)
        self.path = self.save_dir / LOCK
        self.me = this_process()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> Optional[str]:
        """Take the lock; returns the one-line notice when a stale lock was taken over (else None).
        Raises FolderInUse when a live run holds it."""
        notice = None
        for _ in range(3):  # a race with another taker is decided in a round or two
            if self._create():
                self._start_heartbeat()
                return notice
            holder, mtime = read_holder(self.path)
            if mtime is None:
                continue  # released meanwhile: try again
            if holder is not None and _is_me(holder, self.me):
                self._start_heartbeat()
                return notice  # this process took it already (a second Trainer in one process)
            reason = stale_reason(holder, mtime, self.me, time.time())
            if reason is None:
                raise FolderInUse(busy_message(self.save_dir, holder, mtime, self.me))
            if not self._remove_stale(holder):
                continue
            who = describe(holder) if holder else "an unknown holder"
            notice = f"taking over the lock of the save folder {self.save_dir} from {who}: {reason}"
        holder, _ = read_holder(self.path)
        raise FolderInUse(busy_message(self.save_dir, holder or {}))

    def _create(self) -> bool:
        """Write the lock whole under a private name, then link it into place (fails if one exists)."""
        self.save_dir.mkdir(parents=True, exist_ok=True)
        private = self.save_dir / f"{LOCK}.{self.me['host']}.{self.me['pid']}"
        private.write_text(json.dumps(self.me))
        try:
            os.link(private, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            private.unlink(missing_ok=True)

    def _remove_stale(self, judged: Optional[dict]) -> bool:
        """Rename the stale lock aside (one racer wins); False when what was renamed is not the lock
        judged stale (another run took it over meanwhile): that one is put back."""
        aside = self.save_dir / f"{LOCK}.stale.{self.me['host']}.{self.me['pid']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        renamed, _ = read_holder(aside)
        if renamed != judged:
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def held(self) -> Optional[str]:
        """None while this process still holds the lock, else the one line saying who took it."""
        holder, mtime = read_holder(self.path)
        if holder is not None and _is_me(holder, self.me):
            return None
        who = describe(holder) if holder else "nobody (the lock file is gone)"
        return f"the lock of the save folder {self.save_dir} is now held by {who}: another run is saving there"

    def release(self) -> None:
        self._stop.set()
        holder, _ = read_holder(self.path)
        if holder is not None and _is_me(holder, self.me):
            self.path.unlink(missing_ok=True)

    def _start_heartbeat(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, name="neox-save-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass  # gone or unreachable: `held` reports it at the next save
