"""Train a tokenizer on local text: byte-level BPE (HF ``tokenizers``) or sentencepiece.

Both are deterministic for the same texts and settings (the BPE trainer breaks count ties by pair
order, and sentencepiece runs single-threaded here), so the demo corpus rebuilds identically.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence

from megatron.data.errors import DataError
from megatron.data.preprocess import iter_documents
from megatron.data.tokenizers import EOD_TOKEN, PAD_TOKEN

# Byte-level BPE needs the 256 byte symbols plus the specials before any merge.
MIN_BPE_VOCAB = 256 + 2


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, output: str, min_frequency: int = 2) -> str:
    """Train a GPT-2-style byte-level BPE with ``<|endoftext|>`` (id 0) and ``<|padding|>`` (id 1).

    Writes ``output`` (a ``tokenizer.json``) atomically and returns its path.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise DataError(f"--vocab-size {vocab_size} is too small for byte-level BPE (needs >= {MIN_BPE_VOCAB})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    _write_atomically(output, tokenizer.to_str(pretty=False))
    return output


def train_spm_tokenizer(texts: Iterable[str], vocab_size: int, output: str, model_type: str = "bpe") -> str:
    """Train a sentencepiece model with ``<|endoftext|>`` as a user symbol; writes ``output`` (.model).

    Byte fallback is on, so no text maps to ``<unk>``. ``vocab_size`` is a soft limit for tiny texts.
    """
    import sentencepiece

    if not output.endswith(".model"):
        raise DataError(f"sentencepiece output must end in .model, got {output}")
    lines: List[str] = [line for text in texts for line in text.splitlines() if line.strip()]
    if not lines:
        raise DataError("no text to train a sentencepiece model on")
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=Path(output).parent) as tmp:
        prefix = os.path.join(tmp, "spm")
        try:
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=iter(lines),
                model_prefix=prefix,
                vocab_size=vocab_size,
                model_type=model_type,
                user_defined_symbols=[EOD_TOKEN],
                byte_fallback=True,  # 256 byte pieces: the vocabulary must exceed 256 + distinct characters
                hard_vocab_limit=False,
                character_coverage=1.0,
                num_threads=1,
                minloglevel=2,
            )
        except RuntimeError as error:
            raise DataError(f"sentencepiece training failed: {str(error).splitlines()[0]}") from error
        os.replace(prefix + ".model", output)
    return output


def read_texts(paths: Sequence[str], jsonl_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Yield the documents of .txt files (one per file) and .jsonl files (the given keys of each line)."""
    for document in iter_documents(paths, jsonl_keys, txt_mode="file"):
        for key in jsonl_keys:
            text = document.get(key)
            if text:
                yield text


def _write_atomically(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as stream:
        stream.write(text)
    os.replace(tmp, path)


def train_tokenizer(paths: Sequence[str], tokenizer_type: str, vocab_size: int, output: str,
                    jsonl_keys: Sequence[str] = ("text",), min_frequency: Optional[int] = None) -> str:
    """Train ``HFTokenizer`` (byte-level BPE) or ``SPMTokenizer`` on local files; returns the output path."""
    texts = read_texts(paths, jsonl_keys)
    if tokenizer_type in ("HFTokenizer", "bpe"):
        return train_bpe_tokenizer(texts, vocab_size, output, min_frequency=2 if min_frequency is None else min_frequency)
    if tokenizer_type in ("SPMTokenizer", "spm"):
        return train_spm_tokenizer(texts, vocab_size, output)
    raise DataError(f"cannot train tokenizer type {tokenizer_type!r}; use HFTokenizer or SPMTokenizer")
