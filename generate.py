"""Text generation from a checkpoint of any engine layout: `python deepy.py generate.py CONFIGS...
--set load=DIR` (docs/generate_eval.md). deepy writes the config once; this runs on every rank.

Parse, load, generate — on one process: when the configs start several ranks (a training layout
such as configs/sim-2x2.yml), rank 0 does the work and the others exit at once with code 0.
"""
from __future__ import annotations

import sys

from megatron.build import user_errors
from megatron.config import load_config_json
from megatron.launch.entry_point import run_script
from megatron.launch.exit_codes import SUCCESS
from megatron.inference.loading import load_inference_model, only_rank_zero_works
from megatron.inference.text_generation import run_generation


def main(argv: list[str] | None = None) -> int:
    return run_script(_generate, __doc__, argv)


def _generate(config_json: str) -> int:
    with user_errors():
        cfg = load_config_json(config_json)
        local_rank = only_rank_zero_works("generate.py")
        if local_rank is None:
            return SUCCESS
        model = load_inference_model(cfg, local_rank)
        print(f"generate: {model.step_dir} (step {model.iteration}) on {model.device.type}; "
              f"text_gen_type {cfg.generation.text_gen_type}", flush=True)
        run_generation(model)
    return SUCCESS


if __name__ == "__main__":
    sys.exit(main())
