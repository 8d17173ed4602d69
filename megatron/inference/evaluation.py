"""eval.py's work: loss and perplexity on the validation and test data, lm-evaluation-harness tasks
(`eval_tasks`), and where the results go (eval_results_<time>.json; metrics.jsonl, tensorboard
and wandb through the trainer's MetricsWriter, at the checkpoint's iteration).

The data losses are the trainer's own validation: the same sample index, the same first
`eval_iters x train_micro_batch_size_per_gpu x ranks` samples, in micro-batches of the training
size, each the mean next-token cross entropy (`lm_loss`) under the run's compute precision; the
loss is the mean over micro-batches. So for a checkpoint saved at the end of a run, eval.py's
validation perplexity is exp of the validation loss that run logged at that step.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional

import torch

from megatron.config import ConfigError, config_to_dict, world_size_of
from megatron.data import build_datasets
from megatron.engine import lm_loss
from megatron.inference.loading import InferenceModel
from megatron.logging import MetricsWriter
from megatron.training import collate

SPLITS = ("validation", "test")  # NeoX's metric prefixes of the valid and test splits


@torch.no_grad()
def data_losses(im: InferenceModel) -> dict[str, float]:
    """{"validation/lm_loss": ..., "validation/lm_loss_ppl": ..., "test/...": ...} for the splits
    the data has (none when eval_iters is 0)."""
    cfg = im.cfg
    micro = cfg.training.train_micro_batch_size_per_gpu
    batches = cfg.training.eval_iters * world_size_of(cfg)
    if batches == 0:
        return {}
    _, valid, test = build_datasets(cfg, im.tokenizer.vocab_size, 0, batches * micro)
    out = {}
    for name, dataset in zip(SPLITS, (valid, test)):
        if dataset is None:
            continue
        loss_sum = 0.0
        for step in range(batches):
            batch = collate(dataset, range(step * micro, (step + 1) * micro), im.device)
            with im.autocast():
                loss_sum += float(lm_loss(im.model, batch))
        loss = loss_sum / batches
        out[f"{name}/lm_loss"] = loss
        out[f"{name}/lm_loss_ppl"] = math.exp(min(loss, 50.0))  # the trainer's cap
    return out


def harness_results(im: InferenceModel, tasks: list[str]) -> dict:
    """The lm-evaluation-harness's results for `tasks` (names or task YAML paths) on our model."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        from megatron.inference.harness import NeoXTopoLM
    except ImportError as err:
        raise ConfigError(f"eval_tasks needs the lm-evaluation-harness ({err}); install the `eval` extra: "
                          "pip install -e '.[eval]' (or make venv)") from None
    local = [t for t in tasks if t.endswith((".yaml", ".yml"))]
    missing = [t for t in local if not Path(t).is_file()]
    if missing:
        raise ConfigError(f"eval_tasks: task file {missing[0]} does not exist")
    # the harness's own task index is read only when a task is named, not given as a file
    manager = TaskManager(include_defaults=len(local) < len(tasks))
    try:
        results = simple_evaluate(model=NeoXTopoLM(im, seed=im.cfg.data.seed), tasks=list(tasks),
                                  task_manager=manager, log_samples=True)
    except KeyError as err:  # the harness's word for a task name it does not know
        raise ConfigError(f"eval_tasks: the lm-evaluation-harness has no task {err}; see `lm_eval ls tasks`") from None
    return results


def harness_metrics(results: dict) -> dict[str, float]:
    """Flat numeric metrics, `eval/<task>/<metric>` (the harness's 'acc,none' becomes 'acc')."""
    flat = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metric = key.removesuffix(",none").replace(",", "_")
                flat[f"eval/{task}/{metric}"] = float(value)
    return flat


def results_path(cfg, now: Optional[time.struct_time] = None) -> Path:
    stamp = time.strftime("%Y-%m-%d-%H-%M-%S", now or time.localtime())
    prefix = cfg.evaluation.eval_results_prefix
    if prefix:
        return Path(f"{prefix}_eval_results_{stamp}.json")
    return Path(cfg.logging.log_dir) / f"eval_results_{stamp}.json"


def run_evaluation(im: InferenceModel) -> Path:
    """Everything eval.py does; returns the results file."""
    cfg = im.cfg
    start = time.perf_counter()
    losses = data_losses(im)
    for key, value in losses.items():
        print(f"eval: {key} {value:.4f}", flush=True)
    harness = harness_results(im, cfg.evaluation.eval_tasks) if cfg.evaluation.eval_tasks else None
    task_metrics = harness_metrics(harness) if harness else {}
    for key, value in task_metrics.items():
        print(f"eval: {key} {value:.4f}", flush=True)
    record = {"checkpoint": str(im.step_dir), "iteration": im.iteration,
              "data": losses, "tasks": _plain_harness(harness),
              "duration_seconds": time.perf_counter() - start}
    path = results_path(cfg)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, default=str, allow_nan=True))
    except OSError as err:
        raise ConfigError(f"cannot write evaluation results {path}: {err.strerror}") from None
    metrics = MetricsWriter(cfg.logging.log_dir, enabled=True, tensorboard_dir=cfg.logging.tensorboard_dir,
                            use_wandb=cfg.logging.use_wandb, wandb_project=cfg.logging.wandb_project,
                            wandb_group=cfg.logging.wandb_group, run_config=config_to_dict(cfg))
    metrics.log(im.iteration, {**{f"eval/{k}": v for k, v in losses.items()}, **task_metrics})
    metrics.close()
    print(f"eval: results in {path}", flush=True)
    return path


def _plain_harness(results: Optional[dict]) -> Optional[dict]:
    """The harness's results without what is bulky or machine-specific, each request's answer kept
    (samples: per task, doc_id, arguments, resps, target and metrics per document)."""
    if results is None:
        return None
    kept = {k: results[k] for k in ("results", "groups", "configs", "versions", "n-shot", "n-samples",
                                    "higher_is_better", "lm_eval_version") if k in results}
    kept["samples"] = {task: [{k: doc[k] for k in ("doc_id", "arguments", "resps", "target", "filter")
                               if k in doc} | {m: doc[m] for m in doc.get("metrics", []) if m in doc}
                              for doc in docs]
                       for task, docs in results.get("samples", {}).items()}
    return kept
