"""Rank 0's data work on 2 gloo ranks through deepy, outside the collective timeout (issue 38).

`distributed_timeout_minutes: 0.1` (6 s) bounds every collective and the rendezvous; rank 0's first
sample-index build is made to take 9 s (patched on rank 0 only, by a wrapper around train.py). The
other rank waits for it on the rendezvous store, not in a barrier, so the run trains to the end (with
the barrier used before, rank 1 failed after 6 s: "Timed out waiting 6000ms"). In the second run rank
0's build fails instead, and the run ends at once with rank 0's one-line error (tests/test_runtime_share.py
checks the line the waiting ranks raise). Both runs start together (~16 s on 2 cores)."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from conftest import REPO, run_deepy, run_together, tiny_run_config

TIMEOUT_MINUTES = 0.1
SLOW_S = 9.0  # > 6 s

WRAPPER = """\
import os, runpy, sys, time
import megatron.data.gpt_dataset as gpt_dataset
from megatron.data import DataError

if os.environ.get("RANK") == "0":
    build, calls = gpt_dataset.build_sample_index, []

    def first_build_is_{mode}(*args, **kwargs):
        if not calls:
            calls.append(time.monotonic())
            if {mode!r} == "slow":
                time.sleep({slow_s})
                print(f"slow build: {{time.monotonic() - calls[0]:.1f}} s", flush=True)
            else:
                raise DataError("deliberately broken sample index")
        return build(*args, **kwargs)
    gpt_dataset.build_sample_index = first_build_is_{mode}
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""


def _run(folder: Path, corpus: Path, mode: str):
    data = folder / "data"  # a corpus of its own: no sample index cached by another test
    data.mkdir()
    for name in ("stdlib_text_document.bin", "stdlib_text_document.idx", "tokenizer.json"):
        shutil.copy(corpus / name, data / name)
    script = folder / f"train_{mode}.py"
    script.write_text(WRAPPER.format(mode=mode, slow_s=SLOW_S, train=str(REPO / "train.py")))
    cfg = tiny_run_config(folder, data, train_iters=2, eval_iters=1, eval_interval=2, log_interval=1,
                          topology={"simulate": [1, 2]}, distributed_timeout_minutes=TIMEOUT_MINUTES)
    start = time.monotonic()
    done = run_deepy(str(script), str(cfg), timeout=180)
    return done, time.monotonic() - start


def test_slow_rank_zero_build_outlasts_the_collective_timeout_and_an_error_reaches_every_rank(tmp_path, tiny_corpus):
    (tmp_path / "slow").mkdir()
    (tmp_path / "broken").mkdir()
    (slow, _), (broken, broken_s) = run_together(lambda: _run(tmp_path / "slow", tiny_corpus, "slow"),
                                                 lambda: _run(tmp_path / "broken", tiny_corpus, "broken"))

    assert slow.returncode == 0, slow.stdout[-2000:] + slow.stderr[-3000:]
    built_in = float(slow.stdout.split("slow build: ")[1].split(" s")[0])
    assert built_in > TIMEOUT_MINUTES * 60 + 2, built_in
    assert "step 2/2" in slow.stdout

    # Rank 1 read rank 0's error from the store and waited for rank 0 to leave (so deepy names rank 0,
    # not the rank reporting it), then deepy stopped it: no hang, no traceback, rank 0's one line.
    assert broken.returncode == 2, broken.stdout[-2000:] + broken.stderr[-3000:]
    assert "Traceback" not in broken.stderr, broken.stderr[-3000:]
    assert "deepy: rank 0 exited with code 2 (error: deliberately broken sample index)" in broken.stderr
    assert broken_s < 60  # not a timeout
