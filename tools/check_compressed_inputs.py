#!/usr/bin/env python
"""Preprocess one corpus as .jsonl, .jsonl.zst and .jsonl.gz: are the .bin/.idx bytes equal, and what
is each run's peak memory? The measurement quoted in megatron/data/input_files.py.

    python tools/check_compressed_inputs.py --size-mb 200 --workers 1 --folder /tmp/compressed-check
    python tools/check_compressed_inputs.py --corpus pile/00.jsonl --workers 4   # a corpus of yours

Without ``--corpus`` it writes ``--size-mb`` of jsonl with text-like entropy (it compresses 2-3x, as
text does). The .zst is written as the ``zstd`` command does (level 3, with a checksum). Each run is
``tools/preprocess_data.py`` with the byte tokenizer, keys text and title, ``--append-eod``; its
peak RSS is the largest of the run's processes (the reader, or one tokenizer worker).
"""
from __future__ import annotations

import argparse
import filecmp
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import time

import zstandard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a fresh interpreter per run: RUSAGE_CHILDREN is the largest peak of all the children waited for
PEAK = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(done.returncode)")


def write_corpus(path: str, size: int) -> None:
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfwypvbgk") for _ in range(rng.randint(2, 8))) for _ in range(20000)]
    words += ["naïve", "café", "☕"]
    written = 0
    with open(path, "w", encoding="utf-8") as file:
        while written < size:
            text = " ".join(rng.choices(words, k=rng.randint(50, 400)))
            line = json.dumps({"text": text, "title": f"doc {written}"}, ensure_ascii=False) + "\n"
            file.write(line)
            written += len(line.encode("utf-8"))


def compress(path: str) -> None:
    with open(path, "rb") as source, open(path + ".zst", "wb") as target:
        zstandard.ZstdCompressor(level=3, write_checksum=True).copy_stream(source, target)
    with open(path, "rb") as source, gzip.open(path + ".gz", "wb", compresslevel=6) as target:
        shutil.copyfileobj(source, target)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", help="A .jsonl of yours (keys text, title); else one is written.")
    parser.add_argument("--size-mb", type=float, default=200, help="Size of the written corpus (default 200).")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--folder", default="/tmp/compressed-check", help="Where the files go.")
    args = parser.parse_args(argv)
    os.makedirs(args.folder, exist_ok=True)
    corpus = os.path.join(args.folder, "corpus.jsonl")
    if args.corpus:
        shutil.copyfile(args.corpus, corpus)
    else:
        write_corpus(corpus, int(args.size_mb * 1e6))
    compress(corpus)
    prefixes = {}
    for suffix in ("", ".zst", ".gz"):
        prefix = prefixes[suffix] = os.path.join(args.folder, f"out{suffix or '.plain'}")
        start = time.time()
        tool = os.path.join(REPO, "tools", "preprocess_data.py")
        done = subprocess.run([sys.executable, "-c", PEAK, sys.executable, tool, "--input", corpus + suffix,
                               "--output-prefix", prefix, "--tokenizer-type", "CharLevelTokenizer",
                               "--jsonl-keys", "text", "title", "--append-eod", "--workers", str(args.workers),
                               "--no-progress"], capture_output=True, text=True)
        if done.returncode:
            print(done.stderr, file=sys.stderr)
            return 1
        same = all(filecmp.cmp(f"{prefixes['']}_{key}_document{ext}", f"{prefix}_{key}_document{ext}", shallow=False)
                   for key in ("text", "title") for ext in (".bin", ".idx"))
        print(f"{'corpus.jsonl' + suffix:18s} {os.path.getsize(corpus + suffix) / 1e6:7.1f} MB  "
              f"peak RSS {int(done.stdout.split()[-1]) / 1024:6.1f} MiB  {time.time() - start:5.1f} s  "
              f"bytes equal to the .jsonl's: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
