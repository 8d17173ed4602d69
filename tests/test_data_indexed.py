"""The NeoX/Megatron mmap .bin/.idx format: exact bytes, foreign files, corruption, token range."""
import os
import pickle
import struct

import numpy as np
import pytest

from megatron.data import DataError
from megatron.data.indexed_dataset import (MMapIndexedDataset, MMapIndexedDatasetBuilder, best_fitting_dtype,
                                           check_token_range)

DOCUMENTS = [[5, 6, 7], [1], [9, 9, 9, 9, 2], [300, 4]]


def write_with_builder(prefix, documents=DOCUMENTS, dtype=np.uint16):
    with MMapIndexedDatasetBuilder(prefix, dtype) as builder:
        for document in documents:
            builder.add_document(document)
    return MMapIndexedDataset(prefix)


def neox_index_bytes(code, sizes, itemsize, doc_idx):
    """An .idx written independently of the code under test, field by field as NeoX does."""
    pointers, address = [], 0
    for size in sizes:
        pointers.append(address)
        address += size * itemsize
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
            + struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx))
            + struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(pointers)}q", *pointers)
            + struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def test_round_trip_and_exact_header_bytes(tmp_path):
    prefix = str(tmp_path / "corpus")
    dataset = write_with_builder(prefix)
    assert len(dataset) == 4
    assert dataset.dtype == np.uint16
    assert [dataset[i].tolist() for i in range(4)] == DOCUMENTS
    assert dataset.sizes.tolist() == [3, 1, 5, 2]
    assert dataset.doc_idx.tolist() == [0, 1, 2, 3, 4]
    assert dataset.get(2, offset=1, length=3).tolist() == [9, 9, 9]
    assert dataset.get(2, offset=4).tolist() == [2]
    assert [a.tolist() for a in dataset[1:3]] == DOCUMENTS[1:3]
    assert dataset.num_tokens == 11
    with open(prefix + ".idx", "rb") as stream:
        assert stream.read() == neox_index_bytes(8, [3, 1, 5, 2], 2, [0, 1, 2, 3, 4])
    with open(prefix + ".bin", "rb") as stream:
        assert stream.read() == struct.pack("<11H", *[t for d in DOCUMENTS for t in d])
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]


def test_reads_a_file_written_by_an_independent_neox_writer(tmp_path):
    # int32 tokens, and a document made of two sequences (NeoX allows several add_item per document).
    sequences = [[70000, 1, 2], [3], [4, 5]]
    prefix = str(tmp_path / "foreign")
    with open(prefix + ".bin", "wb") as stream:
        stream.write(struct.pack("<6i", *[t for s in sequences for t in s]))
    with open(prefix + ".idx", "wb") as stream:
        stream.write(neox_index_bytes(4, [3, 1, 2], 4, [0, 2, 3]))
    dataset = MMapIndexedDataset(prefix)
    assert dataset.dtype == np.int32
    assert [dataset[i].tolist() for i in range(3)] == sequences
    assert dataset.doc_idx.tolist() == [0, 2, 3]
    assert dataset.get(0, 1).tolist() == [1, 2]


def test_dtype_choice_and_int32_round_trip(tmp_path):
    assert best_fitting_dtype(50277) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    dataset = write_with_builder(str(tmp_path / "big"), [[100000, 0], [65535]], best_fitting_dtype(128000))
    assert dataset.dtype == np.int32
    assert dataset[0].tolist() == [100000, 0]
    with pytest.raises(DataError, match="do not fit uint16"):
        write_with_builder(str(tmp_path / "small"), [[70000]], np.uint16)
    assert not os.path.exists(tmp_path / "small.bin")


def test_pickles_by_path(tmp_path):
    dataset = write_with_builder(str(tmp_path / "corpus"))
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy[2].tolist() == DOCUMENTS[2]


def test_missing_files_are_one_line_errors(tmp_path):
    with pytest.raises(DataError, match=r"missing .*nothing\.idx.*preprocess_data") as error:
        MMapIndexedDataset(str(tmp_path / "nothing"))
    assert "\n" not in str(error.value)
    prefix = str(tmp_path / "corpus")
    write_with_builder(prefix)
    os.remove(prefix + ".bin")
    with pytest.raises(DataError, match=r"missing .*corpus\.bin"):
        MMapIndexedDataset(prefix)


def test_wrong_magic_is_reported(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_with_builder(prefix)
    with open(prefix + ".idx", "r+b") as stream:
        stream.write(b"TNTIDX\x00\x00\x00")  # the old non-mmap format's magic
    with pytest.raises(DataError, match="not a NeoX/Megatron mmap index") as error:
        MMapIndexedDataset(prefix)
    assert "\n" not in str(error.value)


def test_truncated_bin_and_idx_are_reported(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_with_builder(prefix)
    with open(prefix + ".bin", "r+b") as stream:
        stream.truncate(2 * 10)  # one token short
    with pytest.raises(DataError, match=r"corpus\.bin is truncated"):
        MMapIndexedDataset(prefix)
    write_with_builder(prefix)
    with open(prefix + ".idx", "r+b") as stream:
        stream.truncate(os.path.getsize(prefix + ".idx") - 8)
    with pytest.raises(DataError, match=r"corpus\.idx is truncated"):
        MMapIndexedDataset(prefix)


def test_unknown_dtype_code_is_reported(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_with_builder(prefix)
    with open(prefix + ".idx", "r+b") as stream:
        stream.seek(17)
        stream.write(bytes([9]))
    with pytest.raises(DataError, match="unknown token dtype code 9"):
        MMapIndexedDataset(prefix)


def test_token_ids_beyond_the_vocabulary_name_the_file(tmp_path):
    dataset = write_with_builder(str(tmp_path / "corpus"))
    assert check_token_range(dataset, 301) is True
    with pytest.raises(DataError, match=r"corpus\.bin: token id 300 in sequence 3 is outside the vocabulary \[0, 300\)"):
        check_token_range(dataset, 300)
    # Too large to scan at open: deferred (GPTDataset then checks each sample it returns).
    assert check_token_range(dataset, 300, max_scan_bytes=0) is False
    # uint16 data can never exceed a vocabulary of 65,536 or more: nothing to scan.
    assert check_token_range(dataset, 70000, max_scan_bytes=0) is True
