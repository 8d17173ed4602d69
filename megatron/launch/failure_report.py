"""What the local launcher says when a run fails: the rank that failed first and why, once; then one
line per other rank saying what stopped it; then where every rank's full output is.

When one rank dies, every peer's next collective fails too ("Connection reset by peer") and each
peer prints a traceback of its own: at 4 ranks that is ~150 lines, none of them the cause. So the
root cause is the earliest failure that is neither a peer failure nor the effect of deepy stopping
the rank, and the others are reduced to the one line that says how they ended. Pure functions of
what the launcher recorded, so the wording is tested without processes.
"""
from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

TORCH_PREFIX = re.compile(r"^\[rank\d+\]:\s?")  # torch.distributed prefixes a rank's uncaught traceback
TRACEBACK = re.compile(r"^Traceback \(most recent call last\):")
CHAINED = re.compile(r"^(During handling of the above exception|The above exception was the direct cause)")
# `SomeError: message` at the start of a line, as Python ends a traceback; `error: ...` is user_errors().
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)|error)(?::\s.*)?$")
# What a collective reports when a peer is gone (gloo, NCCL, the TCP store).
PEER_GONE = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|Connection refused|remote process exited"
                       r"|NCCL communicator was aborted|ncclRemoteError|[Tt]imed out|Socket Timeout")
MAX_ERROR_CHARS = 200


def strip_torch_prefix(text: str) -> str:
    return TORCH_PREFIX.sub("", text, count=1)


def starts_traceback(text: str) -> bool:
    return bool(TRACEBACK.match(strip_torch_prefix(text)))


class FirstError:
    """Fed a rank's stderr line by line: the first exception line of its latest traceback (a chained
    traceback, "During handling of the above exception...", counts as one: its first exception is
    the original), else its first `error: ...` line. That is what went wrong on the rank, in one line."""

    def __init__(self):
        self.line: Optional[str] = None
        self._chained = False

    def feed(self, text: str) -> None:
        text = strip_torch_prefix(text).rstrip()
        if TRACEBACK.match(text):
            if not self._chained:
                self.line = None
            self._chained = False
        elif CHAINED.match(text):
            self._chained = True
        elif self.line is None and EXCEPTION_LINE.match(text):
            self.line = text


def peer_failure(error: Optional[str]) -> Optional[str]:
    """`gloo: Connection reset by peer` when `error` says a peer is gone, else None."""
    found = PEER_GONE.search(error or "")
    if found is None:
        return None
    lower = error.lower()
    backend = "gloo" if "gloo" in lower else "nccl" if "nccl" in lower else None
    return f"{backend}: {found.group(0)}" if backend else found.group(0)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass(frozen=True)
class RankEnd:
    """How one rank of a failed run ended, as the launcher saw it."""
    rank: int
    returncode: int
    ended_at: float  # time.monotonic() when the launcher reaped it
    stopped: bool  # still running when the run failed, so deepy signalled it
    error: Optional[str] = None  # FirstError of its stderr
    last_output: Optional[str] = None  # its last non-blank stdout line: where it was


def root_cause(ends: Sequence[RankEnd]) -> RankEnd:
    """The earliest failure of the rank's own, else the earliest. A failure is not its own when the
    rank reports a peer gone, or when deepy had signalled it and it reports nothing (its death is
    deepy's SIGTERM/SIGKILL). A signalled rank with an error of its own may have been dying of it
    already: exits are seen only when the process is gone, not when its error is printed."""
    failed = sorted((e for e in ends if e.returncode != 0), key=lambda e: e.ended_at)
    own = [e for e in failed if peer_failure(e.error) is None and not (e.stopped and e.error is None)]
    return (own or failed)[0]


def headline(root: RankEnd, world: int) -> str:
    """`deepy: rank 1 exited with code 1 (ValueError: ...); stopped the other 3 ranks`: the error
    named even when the exit says little (gloo's teardown can turn an exception into SIGABRT)."""
    others = world - 1
    error = f" ({_short(root.error)})" if root.error else ""
    stopped = f"; stopped the other {others} rank{'s' if others != 1 else ''}" if others else ""
    return f"deepy: rank {root.rank} {describe_exit(root.returncode)}{error}{stopped}"


def where_it_was(root: RankEnd, ends: Sequence[RankEnd]) -> Optional[str]:
    """The root's last output line, else rank 0's (the progress line): the phase the run was in."""
    if root.last_output:
        return f"deepy: rank {root.rank}'s last output line: {root.last_output}"
    main = next((e for e in ends if e.rank == 0 and e.last_output), None)
    if main is not None:
        return f"deepy: the run's last output line (rank 0): {main.last_output}"
    return None


def how_it_ended(end: RankEnd, root: RankEnd) -> str:
    """One line for a rank other than the root."""
    if end.returncode == 0:
        return f"deepy: rank {end.rank}: had finished"
    cause = f"rank {root.rank} {'died' if root.returncode < 0 else 'failed'}"
    peer = peer_failure(end.error)
    if peer:
        return f"deepy: rank {end.rank}: stopped after {cause} ({peer})"
    if end.stopped:
        why = _short(end.error) if end.error else _by_deepy(end.returncode)
        return f"deepy: rank {end.rank}: stopped after {cause} ({why})"
    if end.error and end.error == root.error:
        return f"deepy: rank {end.rank}: failed too, with the same error"
    detail = f" ({_short(end.error)})" if end.error else ""
    return f"deepy: rank {end.rank}: failed too: {describe_exit(end.returncode)}{detail}"


def where_the_logs_are(folder: Path, world: int) -> str:
    names = "rank0.log" if world == 1 else f"rank0.log .. rank{world - 1}.log"
    return f"deepy: every rank's full output: {folder}/ ({names})"


def _by_deepy(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"{signal.Signals(-returncode).name} from deepy"
        except ValueError:
            pass
    return describe_exit(returncode)


def _short(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."
