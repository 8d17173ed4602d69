"""Shared fixtures: a small corpus built from local text once per session, and tiny run configs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """Demo-corpus folder (tokenizer.json + stdlib_text_document.bin/.idx) on a small cap."""
    from megatron.data.demo_corpus import ensure_demo_data
    out = tmp_path_factory.mktemp("tiny_corpus")
    ensure_demo_data(out, vocab_size=320, max_bytes=200_000, log=lambda line: None)
    return out


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


def run_deepy(*args: str, timeout: int = 600, **popen) -> subprocess.CompletedProcess:
    """`python deepy.py ARGS` from the repository root; `popen`: more subprocess.run options (preexec_fn)."""
    return subprocess.run([sys.executable, str(REPO / "deepy.py"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, **popen)
