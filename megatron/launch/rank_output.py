"""The local launcher's copy of one rank's output: to the console line by line (stdout to stdout,
stderr to stderr, so lines of different ranks never mix: rank 0 as is, the others prefixed
`[rank k]`, live or only if that rank fails), and all of it to the rank's log file.

Two things are held back from the console, because a failure report will say them better:
- a traceback on stderr: it usually means the rank is about to exit, and when a peer died first it
  is a consequence (the report gives it one line). It is shown as usual if the run is still fine
  `hold_s` after it began (a rank that printed a handled error and went on);
- everything after the run has failed (`quiet()`).
The lines the console has not seen stay in `unshown` (the last `keep`), for the report.
"""
from __future__ import annotations

import collections
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional, TextIO

from megatron.launch.failure_report import FirstError, starts_traceback


class RankOutput:
    def __init__(self, rank: int, proc: subprocess.Popen, console: TextIO, errors: TextIO,
                 console_lock: threading.Lock, live: bool, log_path: Path, keep: int = 200,
                 hold_s: float = 5.0):
        self.rank = rank
        self.prefix = f"[rank {rank}] " if rank else ""
        self.console_lock, self.live, self.hold_s = console_lock, live, hold_s
        self.log_path = log_path
        self._log = open(log_path, "w", encoding="utf-8", buffering=1)  # line-buffered: whole even if deepy is killed
        self._state = threading.Lock()  # the two pumps and the launcher's thread share what follows
        self.unshown: collections.deque = collections.deque(maxlen=keep)
        self.error = FirstError()
        self.last_output: Optional[str] = None
        self._held_since: Optional[float] = None
        self._quiet = False
        self.threads = [threading.Thread(target=self._pump, args=(stream, target, is_stderr), daemon=True)
                        for stream, target, is_stderr in ((proc.stdout, console, False), (proc.stderr, errors, True))]
        for thread in self.threads:
            thread.start()

    def _pump(self, stream, target: TextIO, is_stderr: bool) -> None:
        for raw in iter(stream.readline, b""):
            text = raw.decode("utf-8", "replace").rstrip("\n")
            line = self.prefix + text
            with self._state:
                if not self._log.closed:
                    self._log.write(text + "\n")
                if is_stderr:
                    self.error.feed(text)
                    if self.live and self._held_since is None and starts_traceback(text):
                        self._held_since = time.monotonic()
                elif text.strip():
                    self.last_output = text
                show = self.live and not self._quiet and not (is_stderr and self._held_since is not None)
                if not show:
                    self.unshown.append((target, line))
            if show:
                self.write([(target, line)])
        stream.close()

    def write(self, lines) -> None:
        with self.console_lock:
            for target, line in lines:
                target.write(line + "\n")  # one write per line: atomic even on an unbuffered stream
                target.flush()

    def quiet(self) -> None:
        """The run failed: nothing more of this rank goes to the console (the report speaks for it)."""
        with self._state:
            self._quiet = True

    def release_stale_hold(self, now: float) -> None:
        """A traceback held `hold_s` while the run goes on was not a dying rank's: show it."""
        if self._held_since is not None and now - self._held_since >= self.hold_s:
            self.release_hold()

    def release_hold(self) -> None:
        """Show the held lines (the run did not fail)."""
        with self._state:
            if self._held_since is None or self._quiet:
                return
            lines = list(self.unshown)
            self.unshown.clear()
            self._held_since = None
        self.write(lines)

    def finish(self) -> None:
        """Wait for the pipes to drain (the process has exited) and close the log."""
        for thread in self.threads:
            thread.join(timeout=5.0)
        with self._state:
            self._log.close()
