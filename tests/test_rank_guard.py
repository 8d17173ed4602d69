"""megatron/launch/rank_guard.py on small processes: a rank exits when its launcher is gone (already gone at
start, or gone later with no prctl: the watchdog), and a stop signal its handler cannot act on
still ends it (a second SIGTERM, or the grace time after the first)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron.launch.exit_codes import LAUNCHER_GONE
from megatron.launch.rank_guard import EXIT_WITH_PARENT, STOP_GRACE

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics")

# A rank that guards itself, then blocks in C the way a collective whose peer is gone does: a
# self-deadlocked pthread mutex never returns on a signal, so Python's handler never runs.
STUCK_RANK = textwrap.dedent("""\
    import ctypes, os, signal
    from megatron.launch.rank_guard import guard_rank
    guard_rank(os.environ)
    requests = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):  # as the trainer's StopRequest: a request only
        signal.signal(sig, lambda signum, frame: requests.append(signum))
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
    libc.pthread_mutex_lock(mutex)
    print("blocked", flush=True)
    libc.pthread_mutex_lock(mutex)
""")

# Starts a guarded child that sleeps, prints its pid, and exits without waiting for it.
ORPHANING_PARENT = textwrap.dedent("""\
    import os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c",
                              "import os, time; from megatron.launch.rank_guard import guard_rank; "
                              "guard_rank(os.environ); print('ready', flush=True); time.sleep(120)"],
                             stdout=subprocess.PIPE, stderr=open(sys.argv[1], "w"), text=True)
    child.stdout.readline()
    print(child.pid, flush=True)
    os._exit(0)
""")


def guarded_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (EXIT_WITH_PARENT, STOP_GRACE)}
    env.update(PYTHONPATH=str(REPO), RANK="5", **extra)
    return env


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_rank_whose_launcher_is_already_gone_exits_at_once():
    # pid 1 is never this test's pid: as if deepy died between starting the rank and its prctl.
    proc = subprocess.run([sys.executable, "-c", "import os; from megatron.launch.rank_guard import guard_rank; "
                           "guard_rank(os.environ); print('survived')"],
                          env=guarded_env(**{EXIT_WITH_PARENT: "1"}), capture_output=True, text=True, timeout=60)
    assert proc.returncode == LAUNCHER_GONE and "survived" not in proc.stdout
    assert proc.stderr.strip() == f"rank 5: its launcher (pid 1) is gone; exit code {LAUNCHER_GONE}"


def test_the_watchdog_ends_a_rank_whose_parent_exits_where_no_prctl_is_set(tmp_path):
    """`any` (srun's tasks) sets no parent-death signal: only the watchdog notices."""
    err = tmp_path / "child.err"
    parent = subprocess.run([sys.executable, "-c", ORPHANING_PARENT, str(err)],
                            env=guarded_env(**{EXIT_WITH_PARENT: "any"}),
                            capture_output=True, text=True, timeout=60)
    child = int(parent.stdout.strip())
    gone = time.monotonic()
    while alive(child) and time.monotonic() - gone < 30:
        time.sleep(0.05)
    print(f"\nparent exited -> child gone after {time.monotonic() - gone:.2f} s")
    if alive(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the orphaned child was still running 30 s after its parent exited")
    assert "rank 5: its launcher (pid" in err.read_text() and f"exit code {LAUNCHER_GONE}" in err.read_text()


def start_stuck(**extra) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", STUCK_RANK], env=guarded_env(**extra), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "blocked"
    return proc


def test_a_second_sigterm_ends_a_rank_stuck_where_its_handler_cannot_run():
    proc = start_stuck(**{STOP_GRACE: "0"})  # no grace timer: only the second signal
    try:
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):  # the first is a request: the rank would save at the next step
            proc.wait(timeout=1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip() == "rank 5: second stop signal (SIGTERM); exiting hard; exit code 143"


def test_one_sigterm_ends_a_stuck_rank_after_the_grace_time():
    proc = start_stuck(**{STOP_GRACE: "1.5"})
    try:
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=30)
        waited = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and 1.4 < waited < 10
    assert err.startswith("rank 5: still running 1.5 s after SIGTERM")


def test_sigusr1_stays_a_request():
    """The time-limit warning, repeated, never ends a rank: only SIGTERM/SIGINT escalate."""
    proc = start_stuck(**{STOP_GRACE: "0.5"})
    try:
        for _ in range(3):
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.3)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_forked_childs_sigterms_are_not_the_parents():
    """A data worker forked from a guarded rank, SIGTERMed twice, must not end its parent."""
    script = textwrap.dedent("""\
        import os, signal, time
        from megatron.launch.rank_guard import guard_rank
        guard_rank(os.environ)
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        child = os.fork()
        if child == 0:
            time.sleep(30)
            os._exit(0)
        for _ in range(2):
            os.kill(child, signal.SIGTERM)
            time.sleep(0.3)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        print("parent alive", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=guarded_env(**{STOP_GRACE: "0"}), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "parent alive", proc.stderr
