"""The rank's side of a launch: a rank never outlives its launcher, and a stop signal it cannot act
on still ends it. `train.py` calls `guard_rank` first, from the main thread.

Launcher death. The local launcher names itself in NEOX_TOPO_EXIT_WITH_PARENT=<its pid>. The rank
asks Linux to SIGKILL it when its parent dies (prctl PR_SET_PDEATHSIG), then checks that its parent
is still that pid: deepy may have died before the request was made, and the request only covers a
death that comes after it. Under srun (NEOX_TOPO_EXIT_WITH_PARENT=any) the parent is slurmstepd, not
the launcher, so there is no pid to check and no prctl: slurmstepd starts the tasks, and the kernel
ties the signal to the thread that started a process, which this code does not control. In both
cases a watchdog thread compares os.getppid() with the parent once a second and exits the process
(LAUNCHER_GONE = 3, megatron/launch/exit_codes.py, after one line on stderr) when the rank has been handed
to init or a subreaper; it is what works where prctl does not (not Linux, or the signal refused).
Without the variable (train.py started by hand, `nohup`) nothing is watched. Under srun the watchdog
fires when slurmstepd dies; a `kill -9` of srun itself leaves slurmstepd (the parent) alive, so the
ranks stay until Slurm ends the step: when a batch job's script exits (InactiveLimit does not apply
to batch jobs), or, for an interactive allocation, after the site's InactiveLimit (docs/launch.md).

Stop signals. The trainer's SIGTERM handler asks for a save at the next step, and Python runs
handlers only between bytecodes: a rank blocked inside a collective whose peer is gone never runs
it, and never reaches the next step. The C-level handler still writes the signal's number to the
signal module's wakeup fd, whatever the main thread is doing, so a thread reading that fd exits the
process hard (code 128 + the signal: 143 = STOPPED_UNSAVED for SIGTERM) on a second SIGTERM or
SIGINT, or when the rank is still alive NEOX_TOPO_STOP_GRACE_S seconds (default 60) after the
first. A forked child gives the fd back (its signals are its own). SIGUSR1, the warning before a time
limit, is only ever a request.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from typing import Mapping, Optional

from megatron.launch.exit_codes import LAUNCHER_GONE

EXIT_WITH_PARENT = "NEOX_TOPO_EXIT_WITH_PARENT"  # <launcher pid>, or "any" (whatever parent started us)
STOP_GRACE = "NEOX_TOPO_STOP_GRACE_S"  # seconds after a SIGTERM before a hard exit; 0 = only a second signal
DEFAULT_STOP_GRACE_S = 60.0
PARENT_POLL_S = 1.0
HARD_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def guard_rank(env: Mapping[str, str]) -> None:
    """Both guards, set up from the launcher's variables; call it first, from the main thread."""
    who = rank_name(env)
    exit_with_parent(env.get(EXIT_WITH_PARENT), who)
    exit_hard_on_repeated_stop(stop_grace_s(env), who)


def rank_name(env: Mapping[str, str]) -> str:
    rank = env.get("RANK") or env.get("SLURM_PROCID")  # an empty RANK is unset, as launched_as reads it
    return f"rank {rank}" if rank is not None else "train.py"


def stop_grace_s(env: Mapping[str, str]) -> Optional[float]:
    """NEOX_TOPO_STOP_GRACE_S as seconds; None (no timer, only a second signal) for 0 or less."""
    value = float(env.get(STOP_GRACE, DEFAULT_STOP_GRACE_S))
    return value if value > 0 else None


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send `sig` to this process when the thread that started it exits; False where
    that cannot be asked (not Linux, no libc through ctypes, refused)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(int(sig)), ctypes.c_ulong(0), ctypes.c_ulong(0),
                          ctypes.c_ulong(0)) == 0
    except (OSError, AttributeError):
        return False


def exit_with_parent(spec: Optional[str], who: str, poll_s: float = PARENT_POLL_S) -> Optional[threading.Thread]:
    """Exit when the parent named by `spec` (a pid, or "any") is gone; returns the watchdog thread."""
    if not spec:
        return None
    if spec == "any":
        parent = os.getppid()
        if parent == 1:  # already handed to init: whoever started us is gone
            _exit_now(who, "the process that started it is gone", LAUNCHER_GONE)
    else:
        try:
            parent = int(spec)
        except ValueError:
            raise ValueError(f"{EXIT_WITH_PARENT}={spec!r}: expected the launcher's pid or 'any'") from None
        set_parent_death_signal(signal.SIGKILL)
        # After the request, not before: a launcher that died in between is caught here.
        if os.getppid() != parent:
            _exit_now(who, f"its launcher (pid {parent}) is gone", LAUNCHER_GONE)
    thread = threading.Thread(target=_watch_parent, args=(parent, who, poll_s), name="neox-parent-watch",
                              daemon=True)
    thread.start()
    return thread


def _watch_parent(parent: int, who: str, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    _exit_now(who, f"its launcher (pid {parent}) is gone", LAUNCHER_GONE)


def exit_hard_on_repeated_stop(grace_s: Optional[float], who: str) -> Optional[threading.Thread]:
    """Watch the signals' wakeup fd; None where it cannot be had (not the main thread, or an event
    loop already owns it: then that loop's process keeps Python's behaviour)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C handler must never block
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return None
    # A forked child (a data worker) keeps the wakeup fd and, with it, the parent's pipe: its own
    # SIGTERMs would count as the parent's. It keeps Python's behaviour instead.
    os.register_at_fork(after_in_child=lambda: signal.set_wakeup_fd(-1))
    thread = threading.Thread(target=_watch_stop_signals, args=(read_fd, grace_s, who), name="neox-stop-watch",
                              daemon=True)
    thread.start()
    return thread


def _watch_stop_signals(fd: int, grace_s: Optional[float], who: str) -> None:
    first: Optional[int] = None
    deadline = None
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            _exit_now(who, f"still running {grace_s:g} s after {signal.Signals(first).name} "
                           "(blocked where its handler cannot run, e.g. a collective); exiting hard", 128 + first)
        for signum in os.read(fd, 64):
            if signum not in HARD_STOP_SIGNALS:
                continue
            if first is not None:
                _exit_now(who, f"second stop signal ({signal.Signals(signum).name}); exiting hard", 128 + signum)
            first = signum
            deadline = None if grace_s is None else time.monotonic() + grace_s


def _exit_now(who: str, why: str, code: int) -> None:
    """One line naming why, then out, without unwinding: the main thread may be stuck in C++."""
    try:
        os.write(2, f"{who}: {why}; exit code {code}\n".encode())
    except OSError:  # the launcher held the other end of stderr
        pass
    os._exit(code)
