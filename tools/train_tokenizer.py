#!/usr/bin/env python
"""Train a tokenizer on local text files: byte-level BPE (tokenizer.json) or sentencepiece (.model).

    python tools/train_tokenizer.py --input data/corpus.jsonl --vocab-size 4096 --output data/tokenizer.json
    python tools/train_tokenizer.py --input notes.txt --tokenizer-type SPMTokenizer --vocab-size 1000 \
        --output data/spm.model

Inputs are read as by tools/preprocess_data.py (.jsonl with --jsonl-keys, or .txt; either also as .zst or .gz). The BPE
tokenizer has ``<|endoftext|>`` (id 0) and ``<|padding|>`` (id 1); the sentencepiece model has
``<|endoftext|>`` as a user symbol and byte fallback.
"""
from __future__ import annotations

import argparse
import sys

from megatron.data import DataError
from megatron.data.preprocess import expand_inputs
from megatron.data.tokenizer_training import train_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="Comma-separated .jsonl/.txt files, globs or folders.")
    parser.add_argument("--jsonl-keys", nargs="+", default=["text"], help="JSON keys holding text (default: text).")
    parser.add_argument("--tokenizer-type", choices=["HFTokenizer", "SPMTokenizer"], default="HFTokenizer",
                        help="HFTokenizer: byte-level BPE tokenizer.json; SPMTokenizer: sentencepiece .model.")
    parser.add_argument("--vocab-size", type=int, required=True, help="Target vocabulary size.")
    parser.add_argument("--min-frequency", type=int, default=None, help="BPE: least count of a merged pair (2).")
    parser.add_argument("--output", required=True, help="Output file (tokenizer.json or *.model).")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        path = train_tokenizer(expand_inputs(args.input), args.tokenizer_type, args.vocab_size, args.output,
                               jsonl_keys=args.jsonl_keys, min_frequency=args.min_frequency)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
