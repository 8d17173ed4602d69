"""One device, one process: our training step against Hugging Face's GPTNeoXForCausalLM, eager and
compiled, on the same shape, weights and batches.

    .venv/bin/python bench/gpu_throughput.py                       # the 1.01B shape on cuda, bf16
    .venv/bin/python bench/gpu_throughput.py --shape 24,2048,16,2048,4,50432 --steps 10
    .venv/bin/python bench/gpu_throughput.py --device cpu             # the tiny shape in fp32 (seconds)
    .venv/bin/python bench/gpu_throughput.py --device cpu --shape tiny --precision fp32 --rows ours,hf
    .venv/bin/python bench/gpu_throughput.py --breakdown --trace-dir traces   # where each row's time goes

--device is cuda unless told otherwise; where torch sees no GPU that is one line on stderr and exit
code 77 (nothing measured, as tools/gpu_check.sh). --shape, --precision and --rows default per
device: 1b in bf16 with the default rows below on cuda; tiny in fp32 with the eager rows (ours,
ours_fused_ce, hf: ~10 s) on cpu, where torch.compile's C++ builds would take minutes.

Rows (``--rows``, run in the order given; the default on cuda runs all but the three marked "not a
default row", the comparison that matters first: ours, hf_compile, ours_compile, ours_fused_ce, hf, so that a
run cut short by a time limit still has it):
  ours           the step `deepy.py train.py` runs on one device: megatron.engine.SingleProcessEngine
                 (fp32 weights, autocast to --precision, AdamW as optimizer.params.fused says, clip 1.0)
  ours_fused_ce  ours with training.fused_cross_entropy (the head's loss chunk by chunk, no whole logits)
  ours_compile   ours with training.compile (each block's forward through torch.compile)
  ours_compile_fused_ce  both (not a default row: a third compilation)
  ours_recompute ours with checkpoint_activations (full recompute; not a default row)
  ours_selective ours with checkpoint_activations and recompute_granularity: selective (not a default row)
  hf             GPTNeoXForCausalLM, the loop a user writes: fp32 weights, autocast, fused AdamW, clip 1.0
  hf_compile     the same with torch.compile(model)

Every row starts from the same weights (ours, converted to HF's names) and sees the same batches;
its loss is the same mean cross entropy over fp32 logits, so the first losses agree within the
precision's noise (a check that the rows run the same model). Each row: median step time of
--steps after --warmup (compilation happens there), a step being forward + backward + optimizer
step + the loss read back (the loop's one host sync). TFLOPS per device from
megatron.model.sizes.model_flops_per_token (the formula the training log and the time model use),
MFU against the device's peak dense rate in --precision (megatron.logging.throughput; `-` when
unknown, e.g. on a CPU), peak memory (the GPU's max allocation, or the process's RSS on a CPU)
over the timed steps. Ratios (the base row's time over this row's: above 1 is faster) are taken
against the ours, hf and hf_compile rows of the same run.

--breakdown profiles one more step of each row (not timed) and prints where its time goes:
milliseconds of device kernels per kind of work (matmul, attention, torch.compile's kernels, the
optimizer, ...), the device's busy and idle time within the step, the kernels launched and the host
syncs (megatron/logging/step_profile.py; on a CPU, the aten ops' self times). --trace-dir also keeps
each row's chrome trace (ROW.json.gz, for Perfetto or chrome://tracing). --json is rewritten after
every row, so a run cut short keeps the rows it finished.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron.build import compile_blocks
from megatron.config.schema import ModelConfig, OptimizerConfig
from megatron.engine import SingleProcessEngine, autocast_dtype_of, training_loss_of
from megatron.logging.memory import peak_rss_bytes, reset_peak
from megatron.logging.step_profile import StepBreakdown, breakdown_table, profile_step
from megatron.logging.throughput import Throughput, device_peak_flops
from megatron.model import GPTNeoX
from megatron.model.sizes import model_flops_per_token

ROWS = ("ours", "ours_fused_ce", "ours_compile", "ours_compile_fused_ce", "ours_recompute", "ours_selective", "hf",
        "hf_compile")
ON_REQUEST = ("ours_compile_fused_ce", "ours_recompute", "ours_selective")  # not in the default run
DEFAULT_ROWS = ("ours", "hf_compile", "ours_compile", "ours_fused_ce", "hf")
assert sorted(DEFAULT_ROWS) == sorted(row for row in ROWS if row not in ON_REQUEST)
# The rows that change the model's activation checkpointing (the weights stay the same).
RECOMPUTE = {"ours_recompute": dict(checkpoint_activations=True),
             "ours_selective": dict(checkpoint_activations=True, recompute_granularity="selective")}
# name: (layers, hidden, heads, seq, micro-batch, vocab); all parallel residual, rotary 0.5, untied
SHAPES = {"1b": (16, 2048, 16, 2048, 8, 50432), "tiny": (2, 64, 4, 64, 2, 512)}
PRECISIONS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "fp16", "fp32": "fp32"}
CPU_ROWS = ("ours", "ours_fused_ce", "hf")  # no compilation: seconds on a CPU
DEFAULTS = {"cuda": ("1b", "bf16", DEFAULT_ROWS), "cpu": ("tiny", "fp32", CPU_ROWS)}  # when not given
NO_GPU = 77  # nothing measured: torch sees no GPU (tools/gpu_check.sh's code for the same)


def model_config(shape: tuple, **overrides) -> ModelConfig:
    layers, hidden, heads, seq, _micro, vocab = shape
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                       rotary_pct=0.5, gpt_j_residual=True, no_weight_tying=True, padded_vocab_size=vocab, **overrides)


def parse_shape(text: str) -> tuple:
    if text in SHAPES:
        return SHAPES[text]
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 6 or min(shape) < 1:
        raise SystemExit(f"--shape: one of {', '.join(SHAPES)} or six positive integers "
                         f"layers,hidden,heads,seq,micro_batch,vocab; got {text!r}")
    return shape


@dataclass
class Row:
    name: str
    times: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    peak_bytes: Optional[int] = None
    breakdown: Optional[StepBreakdown] = None

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)


def batches(shape: tuple, count: int, device: torch.device) -> list[dict]:
    _layers, _hidden, _heads, seq, micro, vocab = shape
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (micro, seq + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device)})
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak()


def peak_memory(device: torch.device) -> Optional[int]:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()


def run_row(name: str, step: Callable[[dict], torch.Tensor], data: list[dict], warmup: int,
            device: torch.device, profiled: bool, trace_dir: Optional[str]) -> Row:
    row = Row(name)
    for i, batch in enumerate(data):
        if i == warmup:
            sync(device)
            reset_memory(device)
        start = time.perf_counter()
        row.losses.append(float(step(batch)))  # the loop's one host sync per step
        sync(device)
        if i >= warmup:
            row.times.append(time.perf_counter() - start)
    row.peak_bytes = peak_memory(device)
    if profiled:  # one more step, after the timed ones and their peak
        trace = None if trace_dir is None else os.path.join(trace_dir, f"{name}.json.gz")
        try:
            row.breakdown = profile_step(lambda: float(step(data[-1])), device, trace)
        except Exception as error:  # a diagnostic: the timed row stands without it  # noqa: BLE001
            print(f"  {name}: no breakdown ({type(error).__name__}: {error})", flush=True)
    return row


def our_step(model: GPTNeoX, precision: str, device: torch.device, fused: bool, fused_ce: bool) -> Callable:
    opt = OptimizerConfig(lr=1e-4, weight_decay=0.01, gradient_clipping=1.0, fused=fused)
    engine = SingleProcessEngine(model, training_loss_of(fused_ce), opt, precision, 1, device)

    def step(batch: dict) -> torch.Tensor:
        loss = engine.forward_backward(batch)
        engine.optimizer_step(1e-4)
        return loss
    return step


def hf_step(model: GPTNeoX, cfg: ModelConfig, precision: str, device: torch.device, compiled: bool) -> Callable:
    from transformers import GPTNeoXForCausalLM
    from megatron.checkpointing.hf import (HF_OUTPUT, HF_OUTPUT_IN_MEMORY, hf_config_from_model_config,
                                           to_hf_state_dict)
    with torch.device(device):  # its own init (overwritten below) runs on the device: seconds saved
        hf = GPTNeoXForCausalLM(hf_config_from_model_config(cfg, cfg.padded_vocab_size))
    weights = to_hf_state_dict(model.state_dict(), cfg)
    weights[HF_OUTPUT_IN_MEMORY] = weights.pop(HF_OUTPUT)  # the file's name -> transformers' in-memory one
    result = hf.load_state_dict(weights, strict=False)
    if result.unexpected_keys or any("rotary" not in k for k in result.missing_keys):  # HF's own rotary buffers
        raise SystemExit(f"the HF model did not take our weights: {result}")
    hf.to(device).train()
    forward = torch.compile(hf) if compiled else hf
    decay = [p for p in hf.parameters() if p.ndim >= 2]
    plain = [p for p in hf.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": plain, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    dtype = autocast_dtype_of(precision)

    def step(batch: dict) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = forward(input_ids=batch["tokens"]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def measure(rows: list[str], shape: tuple, precision: str, device: torch.device, steps: int, warmup: int,
            fused: bool, profiled: bool = False, trace_dir: Optional[str] = None,
            on_row: Callable[[list[Row]], None] = lambda results: None) -> list[Row]:
    """Every row in turn; ``on_row`` is given the rows so far after each one."""
    cfg = model_config(shape)
    data = batches(shape, warmup + steps, device)
    results = []
    for name in rows:
        torch.manual_seed(1234)
        # The same initial weights in every row (activation checkpointing draws nothing), drawn on
        # the device: a 1B model's init on the host takes seconds per row.
        with torch.device(device):
            model = GPTNeoX(model_config(shape, **RECOMPUTE.get(name, {})), cfg.padded_vocab_size)
        if name.startswith("ours"):
            model.to(device)  # the rotary tables are made on the host
            step = our_step(model, precision, device, fused, fused_ce=name.endswith("fused_ce"))
            if name.startswith("ours_compile"):
                compile_blocks(model)
        else:
            step = hf_step(model, cfg, precision, device, compiled=name == "hf_compile")
            del model
        results.append(run_row(name, step, data, warmup, device, profiled, trace_dir))
        print(f"  {name}: {results[-1].seconds:.4f} s/step, losses {results[-1].losses[0]:.4f} -> "
              f"{results[-1].losses[-1]:.4f}", flush=True)
        on_row(results)
        del step
        gc.collect()
        torch._dynamo.reset()  # each compiled row starts from an empty cache
    return results


def table(results: list[Row], shape: tuple, precision: str, device: torch.device) -> tuple[str, list[dict]]:
    cfg = model_config(shape)
    tokens = shape[3] * shape[4]
    flops = model_flops_per_token(cfg, cfg.padded_vocab_size)
    peak = device_peak_flops(device, precision)
    by_name = {r.name: r for r in results}
    head = ("| row | s/step | tokens/s | TFLOPS | MFU | peak GB | vs ours | vs hf | vs hf_compile | first loss | last loss |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines, records = [head], []
    for r in results:
        speed = Throughput(tokens, r.seconds, flops, 1, peak)
        ratio = {base: by_name[base].seconds / r.seconds if base in by_name else None for base in ("ours", "hf", "hf_compile")}
        record = {"row": r.name, "s_per_step": r.seconds, "tokens_per_sec": speed.tokens_per_sec,
                  "tflops": speed.flops_per_sec_per_gpu / 1e12, "mfu": speed.mfu, "peak_bytes": r.peak_bytes,
                  "vs_ours": ratio["ours"], "vs_hf": ratio["hf"], "vs_hf_compile": ratio["hf_compile"], "losses": r.losses,
                  "breakdown": None if r.breakdown is None else r.breakdown.as_dict()}
        records.append(record)
        cell = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append(f"| {r.name} | {r.seconds:.4f} | {speed.tokens_per_sec:,.0f} | {record['tflops']:.4g} | "
                     f"{cell(None if speed.mfu is None else 100 * speed.mfu, '.1f')}{'' if speed.mfu is None else '%'} | "
                     f"{cell(None if r.peak_bytes is None else r.peak_bytes / 1e9, '.2f')} | "
                     f"{cell(ratio['ours'], '.3f')} | {cell(ratio['hf'], '.3f')} | {cell(ratio['hf_compile'], '.3f')} | "
                     f"{r.losses[0]:.4f} | {r.losses[-1]:.4f} |")
    return "\n".join(lines), records


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--shape", help=f"{', '.join(SHAPES)} or layers,hidden,heads,seq,micro,vocab "
                                        "(default: 1b on cuda, tiny on cpu)")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", help=f"comma-separated, from {', '.join(ROWS)} (default: {','.join(DEFAULT_ROWS)} "
                                       f"on cuda, {','.join(CPU_ROWS)} on cpu)")
    parser.add_argument("--unfused-adamw", action="store_true", help="our rows with optimizer.params.fused false")
    parser.add_argument("--json", help="also write the rows here (rewritten after every row)")
    parser.add_argument("--breakdown", action="store_true",
                        help="profile one more step per row: time per kind of kernel, idle, launches, host syncs")
    parser.add_argument("--trace-dir", help="keep each row's chrome trace here as ROW.json.gz (implies --breakdown)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_throughput: --device {args.device}, but torch {torch.__version__} sees no GPU here; the small "
              "CPU shape runs with: bench/gpu_throughput.py --device cpu --shape tiny --precision fp32", file=sys.stderr)
        return NO_GPU
    shape_default, precision_default, rows_default = DEFAULTS.get(device.type, DEFAULTS["cpu"])
    rows = [r for r in (args.rows or ",".join(rows_default)).split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        raise SystemExit(f"--rows: choose from {', '.join(ROWS)}; got {args.rows!r}")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    shape = parse_shape(args.shape or shape_default)
    precision = PRECISIONS[args.precision or precision_default]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_throughput: {name}, torch {torch.__version__}, shape (layers, hidden, heads, seq, micro, vocab) "
          f"= {shape}, {precision}, {args.steps} steps after {args.warmup} warm-up", flush=True)
    header = {"device": name, "torch": torch.__version__, "shape": shape, "precision": precision,
              "steps": args.steps, "warmup": args.warmup}

    def write_json(results: list[Row]) -> None:
        if args.json:
            with open(args.json, "w") as out:
                json.dump({**header, "rows": table(results, shape, precision, device)[1]}, out, indent=1)

    profiled = args.breakdown or args.trace_dir is not None
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    results = measure(rows, shape, precision, device, args.steps, args.warmup, fused=not args.unfused_adamw,
                      profiled=profiled, trace_dir=args.trace_dir, on_row=write_json)
    print(table(results, shape, precision, device)[0])
    if profiled:
        print("\nWhere the time of one step goes (ms; a profiled step after the timed ones; "
              f"{'device kernels' if device.type == 'cuda' else 'aten self times'}):")
        print(breakdown_table([(r.name, r.breakdown) for r in results if r.breakdown is not None]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
