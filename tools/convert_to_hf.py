#!/usr/bin/env python
"""Export a NeoX-Topo checkpoint step (saved under any layout) as a Hugging Face GPTNeoXForCausalLM, or,
for a Llama-shaped model (norm rmsnorm, activation swiglu), LlamaForCausalLM / MistralForCausalLM
(with a sliding window).

    python tools/convert_to_hf.py --input_dir checkpoints/tiny-cpu/global_step200 --output_dir hf/tiny

Reading the master weights shows progress on stderr: a bar with rate and ETA on a terminal, a line
every 10% or 30 s otherwise (--no-progress: none).
"""
import argparse
import sys

import torch

from megatron.checkpointing.rank_files import CheckpointError
from megatron.checkpointing.hf import HFConversionError
from megatron.checkpointing.hf_io import export_hf
from megatron.config import ConfigError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input_dir", required=True, help="a global_stepN checkpoint folder")
    parser.add_argument("--output_dir", required=True, help="where to write config.json + model.safetensors")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--no-progress", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    try:
        out = export_hf(args.input_dir, args.output_dir, dtype, progress=not args.no_progress)
    except (CheckpointError, ConfigError, HFConversionError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
