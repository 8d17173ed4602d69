"""Benchmark the block-quantization kernels against torch.clone measured in the same run.

    .venv/bin/python bench/quant_kernels.py                      # 16M, 64M, 256M elements
    .venv/bin/python bench/quant_kernels.py --sizes 4M,16M --blocks 256,1024,2048,4096,8192

For each size: torch.clone of the fp32 input (the memory-bandwidth baseline), then for each
implementation, bit width and block size the time of quantize, dequantize (to fp32) and the fused
reduce_requantize over k chunks. GB/s counts bytes read plus bytes written (clone: 2 x 4n);
`x clone` is clone's time over the kernel's time (1.0 = as fast as a copy); `x ref` is the
reference's time over the kernel's time; `% copy` is the kernel's GB/s as a share of clone's (the
memory bound: issue 26's goals are 60% for quantize and dequantize, 40% for reduce_requantize). `--accuracy` adds the relative RMS error per block size
(and the bytes the scales add per element), the other half of choosing a default block size.
Implementations: reference and cpp on CPU; triton on a CUDA/ROCm device (`--device cuda`).
`--impls triton,triton_strided4` times the INT4 kernels against their stride-2 baseline
(StridedInt4Quantizer: the fp32 side read and written at stride 2, as before 145ef0a; same bits).
`--baseline-kernels FILE` adds `baseline`: the Triton kernels of another version of
megatron/ops/quant/triton_kernels.py, timed by the same clock in the same run (an A/B of a kernel
change; its output is first compared with the reference's, bit for bit). The file must implement
the rows hooks (megatron/ops/quant/base.py; from 62dd09b on); an older one is refused in one line:

    python bench/quant_kernels.py --device cuda --sizes 16M --impls triton,baseline \
        --baseline-kernels cache/other_triton_kernels.py
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import time
from typing import Callable, Optional

import torch

from megatron.ops.quant import get_quantizer
from megatron.ops.quant.select import BASELINES, quantizer_or_baseline
from megatron.ops.quant.base import Quantizer
from megatron.ops.quant.reference import ReferenceQuantizer

BASELINE = "baseline"


def parse_count(text: str) -> int:
    """'16M' -> 16 * 2**20, '512K' -> 512 * 2**10, '1000' -> 1000."""
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def timed(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    """Best time of one fn() over `repeat` runs after one warm-up run: the device's time on a GPU
    (device_time), the wall time on the CPU."""
    if device.type == "cuda":
        return device_time(fn, repeat, device)
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)  # best of: the least disturbed run on a shared machine


def device_time(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    """The GPU's own time for one fn(), not the host's: CUDA events around the call, queued behind
    a ~1 ms spin kernel so that the launch (Python, the Quantizer's checks, Triton's launcher: tens
    of microseconds, as long as a 16M-element kernel) happens while the device is still busy, and a
    256 MiB write before it so the input does not start in L2 (the H200's is 50 MiB). Timing one
    call with a host clock and a synchronize (this script until 2026-12-05) counted the launch and
    the synchronize's latency in every kernel's and clone's time."""
    flush = torch.empty(64 << 20, dtype=torch.int32, device=device)
    fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        torch.cuda._sleep(2_000_000)  # cycles: ~1 ms at 1.5-2 GHz
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return min(times)


def code_bytes(n: int, bits: int, block: int) -> int:
    return (n if bits == 8 else n // 2) + 4 * (n // block)


def bench_size(n: int, args: argparse.Namespace, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen).to(device)
    t_clone = timed(lambda: x.clone(), args.repeat, device)
    print(f"\n== n = {n:,} elements ({4 * n / 2 ** 20:.0f} MiB fp32), torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'impl':<10}{'bits':>5}{'block':>7}  {'op':<18}{'ms':>9}{'GB/s':>8}{'x clone':>9}"
          f"{'x ref':>8}{'% copy':>8}")
    copy_rate = 8 * n / t_clone
    print(f"{'torch':<10}{'':>5}{'':>7}  {'clone':<18}{t_clone * 1e3:9.2f}"
          f"{copy_rate / 1e9:8.2f}{1.0:9.2f}{'':>8}{100.0:8.1f}")
    reference_times: dict[tuple, float] = {}
    for impl in args.impls:
        quantizer = args.baseline if impl == BASELINE else quantizer_or_baseline(impl, device)
        if quantizer is None or (impl != BASELINE and quantizer.name != impl):
            print(f"{impl:<10} unavailable here, skipped")
            continue
        for bits in args.bits:
            for block in args.blocks:
                if n % (block * args.k):
                    print(f"{impl:<10}{bits:>5}{block:>7}  n not a multiple of block * k, skipped")
                    continue
                codes, scales = quantizer.quantize(x, bits, block)
                if (impl == BASELINE or impl in BASELINES) and not same_as_reference(x, codes, scales, bits, block):
                    print(f"{impl:<10}{bits:>5}{block:>7}  quantize differs from the reference: not timed")
                    continue
                stored = code_bytes(n, bits, block)
                chunk = n // args.k
                ops = {
                    "quantize": (lambda: quantizer.quantize(x, bits, block), 4 * n + stored),
                    "dequantize": (lambda: quantizer.dequantize(codes, scales, bits, block),
                                   stored + 4 * n),
                    f"reduce_requant k={args.k}": (
                        lambda: quantizer.reduce_requantize(codes, scales, args.k, bits, block),
                        stored + code_bytes(chunk, bits, block)),
                }
                for op, (fn, moved) in ops.items():
                    t = timed(fn, args.repeat, device)
                    key = (bits, block, op)
                    if impl == "reference":
                        reference_times[key] = t
                    ref = reference_times.get(key)
                    ratio = f"{ref / t:8.2f}" if ref else f"{'':>8}"
                    print(f"{impl:<10}{bits:>5}{block:>7}  {op:<18}{t * 1e3:9.2f}"
                          f"{moved / t / 1e9:8.2f}{t_clone / t:9.2f}{ratio}{100 * moved / t / copy_rate:8.1f}")


def load_baseline(path: str) -> Quantizer:
    """The TritonQuantizer of another version of triton_kernels.py, loaded as a module of
    megatron.ops.quant so that its relative imports (``.base``) resolve to this checkout's."""
    spec = importlib.util.spec_from_file_location("megatron.ops.quant._baseline_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    hook = inspect.signature(module.TritonQuantizer._quantize).parameters
    if "codes" not in hook:  # returns its codes instead of writing them into the rows it is given
        raise SystemExit(f"{path}: its kernels have the hooks of before 62dd09b (they return encoded data; this "
                         f"checkout's Quantizer hands them rows to write into): port it to the rows hooks, or "
                         f"time it with the bench of its own commit")
    return module.TritonQuantizer()


def same_as_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int) -> bool:
    want_codes, want_scales = ReferenceQuantizer().quantize(x, bits, block)
    return torch.equal(codes, want_codes) and torch.equal(scales, want_scales)


def accuracy(args: argparse.Namespace) -> None:
    """Relative RMS error of quantize -> dequantize per block size, on two distributions."""
    n = 1 << 22
    gen = torch.Generator().manual_seed(1)
    samples = {
        "normal": torch.randn(n, generator=gen),
        # heavy tails, like gradients: a few large entries set each block's scale
        "student-t(3)": torch.distributions.StudentT(3.0).sample((n,)),
    }
    quantizer = get_quantizer("reference")
    print(f"\n== accuracy: relative RMS error of dequantize(quantize(x)), n = {n:,}")
    print(f"{'block':>7}{'scale B/elt':>13}" + "".join(
        f"{f'INT{b} {name}':>22}" for b in args.bits for name in samples))
    for block in args.blocks:
        row = f"{block:>7}{4 / block:13.4f}"
        for bits in args.bits:
            for x in samples.values():
                y = quantizer.dequantize(*quantizer.quantize(x, bits, block), bits, block)
                row += f"{float((y - x).norm() / x.norm()):22.4f}"
        print(row)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16M,64M,256M", help="element counts, e.g. 1M,16M")
    parser.add_argument("--blocks", default="2048", help="block sizes, e.g. 256,1024,4096")
    parser.add_argument("--bits", default="8,4", help="8, 4 or both")
    parser.add_argument("--impls", default=None,
                        help="reference,cpp (CPU default) or reference,triton (GPU default)")
    parser.add_argument("--k", type=int, default=8, help="chunks summed by reduce_requantize")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per measurement")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--accuracy", action="store_true", help="also print errors per block")
    parser.add_argument("--baseline-kernels", help="another version's triton_kernels.py, timed as impl 'baseline'")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.blocks = [parse_count(b) for b in args.blocks.split(",")]
    args.bits = [int(b) for b in args.bits.split(",")]
    default_impls = "reference,cpp" if device.type == "cpu" else "reference,triton"
    args.impls = (args.impls or default_impls).split(",")
    args.baseline: Optional[Quantizer] = load_baseline(args.baseline_kernels) if args.baseline_kernels else None
    if BASELINE in args.impls and args.baseline is None:
        parser.error("impl 'baseline' needs --baseline-kernels FILE")
    if args.baseline is not None and BASELINE not in args.impls:
        args.impls.append(BASELINE)
    if args.threads:
        torch.set_num_threads(args.threads)
    for size in args.sizes.split(","):
        bench_size(parse_count(size), args, device)
    if args.accuracy:
        accuracy(args)


if __name__ == "__main__":
    main()
