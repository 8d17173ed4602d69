"""Progress of long work: a tqdm bar on a terminal, plain periodic lines when the output is a file.

A bar redraws one line with carriage returns, which a log file (Slurm's ``%x-%j.out``, CI, ``| tee``)
keeps as one ever-growing line. So when the stream is not a terminal the same progress is printed as
whole lines: one each time another ``percent_step`` percent of the total is done or ``interval_s``
seconds passed since the last line, whichever comes first, and a last one when the work ends. Both
forms show the count, the rate and, when the total is known, the ETA:

    tokenizing: 40% (3.81 MiB/9.53 MiB) | 1.90 MiB/s | ETA 0m03s
    tokenizing: done, 9.53 MiB in 0m05s (1.91 MiB/s)

Work that ends within ``delay_s`` seconds prints nothing, so a caller can wrap work that is usually
quick (a small dataset, a cached index) without adding lines to every run.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional, TextIO

from megatron.logging.metrics import format_bytes, format_duration


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def _has_width(stream: TextIO) -> bool:
    """Whether the terminal reports its width: a pseudo-terminal nobody sized (``script``, some
    ``docker exec -t``) says 0 x 0, and tqdm then hides the bar (it fits no row)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


class Progress:
    """Counts work done out of ``total`` (None: unknown) in ``unit`` (a plural noun, or bytes).

    Use as a context manager, or call :meth:`close`; ``update(n)`` adds ``n``, ``advance_to(n)`` sets
    the count (for work measured as a position, e.g. bytes read). ``clock`` is for tests.
    """

    def __init__(self, desc: str, total: Optional[float] = None, unit: str = "items", *,
                 bytes_unit: bool = False, stream: Optional[TextIO] = None, percent_step: float = 10.0,
                 interval_s: float = 30.0, delay_s: float = 0.0, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.desc = desc
        self.total = total if total is None or total > 0 else None
        self.unit = "B" if bytes_unit else unit
        self.bytes_unit = bytes_unit
        self.stream = stream if stream is not None else sys.stderr
        self.percent_step = percent_step
        self.interval_s = interval_s
        self.delay_s = delay_s
        self.clock = clock
        self.n = 0.0
        self._start = self._last_line = clock()
        self._next_percent = percent_step
        self._printed = False
        self._closed = False
        self._bar = None
        self.mode = "off" if not enabled else "bar" if is_terminal(self.stream) else "lines"
        if self.mode == "bar":
            from tqdm import tqdm
            sized = _has_width(self.stream)
            self._bar = tqdm(total=self.total, desc=desc, unit=self.unit, unit_scale=bytes_unit,
                             unit_divisor=1024 if bytes_unit else 1000, file=self.stream, delay=delay_s,
                             dynamic_ncols=sized, ncols=None if sized else 100,
                             nrows=None if sized else 24, leave=True)

    # -- counting -----------------------------------------------------------------------------------
    def update(self, n: float = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "lines":
            self._maybe_line()

    def advance_to(self, n: float) -> None:
        if n > self.n:
            self.update(n - self.n)

    def set_description(self, desc: str) -> None:
        self.desc = desc
        if self._bar is not None:
            self._bar.set_description_str(desc)

    def write(self, message: str) -> None:
        """Print a line of its own without breaking the bar."""
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        elif self.mode == "lines":
            print(message, file=self.stream, flush=True)

    def close(self, finished: bool = True) -> None:
        """End the display; ``finished=False`` (an exception) leaves out the final line."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "lines" and finished and (self._printed or self._elapsed() >= self.delay_s):
            self._print(self._final_line())

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)

    # -- plain lines ----------------------------------------------------------------------------------
    def _elapsed(self) -> float:
        return max(self.clock() - self._start, 0.0)

    def _maybe_line(self) -> None:
        now = self.clock()
        if now - self._start < self.delay_s:
            return
        percent = 100.0 * self.n / self.total if self.total else None
        if (percent is not None and percent >= self._next_percent) or now - self._last_line >= self.interval_s:
            self._last_line = now
            if percent is not None:  # the next line at the next multiple of percent_step above this one
                self._next_percent = (percent // self.percent_step + 1) * self.percent_step
            if percent is None or percent < 100:  # 100% is said by the final line
                self._print(self._line())

    def _print(self, line: str) -> None:
        self._printed = True
        print(line, file=self.stream, flush=True)

    def _amount(self, value: float) -> str:
        if self.bytes_unit:
            return format_bytes(value)
        return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"

    def _rate(self) -> str:
        rate = self.n / max(self._elapsed(), 1e-9)
        return f"{format_bytes(rate)}/s" if self.bytes_unit else f"{rate:,.1f} {self.unit}/s"

    def _line(self) -> str:
        if not self.total:
            return (f"{self.desc}: {self._amount(self.n)}{'' if self.bytes_unit else ' ' + self.unit} | "
                    f"{self._rate()} | {format_duration(self._elapsed())} elapsed")
        elapsed = self._elapsed()
        eta = elapsed / self.n * (self.total - self.n) if self.n > 0 else None
        count = (f"{self._amount(self.n)}/{self._amount(self.total)}"
                 + ("" if self.bytes_unit else f" {self.unit}"))
        return (f"{self.desc}: {100.0 * self.n / self.total:.0f}% ({count}) | {self._rate()} | "
                f"ETA {format_duration(eta) if eta is not None else '?'}")

    def _final_line(self) -> str:
        amount = self._amount(self.n) + ("" if self.bytes_unit else f" {self.unit}")
        return f"{self.desc}: done, {amount} in {format_duration(self._elapsed())} ({self._rate()})"
