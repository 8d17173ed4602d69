"""The embedded stdlib demo corpus (on a small cap), and the unigram entropy baseline."""
import json
import math
import os

import numpy as np
import pytest

from megatron.config.schema import NeoXConfig
from megatron.data import DataError, demo_corpus
from megatron.data.demo_corpus import ensure_demo_data, ensure_demo_data_from_config, stdlib_sources, unigram_entropy
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.loader import build_datasets
from megatron.data.tokenizers import HFTokenizer

CAP = 150_000
VOCAB = 320


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    lines = []
    data = ensure_demo_data(out, vocab_size=VOCAB, max_bytes=CAP, log=lines.append)
    assert lines and "building" in lines[0]
    return data


def test_sources_are_sorted_capped_and_skip_tests():
    sources = stdlib_sources(CAP)
    paths = [path for path, _ in sources]
    assert paths == sorted(paths) and len(paths) > 3
    assert sum(len(text.encode("utf-8")) for _, text in sources) <= CAP
    assert not any(part in ("test", "tests", "site-packages") for p in paths for part in p.split("/")[:-1])
    assert stdlib_sources(CAP) == sources


def test_demo_artefacts(demo):
    out = demo.out_dir
    for name in ("stdlib.jsonl", "tokenizer.json", "stdlib_text_document.bin", "stdlib_text_document.idx",
                 "demo_corpus.json"):
        assert os.path.isfile(os.path.join(out, name))
    assert not [n for n in os.listdir(out) if n.startswith(".build-")]
    assert demo.data_prefix.endswith("stdlib_text_document") and demo.tokenizer_file.endswith("tokenizer.json")
    tokenizer = HFTokenizer(demo.tokenizer_file)
    assert tokenizer.vocab_size <= VOCAB
    dataset = MMapIndexedDataset(demo.data_prefix)
    with open(demo.corpus_file, encoding="utf-8") as stream:
        corpus = [json.loads(line) for line in stream]
    assert len(dataset) == len(corpus) == demo.documents
    assert dataset.num_tokens == demo.tokens and int(dataset.tokens.max()) < tokenizer.vocab_size
    first = dataset[0].tolist()
    assert first[-1] == tokenizer.eod_id and tokenizer.decode(first[:-1]) == corpus[0]["text"]


def test_second_call_reuses_and_new_settings_rebuild(demo):
    stamp = os.path.join(demo.out_dir, "demo_corpus.json")
    before = os.stat(stamp).st_mtime_ns
    lines = []
    assert ensure_demo_data(demo.out_dir, vocab_size=VOCAB, max_bytes=CAP, log=lines.append) == demo
    assert lines == [] and os.stat(stamp).st_mtime_ns == before
    rebuilt = ensure_demo_data(demo.out_dir, vocab_size=VOCAB, max_bytes=CAP // 2, log=lines.append)
    assert rebuilt.documents < demo.documents and lines
    ensure_demo_data(demo.out_dir, vocab_size=VOCAB, max_bytes=CAP, log=lines.append)  # back for other tests


def test_demo_data_feeds_the_loader(demo):
    cfg = NeoXConfig()
    cfg.model.seq_length = 32
    cfg.data.data_path = demo.data_prefix
    cfg.data.split = "90,10,0"
    train, valid, test = build_datasets(cfg, VOCAB, num_train_samples=64, num_valid_samples=4)
    assert train[0]["tokens"].shape == (32,) and len(valid) >= 4 and test is None


def test_unigram_entropy_on_known_distributions(tmp_path, demo):
    prefix = str(tmp_path / "uniform")
    with MMapIndexedDatasetBuilder(prefix, np.uint16) as builder:
        builder.add_document([0, 1, 2, 3] * 10)
        builder.add_document([4, 5, 6, 7] * 10)
    assert unigram_entropy(prefix, 16) == pytest.approx(math.log(8))
    skewed = str(tmp_path / "skewed")
    with MMapIndexedDatasetBuilder(skewed, np.uint16) as builder:
        builder.add_document([0, 0, 0, 1])
    assert unigram_entropy(MMapIndexedDataset(skewed), 2) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    with pytest.raises(DataError, match="outside"):
        unigram_entropy(prefix, 5)
    assert 2.0 < unigram_entropy(demo.data_prefix, VOCAB) < math.log(VOCAB)


def test_unigram_entropy_of_a_split_and_of_a_blend(tmp_path):
    prefix = str(tmp_path / "two")
    with MMapIndexedDatasetBuilder(prefix, np.uint16) as builder:
        builder.add_document([0, 1] * 20)  # train: ln 2
        builder.add_document([2, 3, 4, 5] * 10)  # valid: ln 4
    cfg = NeoXConfig()
    cfg.model.seq_length = 4
    cfg.data.data_path, cfg.data.split = prefix, "1,1"
    train, valid, _ = build_datasets(cfg, 8, num_train_samples=5, num_valid_samples=5)
    assert unigram_entropy(train, 8) == pytest.approx(math.log(2))
    assert unigram_entropy(valid, 8) == pytest.approx(math.log(4))
    cfg.data.data_path = None
    cfg.data.train_data_paths, cfg.data.train_data_weights = [prefix, prefix], [1, 1]
    blend, _, _ = build_datasets(cfg, 8, num_train_samples=10, num_valid_samples=0)
    # Two copies of the whole file: its own distribution, 1/4 + 1/4 on {0, 1} and 1/8 each on {2..5}.
    assert unigram_entropy(blend, 8) == pytest.approx(-(0.5 * math.log(0.25) + 0.5 * math.log(0.125)))


def test_config_entry_point(monkeypatch):
    cfg = NeoXConfig()
    assert ensure_demo_data_from_config(cfg) is None  # flag off
    cfg.data.build_demo_corpus = True
    cfg.data.data_path = "data/demo/other_document"
    with pytest.raises(DataError, match="data_path to end in /stdlib_text_document"):
        ensure_demo_data_from_config(cfg)
    cfg.data.data_path = "data/demo/stdlib_text_document"
    cfg.tokenizer.vocab_file = "elsewhere/tokenizer.json"
    with pytest.raises(DataError, match="set tokenizer.vocab_file to it"):
        ensure_demo_data_from_config(cfg)
    cfg.tokenizer.vocab_file = "data/demo/tokenizer.json"
    calls = []
    monkeypatch.setattr(demo_corpus, "ensure_demo_data", lambda out_dir: calls.append(str(out_dir)))
    ensure_demo_data_from_config(cfg)
    assert calls == ["data/demo"]
