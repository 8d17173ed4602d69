#!/usr/bin/env python
"""Tokenize jsonl / text files into NeoX ``<output-prefix>_<key>_document.bin/.idx`` (NeoX's CLI).

    python tools/preprocess_data.py --input data/corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type HFTokenizer --vocab-file data/tokenizer.json --append-eod --workers 4

``--input`` takes comma-separated files, globs or folders: ``.jsonl`` (one JSON object per line, the
``--jsonl-keys`` fields are the documents) or ``.txt`` (the whole file is one document, or with
``--txt-mode paragraph`` each blank-line-separated block is one), each as it is or compressed:
``.jsonl.zst`` (the Pile's shards) or ``.jsonl.gz``, decompressed as a stream into the same output
bytes as the decompressed file. Empty documents are skipped.
Progress goes to stderr: a bar with rate and ETA on a terminal, a plain line every 10% or 30 s when
stderr is a file (batch jobs, CI); a summary line ends the run.
"""
from __future__ import annotations

import argparse
import sys

from megatron.data import DataError
from megatron.data.preprocess import preprocess
from megatron.data.tokenizers import TOKENIZER_TYPES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True,
                       help="Comma-separated .jsonl/.txt files (or .jsonl.zst, .jsonl.gz, ...), globs or folders.")
    group.add_argument("--jsonl-keys", nargs="+", default=["text"], help="JSON keys to extract (default: text).")
    group.add_argument("--num-docs", type=int, default=None, help="Stop after this many documents.")
    group.add_argument("--txt-mode", choices=["file", "paragraph"], default="file",
                       help="A .txt file is one document (file) or one per blank-line-separated block (paragraph).")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=list(TOKENIZER_TYPES) + ["HFGPT2Tokenizer"])
    group.add_argument("--vocab-file", default=None, help="tokenizer.json (HFTokenizer) or .model (SPMTokenizer).")
    group.add_argument("--vocab-size", type=int, default=None, help="CharLevelTokenizer vocabulary (default 512).")
    group.add_argument("--append-eod", action="store_true", help="Append <|endoftext|> to every document.")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="Writes <prefix>_<key>_document.bin/.idx.")
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="Only mmap (NeoX's default).")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="Tokenizer processes.")
    group.add_argument("--log-interval", type=int, default=None,
                       help="Accepted for NeoX compatibility and ignored: progress is a bar with rate and ETA on a "
                            "terminal, else a line every 10%% or 30 s.")
    group.add_argument("--no-progress", action="store_true", help="No progress output (the summary line stays).")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        preprocess(args.input, args.output_prefix, args.tokenizer_type, args.vocab_file,
                   jsonl_keys=args.jsonl_keys, append_eod=args.append_eod, workers=args.workers,
                   txt_mode=args.txt_mode, num_docs=args.num_docs, progress=not args.no_progress,
                   vocab_size=args.vocab_size)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
