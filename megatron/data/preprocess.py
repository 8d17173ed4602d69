"""Tokenize jsonl / text files into NeoX ``<prefix>_<key>_document.bin/.idx`` pairs.

The library side of ``tools/preprocess_data.py``. Input rules:

- ``.jsonl`` (or ``.json``): one JSON object per line; each ``--jsonl-keys`` key is one document of
  that key's dataset. Blank lines are skipped; a line that is not JSON is an error naming the line.
- ``.txt``: ``txt_mode="file"`` (default) makes the whole file one document;
  ``txt_mode="paragraph"`` makes every block separated by one or more blank lines a document.
  Text files feed the first key.
- Any of them compressed, ``.jsonl.zst`` (the Pile's shards) or ``.jsonl.gz``: decompressed as a
  stream, with the same output bytes as the decompressed file (megatron/data/input_files.py).
- Empty documents (no tokens before the end-of-document token) are skipped, as NeoX does.
- Inputs are comma-separated; each may be a glob or a folder (its input files, sorted).

One sequence per document, with ``<|endoftext|>`` appended when ``append_eod`` (what NeoX training
data uses). Output order equals input order for any number of workers.

Progress is counted in bytes of the input files as read from disk (compressed bytes for ``.gz`` and
``.zst``), so the total, and with it the ETA, is known before the first document
(megatron/logging/progress.py). Only the reading process decompresses: with ``workers`` it hands
batches of documents to the tokenizer processes, so memory holds a few batches, not the file.
"""
from __future__ import annotations

import collections
import functools
import glob
import json
import multiprocessing
import os
import re
import sys
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from megatron.data.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.data.input_files import InputFile, check_input, is_input_name
from megatron.data.tokenizers import Tokenizer, make_tokenizer
from megatron.logging.progress import Progress

PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n+")
BATCH_DOCUMENTS = 64
BATCHES_IN_FLIGHT_PER_WORKER = 4


def expand_inputs(inputs: str | Sequence[str]) -> List[str]:
    """Comma-separated paths, globs or folders -> the list of input files, in the given order."""
    items = inputs.split(",") if isinstance(inputs, str) else list(inputs)
    files: List[str] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        if os.path.isdir(item):
            found = sorted(p for p in glob.glob(os.path.join(item, "*")) if is_input_name(p))
        elif os.path.isfile(item):
            found = [item]
        else:
            found = sorted(glob.glob(item))
        if not found:
            raise DataError(f"input not found: {item} (expected .jsonl or .txt files, comma-separated)")
        files.extend(found)
    for path in files:
        check_input(path)  # an unknown type or compression is refused before any work
    return files


def iter_documents(paths: Sequence[str], jsonl_keys: Sequence[str] = ("text",),
                   txt_mode: str = "file") -> Iterator[Dict[str, str]]:
    """Yield one ``{key: text}`` per document of the input files (see the module doc for the rules)."""
    return (document for document, _ in _read_documents(paths, jsonl_keys, txt_mode))


def _read_documents(paths: Sequence[str], jsonl_keys: Sequence[str],
                    txt_mode: str) -> Iterator[Tuple[Dict[str, str], int]]:
    """``(document, input bytes read so far over all files)`` for each document."""
    if txt_mode not in ("file", "paragraph"):
        raise DataError(f"txt mode {txt_mode!r} is not one of: file, paragraph")
    done = 0  # bytes of the files already read to the end
    for path in paths:
        with InputFile(path) as file:
            if file.kind == "txt":
                text = file.read()
                blocks = [text] if txt_mode == "file" else PARAGRAPH_BREAK.split(text)
                for block in blocks:
                    yield {jsonl_keys[0]: block if txt_mode == "file" else block.strip("\n")}, done + file.position
                done += file.position
                continue
            for line in file.lines():
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}:{file.lines_read} is not valid JSON ({error.msg})"
                                    + file.check_hint()) from error
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{file.lines_read} is not a JSON object")
                yield {key: str(record.get(key) or "") for key in jsonl_keys}, done + file.position
            done += file.position


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


def _encode_in_worker(job: Tuple[tuple, List[Dict[str, str]], int]):
    settings, documents, position = job
    return _worker_encoder(settings).encode_batch(documents), position


def _batches(documents: Iterable[Tuple[Dict[str, str], int]], size: int,
             limit: Optional[int]) -> Iterator[Tuple[List[Dict[str, str]], int]]:
    """``(documents, input position after the last of them)`` in batches of ``size``."""
    batch: List[Dict[str, str]] = []
    position = 0
    for count, (document, position) in enumerate(documents):
        if limit is not None and count >= limit:
            break
        batch.append(document)
        if len(batch) == size:
            yield batch, position
            batch = []
    if batch:
        yield batch, position


def _in_order(pool, function: Callable, jobs: Iterable, depth: int) -> Iterator:
    """``function(job)`` for each job, in order, with at most ``depth`` jobs handed out and not yet
    returned. ``Pool.imap`` queues every result the writer has not taken yet, so its memory grew
    with the input whenever the tokenizers outpaced the writer: 939 MiB peak on 200 MB of jsonl with
    2 workers and the byte tokenizer, against 62 MiB this way."""
    pending: collections.deque = collections.deque()
    for job in jobs:
        pending.append(pool.apply_async(function, (job,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class Counts:
    """What has been written so far, for the summary line."""

    def __init__(self):
        self.start = time.time()
        self.documents = self.bytes = self.tokens = self.skipped = 0

    def line(self) -> str:
        elapsed = max(time.time() - self.start, 1e-9)
        return (f"processed {self.documents} documents ({self.bytes / 1e6:.1f} MB, {self.tokens} tokens) "
                f"at {self.documents / elapsed:.0f} docs/s, {self.bytes / 1e6 / elapsed:.2f} MB/s")


def preprocess(inputs: str | Sequence[str], output_prefix: str, tokenizer_type: str,
               vocab_file: Optional[str] = None, jsonl_keys: Sequence[str] = ("text",),
               append_eod: bool = False, workers: int = 1, txt_mode: str = "file",
               num_docs: Optional[int] = None, progress: bool = True,
               log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
               vocab_size: Optional[int] = None) -> Dict[str, str]:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx``; returns ``{key: prefix}``.

    ``progress``: a bar on a terminal, else a line every 10% or 30 s, on stderr; ``log`` gets the
    summary line at the end."""
    files = expand_inputs(inputs)
    if not jsonl_keys:
        raise DataError("--jsonl-keys needs at least one key")
    encoder = DocumentEncoder(tokenizer_type, vocab_file, jsonl_keys, append_eod, vocab_size)
    dtype = best_fitting_dtype(encoder.tokenizer.vocab_size)
    prefixes = {key: f"{output_prefix}_{key}_document" for key in jsonl_keys}
    builders = {key: MMapIndexedDatasetBuilder(prefix, dtype) for key, prefix in prefixes.items()}
    counts = Counts()
    # With --num-docs the run may stop early: the file sizes are then an upper bound, not the total.
    total = sum(os.path.getsize(path) for path in files) if num_docs is None else None
    batches = _batches(_read_documents(files, jsonl_keys, txt_mode), BATCH_DOCUMENTS, num_docs)
    pool = None
    bar = Progress("tokenizing", total, bytes_unit=True, enabled=progress)
    try:
        if workers > 1:
            # spawn: forked children of a process that already used the Rust tokenizer's thread pool
            # would run it single-threaded with a warning; fresh interpreters avoid that.
            pool = multiprocessing.get_context("spawn").Pool(workers)
            jobs = ((encoder.settings, batch, position) for batch, position in batches)
            results = _in_order(pool, _encode_in_worker, jobs, BATCHES_IN_FLIGHT_PER_WORKER * workers)
        else:
            results = ((encoder.encode_batch(batch), position) for batch, position in batches)
        for batch, position in results:
            for ids_by_key, _ in batch:
                for key, ids in ids_by_key.items():
                    if not ids:
                        counts.skipped += 1
                        continue
                    builders[key].add_document(ids)
                    counts.tokens += len(ids)
            counts.documents += len(batch)
            counts.bytes += sum(size for _, size in batch)
            bar.advance_to(position)
    except BaseException:
        bar.close(finished=False)
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    bar.close()
    for builder in builders.values():
        builder.finalize()
    log(counts.line() + f"; skipped {counts.skipped} empty; wrote "
        + ", ".join(f"{prefix}.bin/.idx" for prefix in prefixes.values()))
    return prefixes
