"""Start rank processes and follow how they end: the one spawner behind deepy's local launcher
(megatron/launch/launcher.py), the multi-rank test harness (tests/dist_harness.py), the parity
benchmark (megatron/benchmarking/peers.py) and the emulated cluster (tools/emulate_cluster.py).

- Every process leads a session of its own (`start_new_session`), so stopping it stops what it
  started too (a compiler, the command `ip netns exec` runs), and a Ctrl-C at the terminal reaches
  only the parent, which stops the ranks itself (the context manager does it on any way out).
- Exits arrive in the order they happen, to the millisecond (one thread per process blocked in
  wait()): a poll loop visiting the ranks in order would name rank 0 when ranks 1 and 0 end in the
  same tick, and a killed rank's peers end within milliseconds of it.
- Stopping is SIGTERM to each survivor's process group, then SIGKILL after a grace time.

Nothing here knows about configs or what the ranks print: the callers word their own reports.
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterable, Iterator, Mapping, Optional, Sequence, Union

PIPE = subprocess.PIPE  # RankCommand.output: stdout and stderr each a pipe of its own, for the caller to read


@dataclass(frozen=True)
class RankCommand:
    """How to start one process: its argv; its full environment (None: this process's); where its
    output goes (None: this process's stdout and stderr; PIPE: proc.stdout and proc.stderr, which the
    caller must drain; a path: both streams into that file, created afresh); its working folder."""
    argv: Sequence[str]
    env: Optional[Mapping[str, str]] = None
    output: Union[None, int, str, Path] = None
    cwd: Union[None, str, Path] = None


@dataclass(frozen=True)
class RankExit:
    rank: int
    returncode: int  # Popen's: -N for a process killed by signal N
    at: float  # time.monotonic() when it was reaped


class RankExits:
    """One thread per process blocked in wait(); `next` hands the exits out in the order they happened."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self.ended: dict[int, RankExit] = {}  # the exits `next` has handed out

    def add(self, rank: int, proc: subprocess.Popen) -> None:
        threading.Thread(target=self._wait, args=(rank, proc), daemon=True).start()

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self._queue.put(RankExit(rank, code, time.monotonic()))

    def next(self, timeout: Optional[float]) -> Optional[RankExit]:
        """The next exit, or None after `timeout` seconds (interruptible: signals reach the caller meanwhile)."""
        try:
            ended = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        self.ended[ended.rank] = ended
        return ended

    def wait_all(self, world: int, timeout_s: float = 30.0) -> dict[int, RankExit]:
        deadline = time.monotonic() + timeout_s
        while len(self.ended) < world and time.monotonic() < deadline:
            self.next(timeout=max(0.0, deadline - time.monotonic()))
        return self.ended


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process's group (it was started with start_new_session: the group id is its pid)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_processes(procs: Sequence[subprocess.Popen], grace_s: float) -> set[int]:
    """SIGTERM each still-running process's group, SIGKILL those still there after the grace time;
    returns the indices of the processes it signalled."""
    alive = {index: p for index, p in enumerate(procs) if p.poll() is None}
    for p in alive.values():
        signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in alive.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(p, signal.SIGKILL)
            p.wait()
    return set(alive)


def exit_code_of(returncode: int) -> int:
    """A shell-style exit code (128 + signal number for a process killed by a signal)."""
    return 128 - returncode if returncode < 0 else returncode


class RankProcesses:
    """The processes of one run; a process's rank is its start order. As a context manager it stops
    whatever still runs on the way out (grace_s), however the block ends, and closes the output files
    it opened."""

    def __init__(self, grace_s: float = 10.0):
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen] = []
        self._exits = RankExits()
        self._files: list = []

    def __enter__(self) -> "RankProcesses":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self.close()

    def start(self, command: RankCommand) -> subprocess.Popen:
        """Start the next rank (OSError when it cannot start; the ranks started before it run on)."""
        stdout = stderr = command.output
        if command.output not in (None, PIPE):
            stdout = open(command.output, "w")
            self._files.append(stdout)
            stderr = subprocess.STDOUT
        proc = subprocess.Popen(list(command.argv), env=None if command.env is None else dict(command.env),
                                stdout=stdout, stderr=stderr, cwd=command.cwd, start_new_session=True)
        self._exits.add(len(self.procs), proc)
        self.procs.append(proc)
        return proc

    def start_all(self, commands: Iterable[RankCommand]) -> list[subprocess.Popen]:
        return [self.start(command) for command in commands]

    @property
    def ended(self) -> Mapping[int, RankExit]:
        """The exits handed out so far (by next_exit, first_failure, wait_all), by rank."""
        return self._exits.ended

    def next_exit(self, timeout: Optional[float]) -> Optional[RankExit]:
        """The next rank to end, in the order they end; None after `timeout` seconds."""
        return self._exits.next(timeout)

    def first_failure(self, timeout_s: Optional[float] = None, *, clean_codes: Collection[int] = (0,),
                      tick_s: float = 0.5, on_tick: Optional[Callable[[], None]] = None) -> Optional[RankExit]:
        """Block until every rank has ended (-> None) or one ends with a code outside `clean_codes`
        (-> that exit, the first such to happen). `on_tick` runs after each wait of at most `tick_s`;
        TimeoutError when `timeout_s` passes first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(self.ended) < len(self.procs):
            wait = tick_s if deadline is None else min(tick_s, max(0.0, deadline - time.monotonic()))
            ended = self.next_exit(wait)
            if ended is not None and ended.returncode not in clean_codes:
                return ended
            if on_tick is not None:
                on_tick()
            if deadline is not None and time.monotonic() >= deadline and len(self.ended) < len(self.procs):
                raise TimeoutError(f"ranks still running after {timeout_s:g} s")
        return None

    def wait_all(self, timeout_s: float = 30.0) -> Mapping[int, RankExit]:
        """Wait up to `timeout_s` for every rank to end; the exits seen (all of them unless time ran out)."""
        return self._exits.wait_all(len(self.procs), timeout_s)

    def stop(self, grace_s: Optional[float] = None) -> set[int]:
        """Stop every rank still running (SIGTERM to its group, SIGKILL after `grace_s`, default the
        constructor's); returns the ranks it signalled."""
        return stop_processes(self.procs, self.grace_s if grace_s is None else grace_s)

    def signal_running(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                signal_group(proc, sig)

    @contextlib.contextmanager
    def forwarding(self, signals: Iterable[int]) -> Iterator[None]:
        """Inside the block, these signals received by this process go on to every running rank's
        group (ranks started meanwhile included). Only the main thread can set handlers: elsewhere
        nothing is forwarded."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, lambda signum, frame: self.signal_running(signum)) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def close(self) -> None:
        """Close the output files this opened (the processes have ended, or write on to the open file)."""
        for handle in self._files:
            handle.close()
        self._files.clear()
