"""End-to-end single-process training through deepy.py, and the loop's clear failures.

Every deepy run of this module starts at once in one fixture (a single-process run keeps one of the
2 cores busy): the thirty-step run and one run per refusal, each in a folder of its own."""
import json
import struct

import numpy as np
import pytest

from conftest import run_deepy, run_together, tiny_run_config

TRAIN_KEYS = {"iteration", "train/lm_loss", "train/learning_rate", "train/grad_norm", "runtime/tokens_per_sec",
              "runtime/flops_per_sec_per_gpu", "runtime/mfu", "runtime/peak_memory_bytes"}
VALID_KEYS = {"iteration", "validation/lm_loss", "validation/lm_loss_ppl"}


def _records(log_dir):
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _has_gpu() -> bool:
    import torch
    return torch.cuda.is_available()


# Each run: (folder, corpus) -> (config, more deepy arguments), its files written into the folder.

def _thirty_steps(folder, corpus):
    return tiny_run_config(folder, corpus, save=str(folder / "ck"), peak_tflops_per_gpu=0.05), []


def _missing_data_file(folder, corpus):
    return tiny_run_config(folder, corpus, data_path=str(folder / "nothing_text_document")), []


def _corrupt_magic(folder, corpus):
    prefix = folder / "bad_text_document"
    for ext in (".bin", ".idx"):
        (prefix.parent / (prefix.name + ext)).write_bytes((corpus / ("stdlib_text_document" + ext)).read_bytes())
    idx = prefix.parent / (prefix.name + ".idx")
    idx.write_bytes(b"NOTANIDX\x00" + idx.read_bytes()[9:])
    return tiny_run_config(folder, corpus, data_path=str(prefix)), []


def _token_ids_above_vocab(folder, corpus):
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    prefix = folder / "big_text_document"
    with MMapIndexedDatasetBuilder(str(prefix), np.uint16) as builder:
        for doc in range(40):
            builder.add_document(list(range(doc, doc + 200)) + [5000])
    return tiny_run_config(folder, corpus, data_path=str(prefix)), []


def _gpu_config_without_gpu(folder, corpus):
    return tiny_run_config(folder, corpus), ["--set", "device=cuda"]


def _unwritable_save_folder(folder, corpus):
    blocker = folder / "a_file"
    blocker.write_text("not a folder")
    return tiny_run_config(folder, corpus, save=str(blocker / "ck"), train_iters=2), []


RUNS = {"thirty-steps": _thirty_steps, "missing-data-file": _missing_data_file, "corrupt-magic": _corrupt_magic,
        "token-ids-above-vocab": _token_ids_above_vocab, "gpu-config-without-gpu": _gpu_config_without_gpu,
        "unwritable-save-folder": _unwritable_save_folder}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_corpus) -> dict:
    """Per RUNS name: (its folder, the finished deepy run); the GPU refusal only where no GPU is."""
    calls = {}
    for name, make in RUNS.items():
        if name == "gpu-config-without-gpu" and _has_gpu():
            continue
        folder = tmp_path_factory.mktemp(name)
        cfg, args = make(folder, tiny_corpus)
        calls[name] = (folder, lambda cfg=cfg, args=args: run_deepy("train.py", str(cfg), *args))
    done = run_together(*(call for _, call in calls.values()))
    return {name: (folder, result) for (name, (folder, _)), result in zip(calls.items(), done)}


def test_thirty_steps_loss_falls_metrics_and_checkpoint(runs, tiny_corpus):
    tmp_path, result = runs["thirty-steps"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 30/30" in result.stdout and "ETA" in result.stdout and "tok/s" in result.stdout
    assert "TFLOPS | MFU " in result.stdout and "| mem " in result.stdout
    records = _records(tmp_path / "logs")
    train = [r for r in records if "train/lm_loss" in r]
    valid = [r for r in records if "validation/lm_loss" in r]
    assert all(TRAIN_KEYS <= r.keys() for r in train)
    assert all(VALID_KEYS <= r.keys() for r in valid)
    assert [r["iteration"] for r in valid] == [15, 30]
    assert train[-1]["iteration"] == 30
    assert train[-1]["train/lm_loss"] < train[0]["train/lm_loss"] - 1.0
    assert valid[-1]["validation/lm_loss"] < valid[0]["validation/lm_loss"]
    assert (tmp_path / "ck" / "latest").read_text() == "global_step30"
    assert "unigram entropy" in result.stdout
    # model FLOPs by hand (6N + 12 L h s, N the matmul weights, the output layer included), per second
    from tokenizers import Tokenizer
    vocab = -(-Tokenizer.from_file(str(tiny_corpus / "tokenizer.json")).get_vocab_size() // 128) * 128
    h, layers, seq, tokens = 64, 2, 32, 8 * 32
    flops_per_token = 6 * (layers * (3 * h * h + h * h + 2 * h * 4 * h) + h * vocab) + 12 * layers * h * seq
    for r in train:
        assert r["runtime/flops_per_sec_per_gpu"] * r["runtime/iteration_time"] == pytest.approx(flops_per_token * tokens)
        assert r["runtime/mfu"] == pytest.approx(r["runtime/flops_per_sec_per_gpu"] / 0.05e12)
        assert r["runtime/peak_memory_bytes"] > 50e6  # this process's RSS on a CPU: torch alone is more


def _expect_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr[-2000:]  # USAGE_ERROR: the message explains it
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert error_lines, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]


def test_missing_data_file(runs):
    _expect_one_line_error(runs["missing-data-file"][1], "missing", "nothing_text_document.idx",
                           "a dataset is a .bin/.idx pair")


def test_corrupt_magic(runs):
    _expect_one_line_error(runs["corrupt-magic"][1], "bad_text_document.idx is not a NeoX/Megatron mmap index")


def test_token_ids_above_vocab(runs):
    _expect_one_line_error(runs["token-ids-above-vocab"][1], "big_text_document.bin: token id 5000",
                           "is outside the vocabulary [0, 320)")


def test_gpu_config_without_gpu(runs):
    if _has_gpu():
        pytest.skip("this machine has a GPU")
    _expect_one_line_error(runs["gpu-config-without-gpu"][1], "no GPU is visible")


def test_unwritable_save_folder(runs):
    result = runs["unwritable-save-folder"][1]
    _expect_one_line_error(result, "cannot write checkpoints")
    assert "step 1/" not in result.stdout  # refused before training, not after
