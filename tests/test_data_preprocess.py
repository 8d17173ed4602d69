"""tools/preprocess_data.py and tools/train_tokenizer.py end to end."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.data import DataError
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import iter_documents, preprocess
from megatron.data.tokenizers import CharLevelTokenizer, HFTokenizer

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [
    {"text": "First document.\nWith two lines.", "title": "one"},
    {"text": "", "title": "empty text"},
    {"text": "Third: naïve café ☕", "title": "three"},
    {"text": "def f(x):\n    return x * 2\n", "meta": {"ignored": True}},
]


def run_tool(script, *args):
    return subprocess.run([sys.executable, str(REPO / "tools" / script), *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_cli_char_level_with_two_keys(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", DOCUMENTS)
    result = run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", tmp_path / "out",
                      "--tokenizer-type", "CharLevelTokenizer", "--jsonl-keys", "text", "title",
                      "--append-eod", "--log-interval", "1")
    assert result.returncode == 0, result.stderr
    assert "processed 4 documents" in result.stderr
    tokenizer = CharLevelTokenizer()
    text = MMapIndexedDataset(tmp_path / "out_text_document")
    # The empty text is skipped; every document ends with <|endoftext|>.
    expected = [d["text"] for d in DOCUMENTS if d["text"]]
    assert len(text) == 3 and list(text.doc_idx) == [0, 1, 2, 3]
    for i, document in enumerate(expected):
        ids = text[i].tolist()
        assert ids[-1] == tokenizer.eod_id and tokenizer.decode(ids) == document
    titles = MMapIndexedDataset(tmp_path / "out_title_document")
    assert [tokenizer.decode(titles[i].tolist()) for i in range(len(titles))] == ["one", "empty text", "three"]


def test_cli_bpe_tokenizer_training_then_preprocessing_with_workers(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", DOCUMENTS * 30)
    result = run_tool("train_tokenizer.py", "--input", corpus, "--vocab-size", 300, "--output", tmp_path / "tok.json")
    assert result.returncode == 0, result.stderr
    tokenizer = HFTokenizer(str(tmp_path / "tok.json"))
    outputs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        result = run_tool("preprocess_data.py", "--input", f"{corpus},{corpus}", "--output-prefix", prefix,
                          "--tokenizer-type", "HFTokenizer", "--vocab-file", tmp_path / "tok.json",
                          "--append-eod", "--workers", workers)
        assert result.returncode == 0, result.stderr
        outputs[workers] = [Path(f"{prefix}_text_document{ext}").read_bytes() for ext in (".bin", ".idx")]
    assert outputs[1] == outputs[2]  # same files for any number of workers, in input order
    dataset = MMapIndexedDataset(tmp_path / "w1_text_document")
    assert dataset.dtype.name == "uint16" and len(dataset) == 2 * 30 * 3
    assert tokenizer.decode(dataset[1].tolist()[:-1]) == DOCUMENTS[2]["text"]  # the empty one was skipped
    assert dataset[1].tolist()[-1] == tokenizer.eod_id


def test_text_files_by_file_or_by_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("Para one\nstill one.\n\n\nPara two.\n  \nPara three.\n")
    (tmp_path / "b.txt").write_text("Only one.")
    by_file = [d["text"] for d in iter_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])]
    assert by_file == ["Para one\nstill one.\n\n\nPara two.\n  \nPara three.\n", "Only one."]
    by_paragraph = [d["text"] for d in iter_documents([str(tmp_path / "a.txt")], txt_mode="paragraph")]
    assert by_paragraph == ["Para one\nstill one.", "Para two.", "Para three."]
    prefixes = preprocess(str(tmp_path), str(tmp_path / "txt"), "CharLevelTokenizer", txt_mode="paragraph",
                          log=lambda line: None)
    assert len(MMapIndexedDataset(prefixes["text"])) == 4  # a folder: a.txt's three blocks, then b.txt


def test_bad_inputs_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    result = run_tool("preprocess_data.py", "--input", bad, "--output-prefix", tmp_path / "out",
                      "--tokenizer-type", "CharLevelTokenizer")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: ") and "bad.jsonl:2 is not valid JSON" in result.stderr
    assert not list(tmp_path.glob("out*"))  # nothing half-written
    with pytest.raises(DataError, match=r"input not found: .*missing\.jsonl"):
        preprocess(str(tmp_path / "missing.jsonl"), str(tmp_path / "x"), "CharLevelTokenizer")
    with pytest.raises(DataError, match="HFTokenizer needs a vocab_file"):
        preprocess(str(bad), str(tmp_path / "x"), "HFTokenizer")
