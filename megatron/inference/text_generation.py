"""Text generation on one loaded model: token loop (with or without the KV cache) and generate.py's
three modes, unconditional, input-file and interactive (GPT-NeoX's `text_gen_type`).

Every result is one JSON object per line with NeoX's fields: context, text, length (tokens
generated), finished (the end-of-document token ended it), message (a warning, else null) and
duration_seconds.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, TextIO

import torch

from megatron.config import ConfigError
from megatron.inference.loading import InferenceModel
from megatron.inference.sampling import Sampling, next_token
from megatron.model import KVCache


@dataclass
class Completion:
    tokens: list[int]  # generated, the end-of-document token left out
    finished: bool  # ended on the end-of-document token (not on maximum_tokens or the context limit)
    message: Optional[str] = None


@torch.no_grad()
def generate_tokens(im: InferenceModel, prompt: list[int], maximum_tokens: int, sampling: Sampling,
                    use_cache: bool = True, generator: Optional[torch.Generator] = None,
                    stop_at_eod: bool = True) -> Completion:
    """Continue `prompt` (token ids, at least one) by up to `maximum_tokens` tokens. With the cache
    the prompt runs once and each new token costs one position; without it every step runs the whole
    sequence again (`recompute`). Greedy decoding picks the same tokens either way."""
    limit = im.max_positions
    message = None
    if len(prompt) >= limit:  # keep the end of the prompt: the tokens nearest the continuation
        prompt = prompt[-(limit - 1):]
        message = f"WARNING: the prompt was cut to its last {limit - 1} tokens (max_position_embeddings {limit})"
    steps = min(maximum_tokens, limit - len(prompt))
    if steps < maximum_tokens and message is None:
        message = f"WARNING: stopped after {steps} tokens at max_position_embeddings ({limit})"
    vocab = im.tokenizer.vocab_size  # ids past it are padding rows of the embedding: never produced
    eod = im.tokenizer.eod_id
    sequence = torch.tensor([prompt], dtype=torch.long, device=im.device)
    cache = KVCache.for_model(im.model, 1, len(prompt) + steps, dtype=im.compute_dtype) if use_cache else None
    step_input = sequence
    out: list[int] = []
    with im.autocast():
        for _ in range(steps):
            logits = im.model(step_input, cache=cache) if cache is not None else im.model(sequence)
            token = next_token(logits[:, -1, :vocab], sampling, generator)
            if stop_at_eod and int(token) == eod:
                return Completion(out, True, message)
            out.append(int(token))
            step_input = token.view(1, 1)
            sequence = torch.cat([sequence, step_input], dim=1)
    return Completion(out, False, message)


def complete(im: InferenceModel, context: str, cfg_gen, generator: torch.Generator) -> dict:
    """One NeoX result record for `context` ('' = unconditional: start from end-of-document)."""
    start = time.perf_counter()
    prompt = im.tokenizer.encode(context) if context else []
    prompt = prompt or [im.tokenizer.eod_id]
    done = generate_tokens(im, prompt, cfg_gen.maximum_tokens, Sampling.from_config(cfg_gen),
                           use_cache=not cfg_gen.recompute, generator=generator)
    message = done.message
    if not done.tokens and done.finished:
        message = "WARNING: text generation did not start (the first token was end-of-document)"
    return {"context": context, "text": im.tokenizer.decode(done.tokens), "length": len(done.tokens),
            "finished": done.finished, "message": message,
            "duration_seconds": time.perf_counter() - start}


def read_prompts(path: str, prompt_end: str) -> list[str]:
    """The prompts of an input file: its text split on prompt_end, empty ones skipped."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"sample_input_file {path} does not exist; write one prompt per line into it")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read sample_input_file {path}: {err}") from None
    pieces = text.split(prompt_end) if prompt_end else [text]
    return [p for p in pieces if p.strip()]


def output_path(cfg) -> Path:
    """sample_output_file, or NeoX's default next to the input file, or <log_dir>/samples.jsonl."""
    g = cfg.generation
    if g.sample_output_file:
        return Path(g.sample_output_file)
    if g.text_gen_type == "input-file":
        return Path(f"{g.sample_input_file}.output.jsonl")
    return Path(cfg.logging.log_dir) / "samples.jsonl"


def run_generation(im: InferenceModel, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> Optional[Path]:
    """generate.py's work for `text_gen_type`; returns the file written (None when interactive)."""
    cfg = im.cfg
    g = cfg.generation
    if g.text_gen_type is None:
        raise ConfigError("text_gen_type is not set; choose unconditional, input-file or interactive "
                          "(configs/text_generation.yml sets it)")
    generator = torch.Generator().manual_seed(cfg.data.seed)
    if g.text_gen_type == "interactive":
        _interactive(im, generator, stdin, stdout)
        return None
    contexts: Iterable[str] = read_prompts(g.sample_input_file, g.prompt_end) if g.text_gen_type == "input-file" \
        else [""] * g.num_samples
    path = output_path(cfg)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "w", encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot write sample_output_file {path}: {err.strerror}") from None
    tokens = 0
    start = time.perf_counter()
    with handle:
        for context in contexts:
            record = complete(im, context, g, generator)
            tokens += record["length"]
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            handle.flush()
    elapsed = time.perf_counter() - start
    print(f"generate: wrote {path} ({tokens} tokens in {elapsed:.2f} s, {tokens / max(elapsed, 1e-9):.1f} tokens/s, "
          f"{'no KV cache' if g.recompute else 'KV cache'})", file=stdout, flush=True)
    return path


def _interactive(im: InferenceModel, generator: torch.Generator, stdin: TextIO, stdout: TextIO) -> None:
    """Read a prompt per line until end of input (Ctrl-D) or an empty line, print each completion."""
    while True:
        print("prompt (empty line or Ctrl-D to quit):", file=stdout, flush=True)
        line = stdin.readline()
        if not line or not line.strip():
            return
        record = complete(im, line.rstrip("\n"), im.cfg.generation, generator)
        print(record["text"], file=stdout, flush=True)
        if record["message"]:
            print(record["message"], file=stdout, flush=True)
