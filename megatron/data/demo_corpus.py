"""The embedded demo corpus: Python standard-library sources, a BPE tokenizer and a NeoX dataset.

Real text with no download: the ``.py`` files of the running interpreter's standard library (found
through ``sysconfig``), in sorted path order, one document per file, until ``max_bytes``. Test
suites, third-party packages, codec tables and generated files are left out. The corpus therefore
depends on the Python version (it is the same on every machine with the same version).

``ensure_demo_data(out_dir)`` makes, when absent:

- ``<out_dir>/stdlib.jsonl``                         the corpus, ``{"text", "path"}`` per line;
- ``<out_dir>/tokenizer.json``                       byte-level BPE trained on it;
- ``<out_dir>/stdlib_text_document.bin/.idx``        the tokenized corpus, ``<|endoftext|>`` appended;
- ``<out_dir>/demo_corpus.json``                     what was built (written last: the "done" mark).

Everything is built in a temporary folder and renamed into place, so an interrupted build leaves
nothing half-written, and a second call is a no-op. A cold build takes a few seconds (6 MB).
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple, Union

import numpy as np

from megatron.data.blendable_dataset import BlendedDataset
from megatron.data.errors import DataError
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import preprocess
from megatron.data.tokenizer_training import train_bpe_tokenizer

CORPUS_FILE = "stdlib.jsonl"
TOKENIZER_FILE = "tokenizer.json"
DATA_PREFIX = "stdlib_text_document"
STAMP_FILE = "demo_corpus.json"
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MAX_BYTES = 6_000_000
# Single files above this are mostly data (tables, generated code), not prose-like source.
MAX_FILE_BYTES = 200_000
EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings",
                            "pydoc_data", "__pycache__", "lib2to3"})
EXCLUDED_PREFIXES = ("_sysconfigdata",)  # machine-specific build settings


@dataclass(frozen=True)
class DemoData:
    """Where the demo artefacts are and what they hold (mirrors ``demo_corpus.json``)."""
    out_dir: str
    corpus_file: str
    tokenizer_file: str
    data_prefix: str
    vocab_size: int
    max_bytes: int
    documents: int
    text_bytes: int
    tokens: int
    python_version: str


def _python_files(root: Path) -> List[str]:
    """Relative posix paths of the ``.py`` files under ``root``, sorted, excluded folders pruned
    (pruning keeps the walk fast: site-packages alone can hold a gigabyte of packages)."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in EXCLUDED_PARTS]
        base = Path(folder).relative_to(root)
        found += [(base / name).as_posix() for name in files
                  if name.endswith(".py") and not name.startswith(EXCLUDED_PREFIXES)]
    return sorted(found)


def stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES, root: Optional[str] = None) -> List[Tuple[str, str]]:
    """``(relative path, text)`` of standard-library ``.py`` files in sorted order, up to ``max_bytes``."""
    root_path = Path(root or sysconfig.get_paths()["stdlib"])
    if not root_path.is_dir():
        raise DataError(f"standard library folder not found at {root_path}; cannot build the demo corpus")
    sources: List[Tuple[str, str]] = []
    total = 0
    for relative in _python_files(root_path):
        path = root_path / relative
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if not raw.strip() or len(raw) > MAX_FILE_BYTES:
            continue
        if total + len(raw) > max_bytes:
            break
        sources.append((relative, raw.decode("utf-8", errors="replace")))
        total += len(raw)
    if not sources:
        raise DataError(f"no standard-library sources under {root_path} fit max_bytes={max_bytes}")
    return sources


def _read_stamp(out_dir: Path) -> Optional[DemoData]:
    try:
        return DemoData(**json.loads((out_dir / STAMP_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _is_complete(out_dir: Path, stamp: Optional[DemoData], vocab_size: int, max_bytes: int) -> bool:
    if stamp is None or (stamp.vocab_size, stamp.max_bytes) != (vocab_size, max_bytes):
        return False
    needed = [CORPUS_FILE, TOKENIZER_FILE, DATA_PREFIX + ".bin", DATA_PREFIX + ".idx"]
    return all((out_dir / name).is_file() for name in needed)


def ensure_demo_data(out_dir: Union[str, os.PathLike], vocab_size: int = DEFAULT_VOCAB_SIZE,
                     max_bytes: int = DEFAULT_MAX_BYTES,
                     log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> DemoData:
    """Build the demo corpus, tokenizer and dataset in ``out_dir`` unless already built with these settings."""
    out = Path(out_dir)
    stamp = _read_stamp(out)
    if _is_complete(out, stamp, vocab_size, max_bytes):
        return stamp
    out.mkdir(parents=True, exist_ok=True)
    log(f"[demo] building the stdlib demo corpus in {out} (vocab {vocab_size}, up to {max_bytes / 1e6:.1f} MB)")
    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        work = Path(tmp)
        sources = stdlib_sources(max_bytes)
        with open(work / CORPUS_FILE, "w", encoding="utf-8") as stream:
            for relative, text in sources:
                stream.write(json.dumps({"text": text, "path": relative}) + "\n")
        train_bpe_tokenizer((text for _, text in sources), vocab_size, str(work / TOKENIZER_FILE))
        preprocess(str(work / CORPUS_FILE), str(work / "stdlib"), "HFTokenizer", str(work / TOKENIZER_FILE),
                   append_eod=True, progress=False, log=lambda line: None)
        tokens = MMapIndexedDataset(work / DATA_PREFIX).num_tokens
        # Data first, then the tokenizer, then the stamp: a reader never sees a stamp without files.
        for name in (CORPUS_FILE, DATA_PREFIX + ".bin", DATA_PREFIX + ".idx", TOKENIZER_FILE):
            os.replace(work / name, out / name)
        built = DemoData(out_dir=str(out), corpus_file=str(out / CORPUS_FILE),
                         tokenizer_file=str(out / TOKENIZER_FILE), data_prefix=str(out / DATA_PREFIX),
                         vocab_size=vocab_size, max_bytes=max_bytes, documents=len(sources),
                         text_bytes=sum(len(text.encode("utf-8")) for _, text in sources), tokens=tokens,
                         python_version=sys.version.split()[0])
        (work / STAMP_FILE).write_text(json.dumps(asdict(built), indent=1))
        os.replace(work / STAMP_FILE, out / STAMP_FILE)
    log(f"[demo] {built.documents} files, {built.text_bytes / 1e6:.1f} MB, {built.tokens} tokens -> "
        f"{built.data_prefix}.bin/.idx")
    return built


def ensure_demo_data_from_config(cfg) -> Optional[DemoData]:
    """When ``data.build_demo_corpus`` is set, build the demo where ``data.data_path`` points.

    Call before building the tokenizer. The data path must end in ``stdlib_text_document`` and the
    tokenizer file, when set, must be that folder's ``tokenizer.json``.
    """
    if not cfg.data.build_demo_corpus:
        return None
    if not cfg.data.data_path or Path(cfg.data.data_path).name != DATA_PREFIX:
        raise DataError(f"build_demo_corpus needs data_path to end in /{DATA_PREFIX} "
                        f"(e.g. data/demo/{DATA_PREFIX}), got {cfg.data.data_path!r}")
    out_dir = Path(cfg.data.data_path).parent
    vocab_file = cfg.tokenizer.vocab_file
    if vocab_file and Path(vocab_file) != out_dir / TOKENIZER_FILE:
        raise DataError(f"build_demo_corpus writes {out_dir / TOKENIZER_FILE}; set tokenizer.vocab_file to it "
                        f"(got {vocab_file})")
    return ensure_demo_data(out_dir)


def token_counts(indexed: MMapIndexedDataset, vocab_size: int, documents: Optional[range] = None) -> np.ndarray:
    """How often each id in ``[0, vocab_size)`` occurs in ``documents`` (default: all) of ``indexed``."""
    documents = range(len(indexed)) if documents is None else documents
    counts = np.zeros(vocab_size, dtype=np.int64)
    if not len(documents):
        return counts
    itemsize = indexed.dtype.itemsize
    sizes, pointers = indexed.sizes, indexed.pointers
    first, last = documents.start, documents.stop - 1
    span_start = int(pointers[first]) // itemsize
    span_end = int(pointers[last]) // itemsize + int(sizes[last])
    contiguous = span_end - span_start == int(sizes[first:last + 1].sum(dtype=np.int64))
    # Files written by NeoX or by us store sequences back to back: count the span in large chunks.
    spans = [(span_start, span_end)] if contiguous else [
        (int(pointers[d]) // itemsize, int(pointers[d]) // itemsize + int(sizes[d])) for d in documents]
    chunk = 1 << 24
    for begin, end in spans:
        for start in range(begin, end, chunk):
            block = np.asarray(indexed.tokens[start:min(start + chunk, end)], dtype=np.int64)
            if len(block) and (block.max() >= vocab_size or block.min() < 0):
                raise DataError(f"{indexed.bin_path} has token ids outside [0, {vocab_size}); pass the right vocab_size")
            counts += np.bincount(block, minlength=vocab_size)
    return counts


def _distribution(dataset, vocab_size: int) -> np.ndarray:
    """Unigram distribution of an indexed dataset (or prefix), a GPT dataset's split, or a blend."""
    if isinstance(dataset, BlendedDataset):
        return sum(w * _distribution(d, vocab_size) for w, d in zip(dataset.weights, dataset.datasets))
    if isinstance(dataset, GPTDataset):
        counts = token_counts(dataset.indexed, vocab_size, dataset.documents)
        source = f"the {dataset.name} split of {dataset.indexed.prefix}"
    elif isinstance(dataset, (MMapIndexedDataset, str, os.PathLike)):
        indexed = dataset if isinstance(dataset, MMapIndexedDataset) else MMapIndexedDataset(dataset)
        counts = token_counts(indexed, vocab_size)
        source = indexed.prefix
    else:
        raise DataError(f"cannot compute a unigram entropy of {type(dataset).__name__}")
    if counts.sum() == 0:
        raise DataError(f"{source} has no tokens; cannot compute its unigram entropy")
    return counts / counts.sum()


def unigram_entropy(dataset, vocab_size: int) -> float:
    """Entropy (nats/token) of the token frequencies: the loss of the best model that ignores context
    (a trained model's loss should end well below it).

    ``dataset``: a .bin/.idx prefix or :class:`MMapIndexedDataset` (all its tokens), a
    :class:`~megatron.data.gpt_dataset.GPTDataset` (the documents of its split), or a
    :class:`~megatron.data.blendable_dataset.BlendedDataset` (the weighted mixture of its parts).
    """
    probabilities = _distribution(dataset, vocab_size)
    probabilities = probabilities[probabilities > 0]
    return float(-(probabilities * np.log(probabilities)).sum())
