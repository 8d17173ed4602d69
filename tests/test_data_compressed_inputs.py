"""tools/preprocess_data.py on .jsonl.zst / .jsonl.gz: the same bytes as the decompressed file, read as
a stream, and one-line errors for corrupt, truncated, misnamed and unsupported inputs."""
import gzip
import json
import multiprocessing.pool
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zstandard

from megatron.data import DataError
from megatron.data import input_files
from megatron.data.input_files import InputFile
from megatron.data.preprocess import _in_order, iter_documents, preprocess

REPO = Path(__file__).resolve().parents[1]
FIRST_PART = {}
OUTPUTS = [f"_{key}_document{ext}" for key in ("text", "title") for ext in (".bin", ".idx")]


def corpus_text(lines: int, seed: int = 0, words_per_document: int = 120) -> str:
    """jsonl with text-like entropy (compresses ~3x, as real text does), non-ASCII included."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    words += ["naïve", "café", "☕", "日本語"]
    records = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, words_per_document))),
                "title": f"doc {i}"} for i in range(lines)]
    records[3]["text"] = ""  # an empty document, skipped by every form
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def write_forms(folder: Path, name: str, text: str) -> dict:
    """The corpus as .jsonl, .jsonl.zst (two frames, the first checksummed as the zstd command does,
    split inside a UTF-8 character) and .jsonl.gz (two gzip members, split the same way).
    FIRST_PART[path]: the length of its first frame or member."""
    data = text.encode("utf-8")
    cut = data.index("☕".encode("utf-8"), len(data) // 3) + 1
    paths = {"plain": folder / f"{name}.jsonl", "zst": folder / f"{name}.jsonl.zst", "gz": folder / f"{name}.jsonl.gz"}
    paths["plain"].write_bytes(data)
    first = {"zst": zstandard.ZstdCompressor(write_checksum=True).compress(data[:cut]), "gz": gzip.compress(data[:cut])}
    paths["zst"].write_bytes(first["zst"] + zstandard.ZstdCompressor(level=9).compress(data[cut:]))
    paths["gz"].write_bytes(first["gz"] + gzip.compress(data[cut:]))
    FIRST_PART.update({paths[form]: len(part) for form, part in first.items()})
    return paths


def outputs(prefix) -> list:
    return [Path(f"{prefix}{suffix}").read_bytes() for suffix in OUTPUTS]


def run(inputs, prefix, workers=1):
    return preprocess(",".join(map(str, inputs)), str(prefix), "CharLevelTokenizer", jsonl_keys=("text", "title"),
                      append_eod=True, workers=workers, progress=False, log=lambda line: None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    return folder, write_forms(folder, "a", corpus_text(5000))


def test_compressed_files_give_the_bytes_of_the_decompressed_file(corpus):
    folder, paths = corpus
    # bigger than every read buffer on the way: gzip's 128 KiB reads, the zstd feed, TextIOWrapper's 8 KiB
    assert paths["gz"].stat().st_size > 2 * 128 * 1024
    assert paths["zst"].stat().st_size > 1000 * input_files.ZSTD_FEED_BYTES
    assert paths["plain"].stat().st_size > 2.5 * paths["zst"].stat().st_size
    run([paths["plain"]], folder / "plain")
    expected = outputs(folder / "plain")
    assert len(expected[0]) > 1_000_000  # about one token id (uint16) per byte of text
    for form in ("zst", "gz"):
        run([paths[form]], folder / form)
        assert outputs(folder / form) == expected, form


def test_the_cli_with_workers_reads_compressed_and_plain_files_together(tmp_path, corpus):
    _, paths = corpus
    others = write_forms(tmp_path, "b", corpus_text(300, seed=1))
    run([paths["plain"], others["plain"], paths["plain"]], tmp_path / "plain")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"),
                           "--input", f"{paths['zst']},{others['gz']},{paths['plain']}",
                           "--output-prefix", str(tmp_path / "mixed"), "--tokenizer-type", "CharLevelTokenizer",
                           "--jsonl-keys", "text", "title", "--append-eod", "--workers", "2"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "processed 10300 documents" in done.stderr
    assert outputs(tmp_path / "mixed") == outputs(tmp_path / "plain")


def test_text_files_and_folders_compressed(tmp_path):
    text = "Para one\nstill one.\n\n\nPara two ☕.\n  \nPara three.\n"
    (tmp_path / "a.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(b"Only one."))
    (tmp_path / "notes.md").write_text("not an input")
    documents = [d["text"] for d in iter_documents([str(tmp_path / "a.txt.zst")], txt_mode="paragraph")]
    assert documents == ["Para one\nstill one.", "Para two ☕.", "Para three."]
    # a folder lists its compressed inputs too (sorted), and skips what is not an input
    assert [d["text"] for d in iter_documents(
        [str(p) for p in sorted(tmp_path.glob("*.txt.*"))])] == [text, "Only one."]
    prefixes = preprocess(str(tmp_path), str(tmp_path / "out"), "CharLevelTokenizer", log=lambda line: None,
                          progress=False)
    assert Path(prefixes["text"] + ".bin").stat().st_size == 2 * len((text + "Only one.").encode())


def test_reading_is_a_stream(corpus):
    _, paths = corpus
    for form in ("zst", "gz"):
        with InputFile(str(paths[form])) as file:
            json.loads(next(file.lines()))
            # one line needs one read from disk: gzip's 128 KiB, or one zstd feed
            assert file.position <= 128 * 1024 + 64 < file.size, form
            assert file.lines_read == 1


def test_peak_memory_does_not_grow_with_the_input(tmp_path):
    """Peak RSS of the tool on 30 MB of decompressed jsonl against 60 KB of it: within 16 MiB, where
    holding the decompressed file would take 30 MB more as bytes, and 30-120 MB more as str. The
    block repeats, so it compresses ~500x: the worst case of a zstd feed's output (8 MiB)."""
    text = corpus_text(40, seed=2, words_per_document=500)
    block = text.encode("utf-8")
    repeats = 30_000_000 // len(block)
    compressor = zstandard.ZstdCompressor(level=1, write_checksum=True)
    (tmp_path / "big.jsonl.zst").write_bytes(compressor.compress(block * repeats))
    (tmp_path / "small.jsonl.zst").write_bytes(compressor.compress(block))
    code = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(done.returncode)")
    peaks = {}
    for name in ("small", "big"):
        done = subprocess.run([sys.executable, "-c", code, sys.executable, str(REPO / "tools" / "preprocess_data.py"),
                               "--input", str(tmp_path / f"{name}.jsonl.zst"), "--output-prefix",
                               str(tmp_path / name), "--tokenizer-type", "CharLevelTokenizer", "--no-progress"],
                              capture_output=True, text=True, cwd=REPO, timeout=300)
        assert done.returncode == 0, done.stderr
        peaks[name] = int(done.stdout.split()[-1]) / 1024  # KiB -> MiB
    tokens = repeats * sum(len(json.loads(line)["text"].encode("utf-8")) for line in text.splitlines())
    assert Path(tmp_path / "big_text_document.bin").stat().st_size == 2 * tokens  # it read it all
    assert peaks["big"] - peaks["small"] < 16, peaks


def test_workers_get_a_bounded_number_of_batches_ahead():
    taken = []
    lock = threading.Lock()

    def jobs():
        for i in range(100):
            with lock:
                taken.append(i)
            yield i

    with multiprocessing.pool.ThreadPool(2) as pool:
        results = _in_order(pool, lambda x: x * x, jobs(), depth=8)
        assert next(results) == 0 and len(taken) == 8  # ThreadPool.imap has read all 100 by now
        assert list(results) == [i * i for i in range(1, 100)]


def corrupted(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF, data[at + 1] ^ 0x5A]) + data[at + 2:]


@pytest.mark.parametrize("form", ["zst", "gz"])
def test_truncated_and_corrupt_files_are_one_line_errors(tmp_path, corpus, form):
    _, paths = corpus
    data = paths[form].read_bytes()
    lines = paths["plain"].read_text(encoding="utf-8").count("\n")
    compression = {"zst": "zstd", "gz": "gzip"}[form]
    truncated = tmp_path / f"cut.jsonl.{form}"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(DataError) as error:
        run([truncated], tmp_path / "cut")
    size = truncated.stat().st_size
    message = str(error.value)
    assert message.startswith(f"{truncated}: truncated {compression} data at or before compressed byte {size} "
                              f"of {size}, after line ") and "\n" not in message
    assert 0 < int(message.split("after line ")[1].split(" ")[0]) < lines
    assert not list(tmp_path.glob("cut_*"))  # nothing half-written

    # zstd: inside the first frame, the checksummed one; gzip: the first member's CRC-32 (corrupt
    # deflate data would as often make a line that is not JSON, an error of its own, below)
    at = len(data) // 5 if form == "zst" else FIRST_PART[paths[form]] - 8
    bad = tmp_path / f"bad.jsonl.{form}"
    bad.write_bytes(corrupted(data, at))
    with pytest.raises(DataError, match=rf"^{bad}: corrupt {compression} data at or before compressed byte \d+ of "
                                        rf"{len(data)}, after line \d+ \(.+\); check it with `{form[0:1]}") as error:
        run([bad], tmp_path / "bad")
    assert int(str(error.value).split("compressed byte ")[1].split(" ")[0]) > at
    assert not list(tmp_path.glob("bad_*"))

    # a bad line in a sound file: the line, and how to tell it from damage
    broken = tmp_path / f"broken.jsonl.{form}"
    text = b'{"text": "fine"}\n{"text": broken\n'
    broken.write_bytes(gzip.compress(text) if form == "gz" else zstandard.ZstdCompressor().compress(text))
    with pytest.raises(DataError, match=rf"^{broken}:2 is not valid JSON \(.+\); `{compression} -t {broken}` says "
                                        "whether the file is corrupt$"):
        run([broken], tmp_path / "broken")


def test_unknown_compression_and_misnamed_files_are_refused_before_any_work(tmp_path, corpus):
    _, paths = corpus
    xz = tmp_path / "c.jsonl.xz"
    xz.write_bytes(b"\xfd7zXZ\x00")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input",
                           f"{paths['plain']},{xz}", "--output-prefix", str(tmp_path / "out"),
                           "--tokenizer-type", "CharLevelTokenizer"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: {xz}: .xz compression is not supported; use .gz or .zst "
                                   f"(e.g. {tmp_path / 'c.jsonl'}.zst), or decompress it first")
    # a folder's .bz2 is refused by name, not skipped
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "d.jsonl.bz2").write_bytes(b"BZh9")
    with pytest.raises(DataError, match=r"d\.jsonl\.bz2: \.bz2 compression is not supported"):
        run([tmp_path / "folder"], tmp_path / "folder")
    misnamed = tmp_path / "e.jsonl"
    misnamed.write_bytes(paths["zst"].read_bytes())
    with pytest.raises(DataError, match=rf"^{misnamed} holds zstd-compressed data but its name says uncompressed; "
                                        rf"rename it to {misnamed}.zst$"):
        run([paths["plain"], misnamed], tmp_path / "misnamed")
    wrong = tmp_path / "f.jsonl.zst"
    wrong.write_bytes(paths["gz"].read_bytes())
    with pytest.raises(DataError, match=r"f\.jsonl\.zst holds gzip-compressed data but its name says "
                                        r"zstd-compressed; rename it to .*f\.jsonl\.gz$"):
        run([wrong], tmp_path / "wrong")
    not_zstd = tmp_path / "g.jsonl.zst"
    not_zstd.write_text('{"text": "plain"}\n')
    with pytest.raises(DataError, match=r"g\.jsonl\.zst: corrupt zstd data at or before compressed byte 18 of 18, "
                                        r"after line 0 \(.*Unknown frame descriptor"):
        run([not_zstd], tmp_path / "not_zstd")
    assert not list(tmp_path.glob("*_document*"))


def test_without_zstandard_the_error_says_how_to_install_it(tmp_path, corpus, monkeypatch):
    _, paths = corpus
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    with pytest.raises(DataError, match=r"^reading \.zst input needs the zstandard package: run `make venv`"):
        run([paths["zst"]], tmp_path / "none")
