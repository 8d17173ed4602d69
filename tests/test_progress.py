"""megatron/logging/progress.py: a tqdm bar on a terminal, plain periodic lines elsewhere, nothing for
quick work; and the long-work call sites (preprocessing, index building, HF export) report through it."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from megatron.data.gpt_dataset import build_sample_index, index_entries, samples_in_epochs
from megatron.logging.progress import Progress

REPO = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_on_a_terminal_a_tqdm_bar_with_rate_and_eta():
    stream = Terminal()
    with Progress("tokenizing", 200, "documents", stream=stream) as bar:
        assert bar.mode == "bar"
        for _ in range(200):
            bar.update()
    out = stream.getvalue()
    assert "\r" in out and "tokenizing" in out and "200/200" in out
    assert "documents/s" in out and "<" in out  # tqdm's [elapsed<remaining, rate]


def test_in_a_file_a_line_every_ten_percent_then_done():
    stream, clock = io.StringIO(), Clock()
    with Progress("index", 1000, "entries", stream=stream, clock=clock) as bar:
        assert bar.mode == "lines"
        for _ in range(100):
            clock.now += 0.125
            bar.update(10)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [line.split("%")[0] for line in lines[:-1]] == [f"index: {p}" for p in range(10, 100, 10)]
    assert lines[0] == "index: 10% (100/1,000 entries) | 80.0 entries/s | ETA 0m11s"
    assert lines[-1] == "index: done, 1,000 entries in 0m12s (80.0 entries/s)"


def test_in_a_file_slow_work_also_gets_a_line_every_interval():
    stream, clock = io.StringIO(), Clock()
    with Progress("reading", None, bytes_unit=True, stream=stream, clock=clock, interval_s=30) as bar:
        for _ in range(10):
            clock.now += 10
            bar.update(1 << 20)
    lines = stream.getvalue().splitlines()
    assert lines == ["reading: 3.00 MiB | 102.40 KiB/s | 0m30s elapsed",
                     "reading: 6.00 MiB | 102.40 KiB/s | 1m00s elapsed",
                     "reading: 9.00 MiB | 102.40 KiB/s | 1m30s elapsed",
                     "reading: done, 10.00 MiB in 1m40s (102.40 KiB/s)"]


def test_quick_work_failed_work_and_disabled_progress_print_nothing():
    for kwargs in ({"delay_s": 2.0}, {"enabled": False}):
        for stream in (io.StringIO(), Terminal()):
            with Progress("quick", 10, stream=stream, **kwargs) as bar:
                bar.update(10)
            assert stream.getvalue() == "", kwargs
    stream = io.StringIO()
    try:
        with Progress("failing", 10, stream=stream):
            raise KeyError("boom")
    except KeyError:
        pass
    assert stream.getvalue() == ""  # no "done" for work that did not finish


def test_index_building_reports_every_entry_it_builds():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 50, size=40).astype(np.int32)
    documents = np.arange(40)
    seen = []
    index = build_sample_index(sizes, documents, 8, seed=3, num_epochs=3, advance=seen.append)
    samples = samples_in_epochs(int(sizes.sum()), 8, 3)
    assert sum(seen) == index_entries(40, samples, 3) == len(index.doc_idx) + len(index.sample_idx) + len(index.shuffle_idx)
    assert build_sample_index(sizes, documents, 8, seed=3, num_epochs=3).sample_idx.tolist() == index.sample_idx.tolist()


def test_preprocessing_prints_plain_progress_when_stderr_is_a_file(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(300)))
    done = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(corpus),
                           "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "CharLevelTokenizer"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    size = corpus.stat().st_size
    assert lines[-2].startswith("tokenizing: done, ") and f"{size / 1024:.2f} KiB" in lines[-2]
    assert lines[-1].startswith("processed 300 documents")
    assert "\r" not in done.stderr
