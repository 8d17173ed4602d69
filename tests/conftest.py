"""Shared fixtures: a small corpus built from local text once per session, and tiny run configs."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, TypeVar

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
T = TypeVar("T")

# One intra-op thread in this process and in every process it starts (deepy's ranks inherit it; the
# launcher gives a rank of a multi-rank run one anyway on 2 cores). With torch's default of one per
# core, a single-process run spins its threads against anything else running (two runs at once took
# 15.5 s instead of 8.5 s one after the other; with one thread each, 4.4 s), and the tiny models here
# gain nothing from a second thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every Communicator in the tests (and in the ranks and runs they start) checks each collective
# against NCCL/RCCL's rules (megatron/engine/nccl_rules.py), so a CPU test fails where a GPU job would.
os.environ.setdefault("NEOX_TOPO_STRICT_COLLECTIVES", "1")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """Demo-corpus folder (tokenizer.json + stdlib_text_document.bin/.idx) on a small cap."""
    from megatron.data.demo_corpus import ensure_demo_data
    out = tmp_path_factory.mktemp("tiny_corpus")
    ensure_demo_data(out, vocab_size=320, max_bytes=200_000, log=lambda line: None)
    return out


@pytest.fixture(scope="session")
def tiny_trained_step(tmp_path_factory, tiny_corpus) -> Path:
    """The step folder of 3 single-process steps of `tiny_run_config`, saved: the trained weights the
    tests that start from a checkpoint share (each deepy run costs a few seconds). Read-only: copy
    it before changing anything."""
    from megatron.checkpointing.folders import latest_step_dir
    folder = tmp_path_factory.mktemp("tiny_trained")
    cfg = tiny_run_config(folder, tiny_corpus, train_iters=3, eval_iters=0, save=str(folder / "ck"))
    result = run_deepy("train.py", str(cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    return latest_step_dir(folder / "ck")


@pytest.fixture(scope="session")
def tiny_two_step_save(tmp_path_factory, tiny_corpus) -> Path:
    """The save folder of 2 single-process steps of `tiny_run_config` with eval_iters 0 and
    log_interval 1 (`latest` names global_step2): the first run of the tests that damage, kill,
    overwrite or resume a checkpoint, trained once. Read-only: copy it (shutil.copytree) first."""
    folder = tmp_path_factory.mktemp("tiny_two_steps")
    cfg = tiny_run_config(folder, tiny_corpus, train_iters=2, eval_iters=0, log_interval=1, save=str(folder / "ck"))
    result = run_deepy("train.py", str(cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "ck"


def tiny_run_config(tmp_path: Path, corpus: Path, **overrides) -> Path:
    """A fast NeoX config over `corpus`; `overrides` are top-level NeoX keys."""
    cfg = {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
        "rotary_pct": 0.5, "gpt_j_residual": True, "no_weight_tying": True,
        "optimizer": {"type": "Adam", "params": {"lr": 3.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "min_lr": 3.0e-4, "warmup": 0.1, "weight_decay": 0.01, "gradient_clipping": 1.0,
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "train_iters": 30,
        "eval_interval": 15, "eval_iters": 2, "log_interval": 5,
        "bf16": {"enabled": False},
        "data_path": str(corpus / "stdlib_text_document"), "split": "949,50,1",
        "tokenizer_type": "HFTokenizer", "vocab_file": str(corpus / "tokenizer.json"),
        "log_dir": str(tmp_path / "logs"), "seed": 1234,
    }
    cfg.update(overrides)
    path = tmp_path / "run.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_losses(log_dir: Path) -> dict[int, float]:
    """`train/lm_loss` by iteration from a run's metrics.jsonl."""
    import json
    out = {}
    for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train/lm_loss" in record:
            out[record["iteration"]] = record["train/lm_loss"]
    return out


def run_together(*calls: Callable[[], T]) -> list[T]:
    """Each of `calls` at once (at most 4 at a time, a thread each), their results in order: for
    independent deepy runs, which one after another leave one of the 2 cores mostly idle."""
    with ThreadPoolExecutor(max_workers=min(4, len(calls))) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def run_deepy(*args: str, timeout: int = 600, **popen) -> subprocess.CompletedProcess:
    """`python deepy.py ARGS` from the repository root; `popen`: more subprocess.run options (preexec_fn)."""
    return subprocess.run([sys.executable, str(REPO / "deepy.py"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, **popen)
