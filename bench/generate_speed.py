"""Greedy generation speed with and without the KV cache, tiny-cpu.yml's model, one process.

    .venv/bin/python bench/generate_speed.py [--repeats 3] [--device cpu|cuda]

Two lengths: the model's own context (seq_length 128: 127 new tokens from a one-token prompt) and
the same model with a 1024-position rotary table (1023 new tokens), where recomputing the prefix
costs the most. Without the cache (`recompute: true`) every new token runs the whole sequence
again; with it, one position. Each row: best of --repeats runs, tokens/s both ways and the ratio
cached / recomputed, measured in this process; the tokens of both ways are checked equal. Weights
are NeoX's random init (speed does not depend on them); the vocabulary is CharLevelTokenizer's 512,
so no data files are needed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from megatron.config import load_config
from megatron.data.tokenizers import CharLevelTokenizer
from megatron.inference.loading import InferenceModel
from megatron.inference.sampling import Sampling
from megatron.inference.text_generation import generate_tokens
from megatron.model import GPTNeoX

REPO = Path(__file__).resolve().parents[1]


def tiny_model(positions: int, device: torch.device) -> InferenceModel:
    cfg = load_config([str(REPO / "configs/tiny-cpu.yml")],
                      ["tokenizer_type=CharLevelTokenizer", "vocab_file=null", f"max_position_embeddings={positions}"],
                      env={}, notices=[])
    torch.manual_seed(0)
    model = GPTNeoX(cfg.model, cfg.model.padded_vocab_size).to(device).eval()
    return InferenceModel(cfg=cfg, model=model, tokenizer=CharLevelTokenizer(), device=device,
                          step_dir=Path("."), iteration=0)


def best_time(im: InferenceModel, new_tokens: int, use_cache: bool, repeats: int) -> tuple[float, list[int]]:
    best, tokens = float("inf"), []
    for _ in range(repeats):
        if im.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        done = generate_tokens(im, [CharLevelTokenizer().eod_id], new_tokens, Sampling(), use_cache=use_cache,
                               stop_at_eod=False)
        if im.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        tokens = done.tokens
    return best, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"greedy generation, tiny-cpu model (2 layers, hidden 128, vocab 512) on {device.type}, "
          f"torch threads {torch.get_num_threads()}, best of {args.repeats}")
    print(f"{'context':>8} {'new tokens':>10} {'KV cache tok/s':>15} {'recompute tok/s':>16} {'ratio':>7}")
    for positions in (128, 1024):
        im = tiny_model(positions, device)
        new = positions - 1
        generate_tokens(im, [0], 8, Sampling(), stop_at_eod=False)  # warm-up (allocator, kernels)
        cached, cached_tokens = best_time(im, new, True, args.repeats)
        full, full_tokens = best_time(im, new, False, args.repeats)
        same = "same tokens" if cached_tokens == full_tokens else "TOKENS DIFFER"
        print(f"{positions:>8} {new:>10} {new / cached:>15,.0f} {new / full:>16,.0f} {full / cached:>6.1f}x  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
