"""GPT sample index: determinism, prefix stability, exact coverage of each epoch, caching protocol."""
import os

import numpy as np
import pytest
import torch

from megatron.data import DataError
from megatron.data.gpt_dataset import (GPTDataset, build_gpt_dataset, build_sample_index, epochs_needed,
                                       samples_in_epochs)
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

SEQ = 8


def unique_token_corpus(tmp_path, sizes=(5, 17, 1, 9, 30, 3, 12, 0, 7, 21), name="corpus"):
    """Documents whose tokens are all distinct (token = global position + 1), so a token says where it came from."""
    prefix = str(tmp_path / name)
    start = 1
    with MMapIndexedDatasetBuilder(prefix, np.int32) as builder:
        for size in sizes:
            builder.add_document(np.arange(start, start + size))
            start += size
    return MMapIndexedDataset(prefix)


def all_samples(dataset):
    return [dataset[i] for i in range(len(dataset))]


def test_sample_order_is_deterministic_and_seeded(tmp_path):
    indexed = unique_token_corpus(tmp_path)
    docs = np.arange(len(indexed))
    a = build_sample_index(indexed.sizes, docs, SEQ, seed=7, num_epochs=3)
    b = build_sample_index(indexed.sizes, docs, SEQ, seed=7, num_epochs=3)
    c = build_sample_index(indexed.sizes, docs, SEQ, seed=8, num_epochs=3)
    for part in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert np.array_equal(getattr(a, part), getattr(b, part))
    assert not np.array_equal(a.doc_idx, c.doc_idx)
    assert not np.array_equal(a.shuffle_idx, c.shuffle_idx)


def test_first_samples_do_not_depend_on_how_many_are_requested(tmp_path):
    indexed = unique_token_corpus(tmp_path)
    small = build_gpt_dataset("train", indexed, range(len(indexed)), SEQ, seed=3, num_samples=5)
    large = build_gpt_dataset("train", indexed, range(len(indexed)), SEQ, seed=3, num_samples=200)
    assert small.index.num_epochs == 1 and large.index.num_epochs > 10
    assert len(small) >= 5 and len(large) >= 200
    for i in range(len(small)):
        assert torch.equal(small[i]["tokens"], large[i]["tokens"])


def test_every_token_is_an_input_exactly_once_per_epoch(tmp_path):
    indexed = unique_token_corpus(tmp_path)
    tokens_per_epoch = indexed.num_tokens
    for epochs in (1, 2, 3):
        index = build_sample_index(indexed.sizes, np.arange(len(indexed)), SEQ, seed=1, num_epochs=epochs)
        dataset = GPTDataset("train", indexed, index, SEQ)
        n = samples_in_epochs(tokens_per_epoch, SEQ, epochs)
        assert len(dataset) == n == (epochs * tokens_per_epoch - 1) // SEQ
        assert sorted(index.shuffle_idx.tolist()) == list(range(n))
        inputs = np.concatenate([s["tokens"].numpy() for s in all_samples(dataset)])
        counts = np.bincount(inputs, minlength=tokens_per_epoch + 1)[1:]
        # Each full epoch's tokens appear once each; the remainder (< SEQ + 1 tokens) is unused.
        assert counts.min() >= epochs - 1 and counts.max() <= epochs
        assert (epochs * tokens_per_epoch - counts.sum()) <= SEQ
        # Each epoch visits every document once, in its own order.
        per_epoch = np.asarray(index.doc_idx).reshape(epochs, len(indexed))
        for row in per_epoch:
            assert sorted(row.tolist()) == list(range(len(indexed)))
        if epochs > 1:
            assert not np.array_equal(per_epoch[0], per_epoch[1])


def test_samples_follow_the_shuffled_document_stream_across_documents(tmp_path):
    indexed = unique_token_corpus(tmp_path)
    index = build_sample_index(indexed.sizes, np.arange(len(indexed)), SEQ, seed=5, num_epochs=2)
    stream = np.concatenate([indexed.get(int(d)) for d in index.doc_idx]).astype(np.int64)
    dataset = GPTDataset("train", indexed, index, SEQ)
    for i in range(len(dataset)):
        sample = int(index.shuffle_idx[i])
        expected = torch.from_numpy(stream[sample * SEQ: sample * SEQ + SEQ + 1])
        item = dataset[i]
        assert item["tokens"].dtype == torch.int64 and item["tokens"].shape == (SEQ,)
        assert torch.equal(item["tokens"], expected[:-1])
        assert torch.equal(item["labels"], expected[1:])


def test_shuffle_stays_within_the_epoch_that_completes_each_sample(tmp_path):
    indexed = unique_token_corpus(tmp_path)
    tokens = indexed.num_tokens
    index = build_sample_index(indexed.sizes, np.arange(len(indexed)), SEQ, seed=2, num_epochs=4)
    for epoch in range(4):
        first, last = samples_in_epochs(tokens, SEQ, epoch), samples_in_epochs(tokens, SEQ, epoch + 1)
        assert sorted(index.shuffle_idx[first:last].tolist()) == list(range(first, last))
    assert not np.array_equal(index.shuffle_idx, np.arange(len(index.shuffle_idx)))
    assert epochs_needed(tokens, SEQ, samples_in_epochs(tokens, SEQ, 3)) == 3


def test_cache_names_and_reuse(tmp_path):
    indexed = unique_token_corpus(tmp_path)
    dataset = build_gpt_dataset("valid", indexed, range(2, 9), SEQ, seed=11, num_samples=10)
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".npy"))
    assert len(names) == 3
    epochs = dataset.index.num_epochs
    for name in names:
        assert name.startswith(f"corpus_valid_indexmap_11s_{SEQ}sl_{epochs}ep_2-9d_")
    # Any request that needs the same number of epochs reads the same files (no sample count in the name).
    again = build_gpt_dataset("valid", indexed, range(2, 9), SEQ, seed=11, num_samples=9)
    assert isinstance(again.index.doc_idx, np.memmap)
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".npy")) == names
    assert [again[i]["tokens"].tolist() for i in range(len(again))] == \
           [dataset[i]["tokens"].tolist() for i in range(len(dataset))]


def test_share_protocol(tmp_path, monkeypatch):
    """The building rank hashes the sizes and writes the caches inside `share`; another rank is told
    (prefix, epochs) and only memory-maps the files (it never hashes); a cache it cannot see is an error."""
    import megatron.data.gpt_dataset as gpt_dataset
    indexed = unique_token_corpus(tmp_path)
    results = {}

    def building_rank(what, fn):
        results[what] = fn()
        return results[what]

    def other_rank(what, fn):
        return results[what]

    built = build_gpt_dataset("train", indexed, range(10), SEQ, 0, 20, share=building_rank)
    assert list(results) == [f"build the train sample index of {indexed.prefix} (documents 0-10)"]
    with monkeypatch.context() as patch:
        patch.setattr(gpt_dataset, "cache_prefix", lambda *args, **kwargs: pytest.fail("hashed on a waiting rank"))
        loaded = build_gpt_dataset("train", indexed, range(10), SEQ, 0, 20, share=other_rank)
    assert torch.equal(built[3]["tokens"], loaded[3]["tokens"]) and len(built) == len(loaded)
    for name in os.listdir(tmp_path):
        if name.endswith(".npy"):
            os.remove(tmp_path / name)
    with pytest.raises(DataError, match="missing on this rank after the building rank wrote it"):
        build_gpt_dataset("train", indexed, range(10), SEQ, 0, 20, share=other_rank)


def test_empty_split_and_out_of_range_tokens_are_errors(tmp_path):
    indexed = unique_token_corpus(tmp_path)
    with pytest.raises(DataError, match="the test split .* has no tokens"):
        build_gpt_dataset("test", indexed, range(7, 8), SEQ, 0, 4)
    dataset = build_gpt_dataset("train", indexed, range(10), SEQ, 0, 4, vocab_size=60)
    with pytest.raises(DataError, match=r"corpus\.bin: token id \d+ in sequence \d+ is outside the vocabulary \[0, 60\)"):
        all_samples(dataset)
    with pytest.raises(IndexError):
        dataset[len(dataset)]
