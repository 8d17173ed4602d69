"""Run a function on N gloo ranks in fresh processes and collect what each rank returned.

Why it is built this way (gloo under PyTorch 2.13, as measured on this project's CI machines): every
rank writes its result to a file *before* ``destroy_process_group()``, and the test judges by the
files, so a teardown that hangs or aborts after the work is done cannot fail a test; the
process-group timeout is 300 s; ranks rendezvous through a FileStore in the test's temporary folder
(no port to collide with other test runs on the machine); stragglers are killed after a grace period
once all results are in. The failure reported is that of the first rank that raised or died without
a result (one whose error only says a peer is gone counts last).

The ranks are forked, not started afresh: torch and torch._dynamo (which torch.optim imports on
first use) cost ~3 CPU-seconds a process to import, ~12 s of the start of 8 fresh ranks on 2 cores.
One process per pytest session, the zygote, imports them once; it is started and stopped by
megatron/launch/spawner.py (and ends by itself when its parent does). For each launch it forks a
forker, which leads a session of its own (``forker.pid``), imports the worker's module, forks the
ranks and writes each rank's exit code and time (``rank{r}.exit``) as it reaps them; the zygote
writes ``forker.exit`` when the forker has ended. Stopping the forker's process group stops its
ranks. A rank forked this way is still a process of its own: a worker may patch module state on its
rank only.

Usage: ``run_ranks("test_engine:_worker", 4, tmp_path, preset="zero_topo")`` calls
``_worker(rank=r, world_size=4, preset="zero_topo")`` on every rank and returns the list of results.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

from megatron.launch.failure_report import FirstError, peer_failure
from megatron.launch.spawner import RankCommand, RankProcesses

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
PG_TIMEOUT_S = 300


class RankFailure(AssertionError):
    """A rank raised, or did not write its result in time; the message carries its traceback."""


def run_ranks(target: str, world_size: int, workdir: Path, timeout_s: float = 600, grace_s: float = 20,
              **kwargs) -> list[Any]:
    """Run ``module:function`` on ``world_size`` ranks; return each rank's result (index = rank).

    Raises RankFailure with the first failing rank's traceback. A result that is an exception a
    worker chose to return (not raise) is returned as is, so expected-error tests can inspect it.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "store"
    if store.exists():
        store.unlink()
    torch.save(kwargs, workdir / "kwargs.pt")
    results_paths = [workdir / f"rank{r}.result.pt" for r in range(world_size)]
    exit_paths = [workdir / f"rank{r}.exit" for r in range(world_size)]
    forker_ended = workdir / "forker.exit"
    for stale in (*exit_paths, forker_ended, workdir / "forker.pid"):
        stale.unlink(missing_ok=True)
    _ZYGOTE.launch(target, world_size, workdir, _rank_env())
    try:
        deadline = time.monotonic() + timeout_s
        ok: dict[int, bool] = {}  # rank -> its result's "ok", read once
        failed = False
        # The forker ends after its last rank (or was killed): then nothing more comes.
        while (time.monotonic() < deadline and not failed and not forker_ended.exists()
               and not all(p.exists() for p in results_paths)):
            time.sleep(0.05)
            for rank, path in enumerate(results_paths):
                if rank not in ok and path.exists():
                    ok[rank] = torch.load(path, weights_only=False)["ok"]
            # A rank that raised leaves its peers blocked in a collective until the process-group
            # timeout, and one that died without a result leaves nothing to wait for: stop waiting.
            failed = not all(ok.values()) or any(not results_paths[r].exists() for r in _exits(exit_paths))
        _wait_for_exits(forker_ended, exit_paths, timeout_s=2.0 if failed else grace_s)
        died = {rank: at for rank, (_, at) in _exits(exit_paths).items() if not results_paths[rank].exists()}
    finally:
        _stop_forker(workdir)  # the stragglers: their results, if any, are safe on disk
    raised = _raised(results_paths)
    first = _first_failure(raised, died)
    if first in raised:
        order = sorted(raised, key=lambda rank: raised[rank][0])
        raise RankFailure(f"rank {first} of {world_size} raised in {target} (first of ranks {order}):\n"
                          f"{raised[first][1]}")
    if first is not None:
        raise RankFailure(_no_result(first, world_size, target, workdir,
                                     f"exited with code {_exits(exit_paths)[first][0]} and wrote no result"))
    results = []
    for rank, path in enumerate(results_paths):
        if not path.exists():
            raise RankFailure(_no_result(rank, world_size, target, workdir, "wrote no result"))
        results.append(torch.load(path, weights_only=False)["result"])
    return results


def _exits(exit_paths: list[Path]) -> dict[int, tuple[int, float]]:
    """rank -> (exit code, Popen-style: -N for signal N; time.time() when the forker reaped it)."""
    out = {}
    for rank, path in enumerate(exit_paths):
        if path.exists():
            code, at = path.read_text().split()
            out[rank] = (int(code), float(at))
    return out


def _wait_for_exits(forker_ended: Path, exit_paths: list[Path], timeout_s: float) -> None:
    """Until every rank has exited, the forker has ended, or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not forker_ended.exists() and not all(p.exists() for p in exit_paths):
        time.sleep(0.05)


def _stop_forker(workdir: Path) -> None:
    """SIGKILL the forker's process group (its ranks) unless it has ended. Its pid cannot have been
    reused meanwhile: the zygote reaps it only just before it writes forker.exit."""
    pid_file = workdir / "forker.pid"
    deadline = time.monotonic() + 30
    while not pid_file.exists() and not (workdir / "forker.exit").exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # a launch stopped at once: let the forker say who it is
    if pid_file.exists() and not (workdir / "forker.exit").exists():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def _rank_env() -> dict:
    """The environment of the ranks (and of the zygote they come from): this process's, one thread."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))


class _Zygote:
    """The session's zygote (see the module's docstring), started on first use and again if it has
    died; requests go through files in its mailbox folder."""

    def __init__(self):
        self._processes: Optional[RankProcesses] = None
        self._mailbox: Optional[Path] = None
        self._owner = os.getpid()  # a forked test process must not stop its parent's zygote
        self._lock = threading.Lock()
        self._requests = 0

    def launch(self, target: str, world_size: int, workdir: Path, env: dict) -> None:
        with self._lock:
            if self._processes is None or self._processes.procs[0].poll() is not None:
                self._start()
            self._requests += 1
            request = self._mailbox / f"{self._requests:06d}.request"
            request.with_suffix(".tmp").write_text(json.dumps(
                {"target": target, "world_size": world_size, "workdir": str(workdir), "env": env}))
            os.replace(request.with_suffix(".tmp"), request)

    def _start(self) -> None:
        self.stop()
        self._mailbox = Path(tempfile.mkdtemp(prefix="dist_harness_zygote_"))
        self._processes = RankProcesses()
        self._processes.start(RankCommand([sys.executable, str(Path(__file__).resolve()), str(self._mailbox)], _rank_env(),
                                          output=self._mailbox / "zygote.log", cwd=REPO_ROOT))

    def stop(self) -> None:
        if self._processes is not None and os.getpid() == self._owner:
            self._processes.stop(grace_s=2.0)
            self._processes.close()
            shutil.rmtree(self._mailbox, ignore_errors=True)  # its requests and zygote.log
        self._processes = None


_ZYGOTE = _Zygote()
atexit.register(_ZYGOTE.stop)


def _raised(results_paths: list[Path]) -> dict[int, tuple[float, str]]:
    """rank -> (when it wrote its result: the file's mtime, the traceback) for each rank that raised."""
    out = {}
    for rank, path in enumerate(results_paths):
        payload = torch.load(path, weights_only=False) if path.exists() else {"ok": True}
        if not payload["ok"]:
            out[rank] = (path.stat().st_mtime, payload["error"])
    return out


def _first_failure(raised: dict[int, tuple[float, str]], died: dict[int, float]) -> Optional[int]:
    """The rank to blame: the first to raise or die, except that a rank whose error says a peer is gone
    (gloo's "Connection closed by peer") comes after every other failure, as in deepy's report
    (megatron/launch/failure_report.py): it raises within milliseconds of the death it reports,
    sooner than that death is seen, and a file's time is coarse."""
    def consequence(traceback_text: str) -> bool:
        error = FirstError()
        for line in traceback_text.splitlines():
            error.feed(line)
        return peer_failure(error.line) is not None
    failures = [(consequence(error), when, rank) for rank, (when, error) in raised.items()]
    failures += [(False, when, rank) for rank, when in died.items()]
    return min(failures)[2] if failures else None


def _no_result(rank: int, world_size: int, target: str, workdir: Path, what: str) -> str:
    tail = (workdir / f"rank{rank}.log").read_text()[-4000:]
    return f"rank {rank} of {world_size} {what} ({target}); its log ends:\n{tail}"


def _child_main(target: str, rank: int, world_size: int, workdir: Path) -> None:
    from datetime import timedelta

    import importlib

    import torch.distributed as dist

    torch.set_num_threads(1)
    kwargs = torch.load(workdir / "kwargs.pt", weights_only=False)
    module_name, _, fn_name = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
        dist.init_process_group("gloo", init_method=f"file://{workdir / 'store'}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT_S))
        payload = {"ok": True, "result": fn(rank=rank, world_size=world_size, **kwargs)}
    except BaseException:  # noqa: BLE001 - everything a rank raises is reported to the test
        payload = {"ok": False, "error": traceback.format_exc()}
    tmp = workdir / f"rank{rank}.result.pt.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, workdir / f"rank{rank}.result.pt")
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        os._exit(0)


def _forker_main(target: str, world_size: int, workdir: Path) -> None:
    """Import the worker's module, fork the ranks, reap them; each rank's output goes to rank{r}.log."""
    import importlib

    with contextlib.suppress(BaseException):  # each rank imports it again and reports the error as its own
        importlib.import_module(target.partition(":")[0])
    sys.stdout.flush()
    sys.stderr.flush()
    ranks_by_pid = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            try:
                log = os.open(workdir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.close(log)
                _child_main(target, rank, world_size, workdir)  # ends the process itself
            except BaseException:  # noqa: BLE001 - a rank that could not start: the forker must not go on
                traceback.print_exc()
            os._exit(1)
        ranks_by_pid[pid] = rank
    while ranks_by_pid:
        pid, status = os.wait()
        rank = ranks_by_pid.pop(pid)
        _write_atomically(workdir / f"rank{rank}.exit", f"{os.waitstatus_to_exitcode(status)} {time.time()}\n")


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _start_forker(request: dict) -> None:
    """In a child of the zygote: become the launch's forker. Never returns."""
    try:
        os.setsid()  # a process group of its own, and of its ranks: stopping it stops them
        workdir = Path(request["workdir"])
        log = os.open(workdir / "forker.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        _write_atomically(workdir / "forker.pid", str(os.getpid()))
        os.environ.clear()
        os.environ.update(request["env"])  # this launch's, and its PYTHONPATH for the imports to come
        sys.path[:0] = [entry for entry in request["env"]["PYTHONPATH"].split(os.pathsep)
                        if entry and entry not in sys.path]
        _forker_main(request["target"], request["world_size"], workdir)
    except BaseException:  # noqa: BLE001 - whatever happens, the forker's life ends here
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _zygote_main(mailbox: Path) -> None:
    """Import once; fork a forker per request in `mailbox`; write each forker's forker.exit when it
    ends. Ends when the process that started it has."""
    import torch._dynamo  # noqa: F401 - torch.optim's first use imports it: once here, not once per rank

    parent = os.getppid()
    forkers: dict[int, Path] = {}  # pid -> its launch's folder
    while os.getppid() == parent:
        for name in sorted(os.listdir(mailbox)):
            if not name.endswith(".request"):
                continue
            request = json.loads((mailbox / name).read_text())
            (mailbox / name).unlink()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _start_forker(request)
            forkers[pid] = Path(request["workdir"])
        while forkers:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _write_atomically(forkers.pop(pid) / "forker.exit", f"{os.waitstatus_to_exitcode(status)}\n")
        time.sleep(0.01)


if __name__ == "__main__":
    _zygote_main(Path(sys.argv[1]))
