"""The failure report's wording from recorded rank ends (no processes), the output pump's holding of
tracebacks, and the local launcher's report on stub ranks (never train.py)."""
from __future__ import annotations

import io
import os
import textwrap
import threading
import time
from types import SimpleNamespace

from megatron.config import load_config
from megatron.launch.failure_report import FirstError, RankEnd, headline, how_it_ended, peer_failure, root_cause
from megatron.launch.launcher import run_local, script_command
from megatron.launch.rank_output import RankOutput

GLOO_RESET = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:59573: Connection reset by peer. This is typically caused by a remote worker hanging")
# What a surviving rank prints: its step's collective fails, then the closing barrier fails too.
SURVIVOR_TRACEBACK = [
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "train.py", line 24, in main',
    "[rank0]:     work.wait()",
    f"[rank0]: {GLOO_RESET}",
    "",
    "[rank0]: During handling of the above exception, another exception occurred:",
    "",
    "[rank0]: Traceback (most recent call last):",
    "[rank0]:     dist.barrier()",
    "[rank0]: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 600000ms",
]


def first_error(lines) -> str | None:
    error = FirstError()
    for line in lines:
        error.feed(line)
    return error.line


def test_first_error_is_the_original_exception_of_the_latest_traceback():
    assert first_error(SURVIVOR_TRACEBACK) == GLOO_RESET
    earlier = ["Traceback (most recent call last):", "KeyError: 'x'", "handled, going on"]
    later = ["Traceback (most recent call last):", "  File ...", "ValueError: boom"]
    assert first_error(earlier + later) == "ValueError: boom"
    assert first_error(["warning: slow disk", "error: the config is wrong"]) == "error: the config is wrong"
    assert first_error(["/x.py:3: UserWarning: careful", "step 3/10"]) is None


def test_peer_failures_are_named_by_backend():
    assert peer_failure(GLOO_RESET) == "gloo: Connection reset by peer"
    assert peer_failure("torch.distributed.DistBackendError: NCCL communicator was aborted on rank 3") == \
        "nccl: NCCL communicator was aborted"
    assert peer_failure("ValueError: boom") is None and peer_failure(None) is None


def test_the_root_cause_is_the_earliest_failure_of_its_own():
    killed = RankEnd(1, -9, ended_at=10.0, stopped=False)
    peer_first = RankEnd(0, 1, ended_at=9.99, stopped=False, error=GLOO_RESET)  # reaped a hair earlier
    stopped = RankEnd(2, -15, ended_at=10.2, stopped=True)
    assert root_cause([peer_first, killed, stopped]) is killed
    assert root_cause([peer_first, stopped]) is peer_first  # nothing of its own: the earliest
    # Signalled while it was already dying of its own error: still the cause.
    late_own = RankEnd(3, -6, ended_at=10.3, stopped=True, error="ValueError: boom")
    assert root_cause([peer_first, stopped, late_own]) is late_own


def test_one_line_per_other_rank():
    root = RankEnd(1, -9, 1.0, stopped=False)
    assert headline(root, 4) == "deepy: rank 1 was killed by SIGKILL; stopped the other 3 ranks"
    assert headline(RankEnd(0, 2, 1.0, False, error="error: bad config"), 1) == \
        "deepy: rank 0 exited with code 2 (error: bad config)"
    assert how_it_ended(RankEnd(0, 1, 1.1, False, error=GLOO_RESET), root) == \
        "deepy: rank 0: stopped after rank 1 died (gloo: Connection reset by peer)"
    assert how_it_ended(RankEnd(2, -15, 1.2, True), root) == \
        "deepy: rank 2: stopped after rank 1 died (SIGTERM from deepy)"
    raised = RankEnd(1, 1, 1.0, False, error="ValueError: boom")
    assert how_it_ended(RankEnd(3, 1, 1.0, False, error="ValueError: boom"), raised) == \
        "deepy: rank 3: failed too, with the same error"
    assert how_it_ended(RankEnd(3, 0, 1.0, False), raised) == "deepy: rank 3: had finished"


def pump(tmp_path, stderr_lines, hold_s):
    proc = SimpleNamespace(stdout=io.BytesIO(b"step 1/10\n"),
                           stderr=io.BytesIO("".join(line + "\n" for line in stderr_lines).encode()))
    console, errors = io.StringIO(), io.StringIO()
    out = RankOutput(0, proc, console, errors, threading.Lock(), live=True, log_path=tmp_path / "rank0.log",
                     hold_s=hold_s)
    out.finish()
    return out, errors


def test_a_traceback_is_held_then_shown_if_the_run_goes_on(tmp_path):
    out, errors = pump(tmp_path, ["a warning", *SURVIVOR_TRACEBACK[:4]], hold_s=0.05)
    assert errors.getvalue() == "a warning\n" and len(out.unshown) == 4
    out.release_stale_hold(time.monotonic() + 1)  # later, nobody failed: it was a handled error
    assert errors.getvalue().splitlines()[1:] == SURVIVOR_TRACEBACK[:4] and not out.unshown
    logged = (tmp_path / "rank0.log").read_text().splitlines()  # both streams, whatever the console saw
    assert sorted(logged) == sorted(["step 1/10", "a warning", *SURVIVOR_TRACEBACK[:4]])


def test_a_quiet_rank_shows_nothing_more(tmp_path):
    out, errors = pump(tmp_path, SURVIVOR_TRACEBACK, hold_s=60)
    out.quiet()
    out.release_stale_hold(time.monotonic() + 120)
    assert errors.getvalue() == "" and out.error.line == GLOO_RESET and out.last_output == "step 1/10"


# Rank 1 raises; rank 0 then fails in its collective (both ignore deepy's SIGTERM, so they always get
# that far); rank 2 just waits and is stopped.
STUB = textwrap.dedent("""\
    import os, signal, sys, time
    rank, out = int(os.environ["RANK"]), os.environ["STUB_OUT"]
    if rank < 2:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as train.py's ranks: SIGTERM only requests a stop
    if rank == 0:
        open(os.path.join(out, "rank0.ready"), "w").close()
    if rank == 1:
        # On a loaded machine rank 0 may still be starting: fail only once it ignores SIGTERM.
        while not os.path.exists(os.path.join(out, "rank0.ready")):
            time.sleep(0.01)
        print("building units", flush=True)
        print("Traceback (most recent call last):\\n  File \\"engine.py\\", line 9, in step\\nValueError: boom",
              file=sys.stderr, flush=True)
        open(os.path.join(out, "rank1.done"), "w").close()
        sys.exit(1)
    if rank == 0:
        print("step 3/10", flush=True)
        while not os.path.exists(os.path.join(out, "rank1.done")):
            time.sleep(0.01)
        print(os.environ["STUB_TRACEBACK"], file=sys.stderr, flush=True)
        sys.exit(1)
    time.sleep(60)
""")


def test_the_launcher_names_the_raising_rank_once_and_its_peers_in_a_line_each(tmp_path):
    script = tmp_path / "stub.py"
    script.write_text(STUB)
    path = tmp_path / "c.yml"
    path.write_text(f"train_micro_batch_size_per_gpu: 1\nlog_dir: {tmp_path / 'logs'}\n"
                    "topology: {simulate: [3, 1]}\n")
    cfg = load_config([str(path)], env={}, notices=[])
    console, errors = io.StringIO(), io.StringIO()
    env = dict(os.environ, STUB_OUT=str(tmp_path), STUB_TRACEBACK="\n".join(SURVIVOR_TRACEBACK))
    code = run_local(cfg, script_command(str(script), "unused.json"), env=env, console=console, errors=errors,
                     log_folder=tmp_path / "ranks")
    assert code == 1
    assert errors.getvalue().splitlines() == [
        "deepy: rank 1 exited with code 1 (ValueError: boom); stopped the other 2 ranks",
        "deepy: rank 1's last output line: building units",
        "[rank 1] Traceback (most recent call last):",
        '[rank 1]   File "engine.py", line 9, in step',
        "[rank 1] ValueError: boom",
        "deepy: rank 0: stopped after rank 1 failed (gloo: Connection reset by peer)",
        "deepy: rank 2: stopped after rank 1 failed (SIGTERM from deepy)",
        f"deepy: every rank's full output: {tmp_path / 'ranks'}/ (rank0.log .. rank2.log)",
    ]
    assert sorted(console.getvalue().splitlines()) == ["[rank 1] building units", "step 3/10"]
    logged = (tmp_path / "ranks" / "rank0.log").read_text().splitlines()  # two pumps: streams interleave freely
    assert "step 3/10" in logged and [line for line in logged if line != "step 3/10"] == SURVIVOR_TRACEBACK
