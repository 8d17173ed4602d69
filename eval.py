"""Evaluation of a checkpoint of any engine layout: `python deepy.py eval.py CONFIGS... --set load=DIR`
(docs/generate_eval.md): validation and test loss and perplexity on the configured .bin/.idx data,
and lm-evaluation-harness tasks when `eval_tasks` is set; results to eval_results_<time>.json and
to the run's metrics (metrics.jsonl, tensorboard, wandb).

Parse, load, evaluate — on one process: under a launch of several ranks, rank 0 evaluates and the
others exit at once with code 0.
"""
from __future__ import annotations

import sys

from megatron.build import user_errors
from megatron.config import load_config_json
from megatron.launch.entry_point import run_script
from megatron.launch.exit_codes import SUCCESS
from megatron.inference.evaluation import run_evaluation
from megatron.inference.loading import load_inference_model, only_rank_zero_works


def main(argv: list[str] | None = None) -> int:
    return run_script(_evaluate, __doc__, argv)


def _evaluate(config_json: str) -> int:
    with user_errors():
        cfg = load_config_json(config_json)
        local_rank = only_rank_zero_works("eval.py")
        if local_rank is None:
            return SUCCESS
        model = load_inference_model(cfg, local_rank)
        print(f"eval: {model.step_dir} (step {model.iteration}) on {model.device.type}", flush=True)
        run_evaluation(model)
    return SUCCESS


if __name__ == "__main__":
    sys.exit(main())
