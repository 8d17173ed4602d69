"""End-to-end single-process training through deepy.py, and the loop's clear failures."""
import json
import struct

import numpy as np
import pytest

from conftest import run_deepy, tiny_run_config

TRAIN_KEYS = {"iteration", "train/lm_loss", "train/learning_rate", "train/grad_norm", "runtime/tokens_per_sec",
              "runtime/flops_per_sec_per_gpu", "runtime/mfu", "runtime/peak_memory_bytes"}
VALID_KEYS = {"iteration", "validation/lm_loss", "validation/lm_loss_ppl"}


def _records(log_dir):
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_thirty_steps_loss_falls_metrics_and_checkpoint(tmp_path, tiny_corpus):
    cfg = tiny_run_config(tmp_path, tiny_corpus, save=str(tmp_path / "ck"), peak_tflops_per_gpu=0.05)
    result = run_deepy("train.py", str(cfg))
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


def test_missing_data_file(tmp_path, tiny_corpus):
    cfg = tiny_run_config(tmp_path, tiny_corpus, data_path=str(tmp_path / "nothing_text_document"))
    _expect_one_line_error(run_deepy("train.py", str(cfg)), "missing", "nothing_text_document.idx",
                           "a dataset is a .bin/.idx pair")


def test_corrupt_magic(tmp_path, tiny_corpus):
    prefix = tmp_path / "bad_text_document"
    for ext in (".bin", ".idx"):
        (prefix.parent / (prefix.name + ext)).write_bytes((tiny_corpus / ("stdlib_text_document" + ext)).read_bytes())
    idx = prefix.parent / (prefix.name + ".idx")
    idx.write_bytes(b"NOTANIDX\x00" + idx.read_bytes()[9:])
    cfg = tiny_run_config(tmp_path, tiny_corpus, data_path=str(prefix))
    _expect_one_line_error(run_deepy("train.py", str(cfg)), "bad_text_document.idx is not a NeoX/Megatron mmap index")


def test_token_ids_above_vocab(tmp_path, tiny_corpus):
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    prefix = tmp_path / "big_text_document"
    with MMapIndexedDatasetBuilder(str(prefix), np.uint16) as builder:
        for doc in range(40):
            builder.add_document(list(range(doc, doc + 200)) + [5000])
    cfg = tiny_run_config(tmp_path, tiny_corpus, data_path=str(prefix))
    _expect_one_line_error(run_deepy("train.py", str(cfg)), "big_text_document.bin: token id 5000",
                           "is outside the vocabulary [0, 320)")


def test_gpu_config_without_gpu(tmp_path, tiny_corpus):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cfg = tiny_run_config(tmp_path, tiny_corpus)
    _expect_one_line_error(run_deepy("train.py", str(cfg), "--set", "device=cuda"), "no GPU is visible")


def test_unwritable_save_folder(tmp_path, tiny_corpus):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cfg = tiny_run_config(tmp_path, tiny_corpus, save=str(blocker / "ck"), train_iters=2)
    result = run_deepy("train.py", str(cfg))
    _expect_one_line_error(result, "cannot write checkpoints")
    assert "step 1/" not in result.stdout  # refused before training, not after
