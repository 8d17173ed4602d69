"""Tokenizers with one small interface: ``vocab_size``, ``eod_id``, ``encode(text)``, ``decode(ids)``.

- :class:`HFTokenizer`: a Hugging Face ``tokenizers`` JSON file (NeoX's GPT-2 / 20B tokenizers, or one
  trained by ``tools/train_tokenizer.py``); end of document is ``<|endoftext|>``.
- :class:`SPMTokenizer`: a sentencepiece ``.model``; end of document is ``<|endoftext|>`` when the
  model has that piece, else the model's ``</s>``.
- :class:`CharLevelTokenizer`: UTF-8 bytes as ids 0-255 (the same ids NeoX's char-level tokenizer
  writes for bytes), specials from 256 up, vocabulary 512 as in NeoX. NeoX uses id 0 (the NUL byte)
  as end of document; here it is 256 so every byte round-trips.

``vocab_size`` is the tokenizer's own size; the model pads it (``make_vocab_size_divisible_by``).
"""
from __future__ import annotations

import os
from typing import List, Optional, Protocol, Sequence

from megatron.data.errors import DataError

EOD_TOKEN = "<|endoftext|>"
EOD_CANDIDATES = (EOD_TOKEN, "</s>", "<|end_of_text|>")
PAD_TOKEN = "<|padding|>"


class Tokenizer(Protocol):
    """What the data pipeline and the trainer need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod_id(self) -> int: ...

    def encode(self, text: str) -> List[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _require_file(path: Optional[str], kind: str, hint: str) -> str:
    if not path:
        raise DataError(f"{kind} needs a vocab_file; {hint}")
    if not os.path.isfile(path):
        raise DataError(f"{kind} file not found: {path}; {hint}")
    return os.fspath(path)


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON tokenizer (``tokenizer.json``)."""

    def __init__(self, vocab_file: str):
        from tokenizers import Tokenizer as _HFTokenizer

        self.vocab_file = _require_file(vocab_file, "HFTokenizer", "set tokenizer.vocab_file to a tokenizer.json "
                                        "(train one with tools/train_tokenizer.py)")
        try:
            self._tokenizer = _HFTokenizer.from_file(self.vocab_file)
        except Exception as error:  # the library raises a bare Exception for unreadable JSON
            raise DataError(f"cannot read {self.vocab_file} as a Hugging Face tokenizer.json: "
                            f"{str(error).splitlines()[0]}") from error
        # NeoX's end of document, else the end of sequence of Llama / Mistral ("</s>") or Llama 3's
        # tokenizer.json, as each ships it (the sentencepiece tokenizer falls back to its eos id alike).
        found = [self._tokenizer.token_to_id(token) for token in EOD_CANDIDATES]
        eod = next((i for i in found if i is not None), None)
        if eod is None:
            raise DataError(f"{self.vocab_file} has none of {', '.join(EOD_CANDIDATES)}; NeoX data needs one "
                            "as end of document")
        self._eod_id = int(eod)
        pad = self._tokenizer.token_to_id(PAD_TOKEN)
        self.pad_id = int(pad) if pad is not None else self._eod_id

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        return self._eod_id

    def encode(self, text: str) -> List[int]:
        return self._tokenizer.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Encode many texts at once (the library parallelises this across cores)."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


class SPMTokenizer:
    """A sentencepiece model (``.model``)."""

    def __init__(self, model_file: str):
        import sentencepiece

        self.vocab_file = _require_file(model_file, "SPMTokenizer", "set tokenizer.vocab_file to a sentencepiece "
                                        ".model (train one with tools/train_tokenizer.py --tokenizer-type SPMTokenizer)")
        self._model = sentencepiece.SentencePieceProcessor()
        try:
            self._model.load(self.vocab_file)
        except (OSError, RuntimeError) as error:
            raise DataError(f"cannot read {self.vocab_file} as a sentencepiece model: "
                            f"{str(error).splitlines()[0]}") from error
        eod = self._model.piece_to_id(EOD_TOKEN)
        if eod == self._model.unk_id() or self._model.id_to_piece(eod) != EOD_TOKEN:
            eod = self._model.eos_id()
        if eod < 0:
            raise DataError(f"{self.vocab_file} has neither a {EOD_TOKEN} piece nor an end-of-sentence id")
        self._eod_id = int(eod)
        self.pad_id = int(self._model.pad_id()) if self._model.pad_id() >= 0 else self._eod_id

    @property
    def vocab_size(self) -> int:
        return int(self._model.get_piece_size())

    @property
    def eod_id(self) -> int:
        return self._eod_id

    def encode(self, text: str) -> List[int]:
        return list(self._model.encode(text, out_type=int))

    def decode(self, ids: Sequence[int]) -> str:
        return self._model.decode([int(i) for i in ids])


class CharLevelTokenizer:
    """UTF-8 bytes as token ids 0-255; end of document 256, padding 257; vocabulary 512 (NeoX's)."""

    BYTE_VOCAB = 256

    def __init__(self, vocab_size: int = 512):
        if vocab_size < self.BYTE_VOCAB + 2:
            raise DataError(f"CharLevelTokenizer needs vocab_size >= {self.BYTE_VOCAB + 2} (bytes + specials), "
                            f"got {vocab_size}")
        self._vocab_size = int(vocab_size)
        self.pad_id = self.BYTE_VOCAB + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod_id(self) -> int:
        return self.BYTE_VOCAB

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; special ids are dropped and broken UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < self.BYTE_VOCAB).decode("utf-8", errors="replace")


TOKENIZER_TYPES = ("HFTokenizer", "SPMTokenizer", "CharLevelTokenizer")


def make_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None,
                   vocab_size: Optional[int] = None) -> Tokenizer:
    """Build a tokenizer by NeoX type name (``HFGPT2Tokenizer`` is read as ``HFTokenizer``)."""
    if tokenizer_type in ("HFTokenizer", "HFGPT2Tokenizer"):
        return HFTokenizer(vocab_file)
    if tokenizer_type == "SPMTokenizer":
        return SPMTokenizer(vocab_file)
    if tokenizer_type == "CharLevelTokenizer":
        return CharLevelTokenizer(vocab_size or 512)
    raise DataError(f"tokenizer_type {tokenizer_type!r} is not supported; use one of {', '.join(TOKENIZER_TYPES)}")


def build_tokenizer(tokenizer_cfg) -> Tokenizer:
    """Build the tokenizer a :class:`megatron.config.schema.TokenizerConfig` describes.

    For HF/SPM files a configured ``vocab_size`` must match the file (it is the unpadded size).
    """
    tokenizer = make_tokenizer(tokenizer_cfg.tokenizer_type, tokenizer_cfg.vocab_file, tokenizer_cfg.vocab_size)
    expected = tokenizer_cfg.vocab_size
    if expected is not None and tokenizer_cfg.tokenizer_type != "CharLevelTokenizer" and expected != tokenizer.vocab_size:
        raise DataError(f"tokenizer.vocab_size is {expected} but {tokenizer_cfg.vocab_file} has "
                        f"{tokenizer.vocab_size} tokens; remove vocab_size or fix it")
    return tokenizer
