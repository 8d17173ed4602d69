"""Run a function on N gloo ranks in fresh processes and collect what each rank returned.

Why it is built this way (FIELD_NOTES, "PyTorch 2.13 and gloo"): every rank writes its result to a
file *before* ``destroy_process_group()``, and the test judges by the files, so a teardown that hangs
or aborts after the work is done cannot fail a test; the process-group timeout is 300 s; ranks
rendezvous through a FileStore in the test's temporary folder (no port to collide with other test
runs on the machine); stragglers are killed after a grace period once all results are in. The failure
reported is that of the first rank that raised or died without a result (one whose error only says a
peer is gone counts last).

The ranks are forked from one process (the forker) that imports torch, torch._dynamo (which
torch.optim imports on first use) and the worker's module once: on 2 cores those imports cost ~3.5
CPU-seconds a process, ~14 s of the start of 8 fresh ranks. The forker is started, watched and
stopped by megatron/launch/spawner.py; the ranks stay in its process group, so stopping it stops
them, and it writes each rank's exit code and time (``rank{r}.exit``) as it reaps them. A rank forked
this way is still a process of its own: a worker may patch module state on its rank only.

Usage: ``run_ranks("test_engine:_worker", 4, tmp_path, preset="zero_topo")`` calls
``_worker(rank=r, world_size=4, preset="zero_topo")`` on every rank and returns the list of results.
"""
from __future__ import annotations

import contextlib
import os
import sys
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
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    forker_command = RankCommand([sys.executable, str(Path(__file__).resolve()), target, str(world_size),
                                  str(workdir)], env, output=workdir / "forker.log", cwd=REPO_ROOT)
    results_paths = [workdir / f"rank{r}.result.pt" for r in range(world_size)]
    exit_paths = [workdir / f"rank{r}.exit" for r in range(world_size)]
    with RankProcesses() as forker:
        forker.start(forker_command)
        deadline = time.monotonic() + timeout_s
        ok: dict[int, bool] = {}  # rank -> its result's "ok", read once
        failed = forker_ended = False
        while (time.monotonic() < deadline and not failed and not forker_ended
               and not all(p.exists() for p in results_paths)):
            forker.next_exit(timeout=0.05)
            for rank, path in enumerate(results_paths):
                if rank not in ok and path.exists():
                    ok[rank] = torch.load(path, weights_only=False)["ok"]
            # A rank that raised leaves its peers blocked in a collective until the process-group
            # timeout, and one that died without a result leaves nothing to wait for: stop waiting.
            failed = not all(ok.values()) or any(not results_paths[r].exists() for r in _exits(exit_paths))
            forker_ended = bool(forker.ended)  # it ends after its last rank (or was killed): nothing more comes
        _wait_for_exits(forker, exit_paths, timeout_s=2.0 if failed else grace_s)
        died = {rank: at for rank, (_, at) in _exits(exit_paths).items() if not results_paths[rank].exists()}
        forker.stop(grace_s=0)  # the stragglers: their results, if any, are safe on disk
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


def _wait_for_exits(forker: RankProcesses, exit_paths: list[Path], timeout_s: float) -> None:
    """Until every rank has exited, the forker has ended, or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not forker.ended and not all(p.exists() for p in exit_paths):
        forker.next_exit(timeout=0.05)


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
    """Import once, fork the ranks, reap them; each rank's output goes to rank{r}.log."""
    import importlib

    import torch._dynamo  # noqa: F401 - torch.optim's first use imports it: once here, not once per rank
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
        tmp = workdir / f"rank{rank}.exit.tmp"
        tmp.write_text(f"{os.waitstatus_to_exitcode(status)} {time.time()}\n")
        os.replace(tmp, workdir / f"rank{rank}.exit")


if __name__ == "__main__":
    _forker_main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
