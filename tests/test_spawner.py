"""megatron/launch/spawner.py: exits in the order they happen, a stop that ends even a process that
ignores SIGTERM, and a context manager that leaves nothing running."""
from __future__ import annotations

import signal
import sys
import time

import pytest

from megatron.launch.spawner import PIPE, RankCommand, RankProcesses, exit_code_of


def python(code: str, **kw) -> RankCommand:
    return RankCommand([sys.executable, "-c", code], **kw)


def test_the_rank_that_failed_first_is_named_not_the_lowest():
    # A poll loop visiting ranks in order would see rank 0's exit first once both have ended.
    commands = [python("import time, sys; time.sleep(1.0); sys.exit(1)"),
                python("import time; time.sleep(60)"),
                python("import sys; sys.exit(3)")]
    with RankProcesses(grace_s=2.0) as ranks:
        ranks.start_all(commands)
        first = ranks.first_failure(timeout_s=20, tick_s=0.05)
        assert (first.rank, first.returncode) == (2, 3)
        second = ranks.next_exit(timeout=20)  # rank 0 fails too, later
        assert (second.rank, second.returncode) == (0, 1)
        stopped = ranks.stop()
        ended = ranks.wait_all(timeout_s=5)
    assert stopped == {1}
    assert {rank: e.returncode for rank, e in ended.items()} == {0: 1, 1: -signal.SIGTERM, 2: 3}
    assert ended[2].at < ended[0].at < ended[1].at
    assert [exit_code_of(ended[r].returncode) for r in range(3)] == [1, 128 + signal.SIGTERM, 3]


def test_stop_kills_a_process_that_ignores_sigterm_after_the_grace_time():
    ignore = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "print('ready', flush=True); time.sleep(60)")
    with RankProcesses() as ranks:
        proc = ranks.start(python(ignore, output=PIPE))
        assert proc.stdout.readline() == b"ready\n"  # the handler is in place
        start = time.monotonic()
        assert ranks.stop(grace_s=0.5) == {0}
        took = time.monotonic() - start
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert 0.4 < took < 5


def test_clean_codes_and_all_done():
    with RankProcesses() as ranks:
        ranks.start_all([python("import sys; sys.exit(0)"), python("import sys; sys.exit(75)")])
        assert ranks.first_failure(timeout_s=20, clean_codes=(0, 75), tick_s=0.05) is None
    assert sorted(e.returncode for e in ranks.ended.values()) == [0, 75]


def test_timeout_and_the_context_manager_stops_survivors():
    with pytest.raises(TimeoutError):
        with RankProcesses(grace_s=1.0) as ranks:
            proc = ranks.start(python("import time; time.sleep(60)"))
            ranks.first_failure(timeout_s=0.3, tick_s=0.05)
    assert proc.returncode == -signal.SIGTERM


def test_output_to_a_file_environment_and_working_folder(tmp_path):
    log = tmp_path / "rank0.log"
    code = "import os, sys; print(os.getcwd(), os.environ['MARK']); print('oops', file=sys.stderr)"
    with RankProcesses() as ranks:
        ranks.start(python(code, env={"MARK": "m1"}, output=log, cwd=tmp_path))
        assert ranks.first_failure(timeout_s=20, tick_s=0.05) is None
    assert sorted(log.read_text().split()) == sorted([str(tmp_path), "m1", "oops"])


def test_a_command_that_cannot_start_raises_and_leaves_nothing_running():
    with pytest.raises(OSError):
        with RankProcesses(grace_s=1.0) as ranks:
            first = ranks.start(python("import time; time.sleep(60)"))
            ranks.start(RankCommand(["/nonexistent/program"]))
    assert first.returncode == -signal.SIGTERM


def test_forwarded_signals_reach_every_rank():
    trap = ("import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: sys.exit(7)); "
            "print('ready', flush=True); time.sleep(60)")
    before = signal.getsignal(signal.SIGUSR1)
    with RankProcesses(grace_s=1.0) as ranks, ranks.forwarding([signal.SIGUSR1]):
        procs = [ranks.start(python(trap, output=PIPE)) for _ in range(2)]
        for proc in procs:
            assert proc.stdout.readline() == b"ready\n"
        signal.raise_signal(signal.SIGUSR1)
        ended = ranks.wait_all(timeout_s=10)
    assert {r: e.returncode for r, e in ended.items()} == {0: 7, 1: 7}
    assert signal.getsignal(signal.SIGUSR1) is before  # the handler is put back
    for proc in procs:
        proc.stdout.close()
