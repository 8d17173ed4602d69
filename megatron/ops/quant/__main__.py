"""Command line for the quantization kernels.

    python -m megatron.ops.quant build                          # build the C++ kernels now
    python -m megatron.ops.quant check --impl triton --device cuda   # bit-exact vs the reference
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def _build(args: argparse.Namespace) -> int:
    from .cpp import CppBuildError, build_dir, load_ops
    try:
        load_ops(verbose=args.verbose)
    except CppBuildError as exc:
        print(f"[quant] {exc}", file=sys.stderr)
        return 1
    print(f"[quant] C++ kernels ready in {build_dir()}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from .select import quantizer_or_baseline
    from .selfcheck import check_all
    quantizer = quantizer_or_baseline(args.impl, args.device)
    if quantizer.name != args.impl:
        print(f"[quant] impl {args.impl!r} is not available here", file=sys.stderr)
        return 2
    results = check_all(quantizer, torch.device(args.device), args.case or None)
    if args.json:
        print(json.dumps(results))
    else:
        for name, problems in results.items():
            print(f"{'ok  ' if not problems else 'FAIL'} {name}" +
                  "".join(f"\n       {p}" for p in problems))
    return 0 if all(not p for p in results.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.ops.quant", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build (or confirm the cached build of) the C++ kernels")
    build.add_argument("--verbose", action="store_true", help="show the compiler's output")
    check = commands.add_parser("check", help="compare an implementation with the reference")
    check.add_argument("--impl", default="cpp", choices=["reference", "cpp", "triton", "triton_strided4"],
                       help="triton_strided4: the INT4 kernels' stride-2 baseline (bench/quant_kernels.py)")
    check.add_argument("--device", default="cpu", help="cpu, or cuda for triton on a GPU")
    check.add_argument("--case", action="append", help="run only this case (repeatable)")
    check.add_argument("--json", action="store_true", help="print {case: [problems]} as JSON")
    args = parser.parse_args(argv)
    return _build(args) if args.command == "build" else _check(args)


if __name__ == "__main__":
    sys.exit(main())
