"""Tokenize jsonl / text files into NeoX ``<prefix>_<key>_document.bin/.idx`` pairs.

The library side of ``tools/preprocess_data.py``. Input rules:

- ``.jsonl`` (also ``.jsonl.gz``): one JSON object per line; each ``--jsonl-keys`` key is one document
  of that key's dataset. Blank lines are skipped; a line that is not JSON is an error naming the line.
- ``.txt`` (also ``.txt.gz``): ``txt_mode="file"`` (default) makes the whole file one document;
  ``txt_mode="paragraph"`` makes every block separated by one or more blank lines a document.
  Text files feed the first key.
- Empty documents (no tokens before the end-of-document token) are skipped, as NeoX does.
- Inputs are comma-separated; each may be a glob or a folder (its .jsonl/.txt files, sorted).

One sequence per document, with ``<|endoftext|>`` appended when ``append_eod`` (what NeoX training
data uses). Output order equals input order for any number of workers.
"""
from __future__ import annotations

import functools
import glob
import gzip
import io
import json
import multiprocessing
import os
import re
import sys
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from megatron.data.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.data.tokenizers import Tokenizer, make_tokenizer

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json")
PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n+")
BATCH_DOCUMENTS = 64


def expand_inputs(inputs: str | Sequence[str]) -> List[str]:
    """Comma-separated paths, globs or folders -> the list of input files, in the given order."""
    items = inputs.split(",") if isinstance(inputs, str) else list(inputs)
    files: List[str] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        if os.path.isdir(item):
            found = sorted(p for p in glob.glob(os.path.join(item, "*")) if p.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES))
        elif os.path.isfile(item):
            found = [item]
        else:
            found = sorted(glob.glob(item))
        if not found:
            raise DataError(f"input not found: {item} (expected .jsonl or .txt files, comma-separated)")
        files.extend(found)
    for path in files:
        if path.endswith(".zst"):
            raise DataError(f"{path}: zstd input is not supported; decompress it first (zstd -d {path})")
        if not path.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES):
            raise DataError(f"{path}: unknown input type; use .jsonl (one JSON object per line) or .txt")
    return files


def _open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, "r", encoding="utf-8", errors="replace")


def iter_documents(paths: Sequence[str], jsonl_keys: Sequence[str] = ("text",),
                   txt_mode: str = "file") -> Iterator[Dict[str, str]]:
    """Yield one ``{key: text}`` per document of the input files (see the module doc for the rules)."""
    if txt_mode not in ("file", "paragraph"):
        raise DataError(f"txt mode {txt_mode!r} is not one of: file, paragraph")
    for path in paths:
        with _open_text(path) as stream:
            if path.endswith(TEXT_SUFFIXES):
                text = stream.read()
                blocks = [text] if txt_mode == "file" else PARAGRAPH_BREAK.split(text)
                for block in blocks:
                    yield {jsonl_keys[0]: block if txt_mode == "file" else block.strip("\n")}
                continue
            for line_number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}:{line_number} is not valid JSON ({error.msg})") from error
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{line_number} is not a JSON object")
                yield {key: str(record.get(key) or "") for key in jsonl_keys}


class DocumentEncoder:
    """Tokenizes documents; built once per worker process from picklable settings."""

    def __init__(self, tokenizer_type: str, vocab_file: Optional[str], jsonl_keys: Sequence[str],
                 append_eod: bool, vocab_size: Optional[int] = None):
        self.settings = (tokenizer_type, vocab_file, tuple(jsonl_keys), append_eod, vocab_size)
        self.tokenizer: Tokenizer = make_tokenizer(tokenizer_type, vocab_file, vocab_size)
        self.jsonl_keys = tuple(jsonl_keys)
        self.append_eod = append_eod

    def encode_batch(self, documents: List[Dict[str, str]]) -> List[Tuple[Dict[str, List[int]], int]]:
        """-> per document: ({key: ids}, text bytes)."""
        encoded: Dict[str, List[List[int]]] = {}
        for key in self.jsonl_keys:
            texts = [document.get(key, "") for document in documents]
            batch = getattr(self.tokenizer, "encode_batch", None)
            encoded[key] = batch(texts) if batch else [self.tokenizer.encode(text) for text in texts]
        results = []
        for i, document in enumerate(documents):
            ids = {}
            for key in self.jsonl_keys:
                tokens = list(encoded[key][i])
                if tokens and self.append_eod:
                    tokens.append(self.tokenizer.eod_id)
                ids[key] = tokens
            results.append((ids, sum(len(document.get(k, "").encode("utf-8")) for k in self.jsonl_keys)))
        return results


@functools.lru_cache(maxsize=1)
def _worker_encoder(settings: tuple) -> DocumentEncoder:
    """The encoder of a worker process, built on its first batch and reused for the rest."""
    return DocumentEncoder(*settings)


def _encode_in_worker(job: Tuple[tuple, List[Dict[str, str]]]):
    settings, documents = job
    return _worker_encoder(settings).encode_batch(documents)


def _batches(documents: Iterable[Dict[str, str]], size: int, limit: Optional[int]) -> Iterator[List[Dict[str, str]]]:
    batch: List[Dict[str, str]] = []
    for count, document in enumerate(documents):
        if limit is not None and count >= limit:
            break
        batch.append(document)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class Progress:
    """Prints ``processed N documents ...`` every ``interval`` documents and a final summary."""

    def __init__(self, interval: int, log: Callable[[str], None]):
        self.interval, self.log = max(1, interval), log
        self.start = time.time()
        self.documents = self.bytes = self.tokens = self.skipped = 0
        self._next = self.interval

    def update(self, documents: int, text_bytes: int, tokens: int, skipped: int) -> None:
        self.documents += documents
        self.bytes += text_bytes
        self.tokens += tokens
        self.skipped += skipped
        if self.documents >= self._next:
            self._next = (self.documents // self.interval + 1) * self.interval
            self.log(self.line())

    def line(self) -> str:
        elapsed = max(time.time() - self.start, 1e-9)
        return (f"processed {self.documents} documents ({self.bytes / 1e6:.1f} MB, {self.tokens} tokens) "
                f"at {self.documents / elapsed:.0f} docs/s, {self.bytes / 1e6 / elapsed:.2f} MB/s")


def preprocess(inputs: str | Sequence[str], output_prefix: str, tokenizer_type: str,
               vocab_file: Optional[str] = None, jsonl_keys: Sequence[str] = ("text",),
               append_eod: bool = False, workers: int = 1, txt_mode: str = "file",
               num_docs: Optional[int] = None, log_interval: int = 1000,
               log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
               vocab_size: Optional[int] = None) -> Dict[str, str]:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx``; returns ``{key: prefix}``."""
    files = expand_inputs(inputs)
    if not jsonl_keys:
        raise DataError("--jsonl-keys needs at least one key")
    encoder = DocumentEncoder(tokenizer_type, vocab_file, jsonl_keys, append_eod, vocab_size)
    dtype = best_fitting_dtype(encoder.tokenizer.vocab_size)
    prefixes = {key: f"{output_prefix}_{key}_document" for key in jsonl_keys}
    builders = {key: MMapIndexedDatasetBuilder(prefix, dtype) for key, prefix in prefixes.items()}
    progress = Progress(log_interval, log)
    batches = _batches(iter_documents(files, jsonl_keys, txt_mode), BATCH_DOCUMENTS, num_docs)
    pool = None
    try:
        if workers > 1:
            # spawn: forked children of a process that already used the Rust tokenizer's thread pool
            # would run it single-threaded with a warning; fresh interpreters avoid that.
            pool = multiprocessing.get_context("spawn").Pool(workers)
            jobs = ((encoder.settings, batch) for batch in batches)
            results = pool.imap(_encode_in_worker, jobs, chunksize=4)
        else:
            results = map(encoder.encode_batch, batches)
        for batch in results:
            tokens = skipped = 0
            for ids_by_key, _ in batch:
                for key, ids in ids_by_key.items():
                    if not ids:
                        skipped += 1
                        continue
                    builders[key].add_document(ids)
                    tokens += len(ids)
            progress.update(len(batch), sum(size for _, size in batch), tokens, skipped)
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for builder in builders.values():
        builder.finalize()
    log(progress.line() + f"; skipped {progress.skipped} empty; wrote "
        + ", ".join(f"{prefix}.bin/.idx" for prefix in prefixes.values()))
    return prefixes
