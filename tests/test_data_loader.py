"""Splits, weighted blending, build_datasets from the config, and consumed-sample batch indices."""
import itertools

import numpy as np
import pytest
import torch

from megatron.config.schema import NeoXConfig
from megatron.data import DataError
from megatron.data.blendable_dataset import BlendedDataset, build_blending_indices
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.loader import (build_datasets, collate, global_batch_indices, micro_batch_indices,
                                  parse_split, split_document_ranges)

SEQ = 16


def write_corpus(prefix, num_documents, first_token, document_size=40, dtype=np.uint16):
    """Documents of distinct tokens ``first_token + k``: a token tells which document it came from."""
    with MMapIndexedDatasetBuilder(prefix, dtype) as builder:
        for d in range(num_documents):
            start = first_token + d * document_size
            builder.add_document(np.arange(start, start + document_size))
    return MMapIndexedDataset(prefix)


def config(**data):
    cfg = NeoXConfig()
    cfg.model.seq_length = SEQ
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def test_split_follows_neox_rounding():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert split_document_ranges("969,30,1", 1000) == [range(0, 969), range(969, 999), range(999, 1000)]
    assert split_document_ranges("969,30,1", 357) == [range(0, 346), range(346, 357), range(357, 357)]
    # 3 + 3 + 3 rounds to 9 of 10 documents: NeoX shifts every boundary by the shortfall.
    assert split_document_ranges("1,1,1", 10) == [range(0, 4), range(4, 7), range(7, 10)]
    for text in ("a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(DataError, match="split"):
            parse_split(text)


@pytest.mark.parametrize("weights", [[0.2, 0.3, 0.5], [1, 1], [5, 1, 1, 3], [0.999, 0.001]])
def test_blending_keeps_every_prefix_within_one_sample_of_its_weights(weights):
    size = 2000
    dataset_index, sample_index = build_blending_indices(weights, size)
    w = np.asarray(weights, dtype=float) / sum(weights)
    onehot = np.eye(len(weights))[dataset_index]
    taken = np.cumsum(onehot, axis=0)
    expected = np.outer(np.arange(1, size + 1), w)
    assert np.abs(taken - expected).max() <= 1.0
    for d in range(len(weights)):  # each dataset's samples are used in order, once
        assert sample_index[dataset_index == d].tolist() == list(range(int((dataset_index == d).sum())))
    prefix, _ = build_blending_indices(weights, 100)  # prefix-stable
    assert np.array_equal(prefix, dataset_index[:100])


def test_blending_matches_neox_greedy_choices_by_hand():
    # i=0: errors (.2,.3,.5) -> 2; i=1: (.2,.3,-.5) -> 1; i=2: (.4,-.4,0) -> 0; i=3: (-.4,-.1,.5) -> 2.
    dataset_index, sample_index = build_blending_indices([0.2, 0.3, 0.5], 4)
    assert dataset_index.tolist() == [2, 1, 0, 2]
    assert sample_index.tolist() == [0, 0, 0, 1]
    with pytest.raises(DataError, match="blend weights"):
        build_blending_indices([1, -1], 3)


def test_split_datasets_use_disjoint_documents(tmp_path):
    write_corpus(str(tmp_path / "corpus"), num_documents=100, first_token=0)
    cfg = config(data_path=str(tmp_path / "corpus"), split="80,15,5")
    train, valid, test = build_datasets(cfg, 4096, num_train_samples=50, num_valid_samples=10)
    document_of = lambda dataset: {int(t) // 40 for i in range(len(dataset)) for t in dataset[i]["tokens"]}
    assert document_of(train) == set(range(80))
    assert document_of(valid) <= set(range(80, 95)) and document_of(test) <= set(range(95, 100))
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 10
    none_test = build_datasets(config(data_path=str(tmp_path / "corpus"), split="100,0,0"), 4096, 10, 10)
    assert none_test[1] is None and none_test[2] is None


def test_blended_train_data_respects_weights(tmp_path):
    # Token ranges tell the sources apart: corpus a < 1000 <= corpus b.
    write_corpus(str(tmp_path / "a"), 10, first_token=0, document_size=50)
    write_corpus(str(tmp_path / "b"), 10, first_token=1000, document_size=50)
    cfg = config(train_data_paths=[str(tmp_path / "a"), str(tmp_path / "b")], train_data_weights=[3, 1],
                 valid_data_paths=[str(tmp_path / "b")])
    train, valid, test = build_datasets(cfg, 4096, num_train_samples=400, num_valid_samples=8)
    assert isinstance(train, BlendedDataset) and len(train) == 400
    from_a = [bool(train[i]["tokens"].max() < 1000) for i in range(400)]
    assert sum(from_a) == pytest.approx(300, abs=1)
    assert all(int(valid[i]["tokens"].min()) >= 1000 for i in range(len(valid)))
    assert test is None
    again, _, _ = build_datasets(cfg, 4096, num_train_samples=400, num_valid_samples=8)  # from the caches
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(0, 400, 37))
    with pytest.raises(DataError, match="2 train_data_paths but 1 train_data_weights"):
        build_datasets(config(train_data_paths=cfg.data.train_data_paths, train_data_weights=[1]), 4096, 10, 0)


def test_build_datasets_checks_token_ids_and_inputs(tmp_path):
    write_corpus(str(tmp_path / "corpus"), 20, first_token=0)
    with pytest.raises(DataError, match=r"corpus\.bin: token id \d+ .* outside the vocabulary \[0, 500\)"):
        build_datasets(config(data_path=str(tmp_path / "corpus")), 500, 10, 2)
    with pytest.raises(DataError, match="no data"):
        build_datasets(config(), 500, 10, 2)
    with pytest.raises(DataError, match=r"missing .*absent\.idx"):
        build_datasets(config(data_path=str(tmp_path / "absent")), 500, 10, 2)


@pytest.mark.parametrize("micro,dp", [(1, 1), (2, 4), (4, 2), (1, 8), (8, 1)])
def test_micro_batches_cover_the_global_batch_once_for_any_layout(micro, dp):
    global_batch = 16
    for consumed in (0, 48, 1000):
        used = [i for step, rank in itertools.product(range(global_batch // (micro * dp)), range(dp))
                for i in micro_batch_indices(consumed, global_batch, micro, rank, dp, step)]
        assert sorted(used) == list(global_batch_indices(consumed, global_batch))
    with pytest.raises(DataError, match="not a multiple"):
        micro_batch_indices(0, 10, 4, 0, 2, 0)


def test_collate_stacks_samples(tmp_path):
    write_corpus(str(tmp_path / "corpus"), 20, first_token=0)
    train, _, _ = build_datasets(config(data_path=str(tmp_path / "corpus"), split="1"), 4096, 10, 0)
    batch = collate([train[i] for i in global_batch_indices(4, 3)])
    assert batch["tokens"].shape == batch["labels"].shape == (3, SEQ)
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
