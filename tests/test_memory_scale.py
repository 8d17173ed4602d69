"""The scaled-down proof that the 20B fits: per-rank peak memory of a half-billion-parameter model,
measured, against the memory model (slow: ~5 minutes, ~18 GB of RAM on 2 cores).

A 0.45B-parameter NeoX (16 layers, hidden 1536; fp32 full copy 1.8 GB) trains 2 steps on 8
simulated ranks (2 x 2 x 2, ZeRO-3) and saves; the checkpoint then resumes on 4 ranks (2 x 2,
ZeRO-3: another world size and other factors) for one more step. Every rank's measured peak
resident set above its own baseline, per phase (build, step, save on 8 ranks; load on 4), must lie
within 1.5x of the memory model's prediction, and far below what the engine needed before the
sharded build and the checkpoint reader: the full fp32 model and its flat copy per rank at build
(P x 8 bytes), the full parameters and both moments per rank at resume (P x 12 bytes, on top of
the states).
Predicted per rank (memory model, overlap_comm on: the default since the test was first run):
build 1.48 GB, step 1.79, save 1.82, load on 4 ranks 3.75. Measured here (2026-12-03, before
overlap_comm became the default; not rerun since): build 1.41, step 1.84, save 1.93-1.95, load
3.80; 290 s.

The size is set by NEOX_MEMORY_SCALE_MODEL=<layers>x<hidden> (16 heads; default 16x1536, 0.45B).
The issue's ~1B case is 20x2048 (1.01B parameters, fp32 full copy 4.0 GB), unchanged otherwise:

    NEOX_MEMORY_SCALE_MODEL=20x2048 .venv/bin/python -m pytest -q -m slow tests/test_memory_scale.py -s

Why 0.45B here: model states are P x 20 bytes summed over the ranks (fp32 weights, gradient
accumulator, master and two moments, however they are sharded), and every rank adds its phase's
transients at the same time (the save's fp32 pieces, the load's mapped pages: P x 12 bytes more
summed over the ranks). The largest phase's predicted peak summed over the ranks, with 0.25 GB of
process baseline each (predicted_host_bytes): 16.5 GB at 0.45B (the save on 8 ranks; the load
on 4: 16.0), 34.3 GB at 1B (save 34.3, load 34.1): ~34 GB per billion parameters, against 25.3 GB
of RAM on this machine (23 GB available when idle). With the measured peaks up to ~1.2x the
prediction the ceiling here is ~0.6B; 0.45B leaves room for the test process and whatever else
shares the machine. The 1B case needs a host with 64 GB. Before starting, the test skips (saying
why) when the available memory is below 1.1x that sum (18.2 GB at 0.45B, 37.7 GB at 1B). The
per-rank claims do not depend on the size: the 20B's prediction is in docs/memory.md.

    .venv/bin/python -m pytest -q -m slow tests/test_memory_scale.py -s
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import run_deepy, tiny_run_config
from megatron.config import load_config
from megatron.model.sizes import backward_activation_bytes, parameter_count
from megatron.analytic.memory_model import predict_peak_bytes
from megatron.analytic.model_inputs import comm_spec_from_config, padded_vocab_of

SIZE_ENV = "NEOX_MEMORY_SCALE_MODEL"
DEFAULT_SIZE = "16x1536"  # 0.45B parameters: the largest round shape this 24 GiB machine holds
BASELINE = 0.25e9  # one rank's process baseline (interpreter, torch, data indices), measured
FREE_MARGIN = 1.1


def model_size() -> tuple[int, int]:
    """(num_layers, hidden_size) from NEOX_MEMORY_SCALE_MODEL=<layers>x<hidden>."""
    text = os.environ.get(SIZE_ENV, DEFAULT_SIZE)
    try:
        layers, hidden = (int(x) for x in text.lower().split("x"))
    except ValueError:
        pytest.fail(f"{SIZE_ENV}={text!r}: expected <layers>x<hidden>, e.g. {DEFAULT_SIZE}", pytrace=False)
    return layers, hidden


def model_keys() -> dict:
    layers, hidden = model_size()
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=16, seq_length=32,
                train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=None,
                eval_iters=0, eval_interval=1000, log_interval=1, memory_report=True)


def _config(tmp_path, corpus, name: str, simulate: list, **overrides) -> tuple:
    work = tmp_path / name
    work.mkdir()
    cfg_path = tiny_run_config(work, corpus, **model_keys(), topology={"simulate": simulate},
                               zero_optimization={"stage": 3}, **overrides)
    return work, cfg_path, load_config([str(cfg_path)], notices=[])


def _run(work: Path, cfg_path: Path, cfg, timeout: int) -> list:
    done = run_deepy("train.py", str(cfg_path), timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted((work / "logs" / "memory").glob("rank_*.json"))]
    assert len(ranks) == cfg.topology.world_size
    return ranks


def _predicted(cfg) -> dict:
    vocab = padded_vocab_of(cfg)
    acts = backward_activation_bytes(cfg.model, vocab, cfg.training.train_micro_batch_size_per_gpu, 4)
    return {phase: terms["total"] for phase, terms in predict_peak_bytes(comm_spec_from_config(cfg, vocab), acts).items()}


TRAIN_PHASES, LOAD_PHASES = ("build", "step", "save"), ("build", "load", "step")


def predicted_host_bytes(cfg, phases) -> float:
    """The largest of the run's phases, its predicted peak summed over the ranks with their
    baselines: what the host must hold at once (the phases are synchronised by the collectives)."""
    want = _predicted(cfg)
    return cfg.topology.world_size * (max(want[p] for p in phases) + BASELINE)


def _available_bytes():
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@pytest.mark.slow
def test_a_large_model_fits_per_rank_as_the_memory_model_says(tmp_path, tiny_corpus):
    train_work, train_path, train_cfg = _config(tmp_path, tiny_corpus, "train", [2, 2, 2], train_iters=2,
                                                save=str(tmp_path / "ck"), checkpoint_factor=None)
    load_work, load_path, load_cfg = _config(tmp_path, tiny_corpus, "load", [2, 2], train_iters=3,
                                             load=str(tmp_path / "ck"), save=None)
    params = parameter_count(train_cfg.model, padded_vocab_of(train_cfg))
    need = max(predicted_host_bytes(train_cfg, TRAIN_PHASES), predicted_host_bytes(load_cfg, LOAD_PHASES))
    available = _available_bytes()
    if available is not None and available < FREE_MARGIN * need:
        pytest.skip(f"{params / 1e9:.2f}B parameters: the memory model predicts {need / 1e9:.1f} GB summed over "
                    f"the ranks, {available / 1e9:.1f} GB available (set {SIZE_ENV} smaller)")
    timeout = int(1500 * max(1.0, params / 0.45e9))
    train = _run(train_work, train_path, train_cfg, timeout)
    load = _run(load_work, load_path, load_cfg, timeout)
    full_copy = 4 * params
    want_train, want_load = _predicted(train_cfg), _predicted(load_cfg)
    table = []
    for phase, ranks, want in (("build", train, want_train), ("step", train, want_train),
                               ("save", train, want_train), ("load", load, want_load)):
        for rank, record in enumerate(ranks):
            got = record["peak_rss"][phase] - record["baseline_rss"]
            table.append((phase, rank, got, want[phase]))
            assert want[phase] / 1.5 < got < 1.5 * want[phase], (phase, rank, got, want[phase])
    print(f"\n{params / 1e9:.3f}B parameters, fp32 full copy {full_copy / 1e9:.2f} GB; per rank, GB above baseline:")
    for phase in ("build", "step", "save", "load"):
        rows = [(got, want) for p, _r, got, want in table if p == phase]
        print(f"  {phase:5s} measured {min(g for g, _ in rows) / 1e9:.2f}-{max(g for g, _ in rows) / 1e9:.2f}"
              f"  predicted {rows[0][1] / 1e9:.2f}  max ratio {max(g / w for g, w in rows):.2f}")
    # Far below what every rank held before: at build the whole fp32 model and its flat copy
    # (8 bytes per parameter), at resume the full parameters and both moments (12 bytes per
    # parameter) on top of the states.
    assert max(got for p, _r, got, _w in table if p == "build") < 8 * params / 2
    assert max(got for p, _r, got, _w in table if p == "load") < 12 * params
