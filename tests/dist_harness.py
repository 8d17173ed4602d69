"""Run a function on N gloo ranks in fresh processes and collect what each rank returned.

Why it is built this way (FIELD_NOTES, "PyTorch 2.13 and gloo"): every rank writes its result to a
file *before* ``destroy_process_group()``, and the test judges by the files, so a teardown that hangs
or aborts after the work is done cannot fail a test; the process-group timeout is 300 s; ranks
rendezvous through a FileStore in the test's temporary folder (no port to collide with other test
runs on the machine); stragglers are killed after a grace period once all results are in.

Usage: ``run_ranks("test_engine:_worker", 4, tmp_path, preset="zero_topo")`` calls
``_worker(rank=r, world_size=4, preset="zero_topo")`` on every rank and returns the list of results.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

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
    procs = []
    for rank in range(world_size):
        cmd = [sys.executable, str(Path(__file__).resolve()), target, str(rank), str(world_size), str(workdir)]
        log = open(workdir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT), log))
    results_paths = [workdir / f"rank{r}.result.pt" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    checked: set[int] = set()
    failed = False
    try:
        while time.monotonic() < deadline and not failed:
            if all(p.exists() for p in results_paths):
                break
            for rank, path in enumerate(results_paths):
                if rank not in checked and path.exists():
                    checked.add(rank)
                    # A rank that raised leaves its peers blocked in a collective until the
                    # process-group timeout: stop waiting for them.
                    failed = failed or not torch.load(path, weights_only=False)["ok"]
            if any(proc.poll() not in (None, 0) and not results_paths[r].exists()
                   for r, (proc, _) in enumerate(procs)):
                break  # a rank died without a result: no point waiting for the others
            time.sleep(0.05)
        grace_end = time.monotonic() + (2.0 if failed else grace_s)
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(grace_end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    results = []
    # Report the rank that failed first (its peers' errors are usually consequences).
    failures = sorted((path.stat().st_mtime, rank) for rank, path in enumerate(results_paths)
                      if path.exists() and not torch.load(path, weights_only=False)["ok"])
    if failures:
        rank = failures[0][1]
        raise RankFailure(f"rank {rank} of {world_size} raised in {target} (first of ranks "
                          f"{[r for _, r in failures]}):\n{torch.load(results_paths[rank], weights_only=False)['error']}")
    for rank, path in enumerate(results_paths):
        if not path.exists():
            tail = (workdir / f"rank{rank}.log").read_text()[-4000:]
            raise RankFailure(f"rank {rank} of {world_size} wrote no result ({target}); its log ends:\n{tail}")
        results.append(torch.load(path, weights_only=False)["result"])
    return results


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


if __name__ == "__main__":
    _child_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
