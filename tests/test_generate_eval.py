"""generate.py and eval.py end to end through deepy.py, on a tiny model trained here (single process,
a few seconds) to repeat the digits 0123456789, and on the same data trained by 4 ZeRO-topo ranks.

References, none of them our inference code: the pattern itself; the validation loss the trainer
logged; the checkpoint read back by the full-tensor path (`assemble_full_state`) into a model
scored or decoded by plain loops written here.

The deepy runs start in two batches (each run keeps one core busy at most, or 4 ranks share both):
the two trainings at once, then every generate.py and eval.py run at once; the tests judge them."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import random
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, run_deepy, run_together

PATTERN = "0123456789"
SIM4_ZERO_TOPO = [str(REPO / "configs/sim-2x2.yml"), str(REPO / "configs/zero_topo.yml")]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def pattern_data(folder: Path) -> str:
    """300 documents `n: ` + the repeating digits from a random digit, as CharLevel .bin/.idx (the
    prefix gives the harness task a context that is not a number, which the harness would read as a
    choice index)."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    prefix = folder / "digits_text_document"
    rng = random.Random(0)
    with MMapIndexedDatasetBuilder(prefix) as builder:
        for _ in range(300):
            start = rng.randrange(10)
            builder.add_document(list(("n: " + (PATTERN * 12)[start:start + 100]).encode()))
    return str(prefix)


def run_config(folder: Path, data: str, **overrides) -> Path:
    cfg = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "rotary_pct": 0.5,
           "gpt_j_residual": True, "no_weight_tying": True,
           "optimizer": {"type": "Adam", "params": {"lr": 3.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8}},
           "min_lr": 3.0e-4, "warmup": 0.1, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
           "train_iters": 40, "eval_interval": 40, "eval_iters": 2, "log_interval": 10,
           "data_path": data, "split": "900,70,30", "tokenizer_type": "CharLevelTokenizer",
           "log_dir": str(folder / "logs"), "save": str(folder / "ck"), "seed": 1234}
    cfg.update(overrides)
    path = folder / "run.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def trainings(tmp_path_factory) -> dict[str, Path]:
    """Two run folders (run.yml, logs/metrics.jsonl, ck/), trained at once: "single", 40 steps on one
    process; "sharded", 12 steps on 4 ZeRO-topo ranks (every tensor split over ranks)."""
    single, sharded = tmp_path_factory.mktemp("digits"), tmp_path_factory.mktemp("digits_sharded")
    runs = run_together(
        lambda: run_deepy("train.py", str(run_config(single, pattern_data(single)))),
        lambda: run_deepy("train.py", str(run_config(sharded, pattern_data(sharded), train_iters=12, eval_iters=0,
                                                     train_micro_batch_size_per_gpu=2)), *SIM4_ZERO_TOPO))
    for result in runs:
        assert result.returncode == 0, result.stderr[-3000:]
    return {"single": single, "sharded": sharded}


@pytest.fixture(scope="module")
def trained(trainings) -> Path:
    """A run folder: run.yml, logs/metrics.jsonl, ck/ (step 40), trained on one process."""
    return trainings["single"]


@pytest.fixture(scope="module")
def inference(trainings, tmp_path_factory) -> dict:
    """Every generate.py and eval.py run of the tests below, at once: name -> (the folder its files
    are in, the finished run). The eval run only where lm_eval is installed."""
    trained, sharded = trainings["single"], trainings["sharded"]
    eval_dir, bad_dir = tmp_path_factory.mktemp("eval"), tmp_path_factory.mktemp("bad_inputs")
    calls = {
        "continues": (trained, lambda: generate(trained, ["3456", "890123"])),
        "sharded": (sharded, lambda: generate(sharded, ["0123", "7"], *SIM4_ZERO_TOPO, tokens=10)),
        "missing": (bad_dir, lambda: run_deepy(
            "generate.py", str(trained / "run.yml"), "--set", f"load={bad_dir / 'nothing'}",
            "--set", "text_gen_type=unconditional")),
        "no_prompts": (bad_dir, lambda: run_deepy(
            "generate.py", str(trained / "run.yml"), "--set", f"load={trained / 'ck'}",
            "--set", "text_gen_type=input-file", "--set", f"sample_input_file={bad_dir / 'none.txt'}")),
        "no_task": (bad_dir, lambda: run_deepy(
            "eval.py", str(trained / "run.yml"), "--set", f"load={trained / 'ck'}",
            "--set", f"eval_tasks=[{bad_dir / 'none.yaml'}]", "--set", f"eval_results_prefix={bad_dir / 'x'}")),
    }
    if importlib.util.find_spec("lm_eval") is not None:
        calls["eval"] = (eval_dir, lambda: evaluate(trained, eval_dir))
    runs = run_together(*(call for _, call in calls.values()))
    return {name: (folder, run) for (name, (folder, _)), run in zip(calls.items(), runs)}


def reference_model(step_dir: Path):
    """The checkpoint's weights by the full-tensor path, in a model built from the run's own config."""
    from megatron.checkpointing.rank_files import load_meta
    from megatron.checkpointing.param_slices import assemble_full_state
    from megatron.config import config_from_dict
    from megatron.model import GPTNeoX
    cfg = config_from_dict(load_meta(step_dir)["config"])
    model = GPTNeoX(cfg.model, cfg.model.padded_vocab_size)
    model.load_state_dict(assemble_full_state(step_dir)["params"], strict=False)  # rotary tables: buffers
    return model.eval()


def greedy_by_full_forward(model, prompt: str, steps: int) -> str:
    tokens = list(prompt.encode())
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1, :256].argmax()))
    return bytes(tokens[len(prompt):]).decode()


def generate(folder: Path, prompts: list[str], *configs: str, tokens: int = 12):
    """generate.py on the run in `folder`, its prompts from <folder>/prompts.txt (see `generated`)."""
    prompt_file = folder / "prompts.txt"
    prompt_file.write_text("\n".join(prompts) + "\n")
    return run_deepy("generate.py", str(folder / "run.yml"), *configs, "--set", f"load={folder / 'ck'}",
                     "--set", "text_gen_type=input-file", "--set", f"sample_input_file={prompt_file}",
                     "--set", f"maximum_tokens={tokens}")


def generated(folder: Path, result) -> list[dict]:
    """The records `generate` wrote for the run in `folder`, once it succeeded."""
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in Path(f"{folder / 'prompts.txt'}.output.jsonl").read_text().splitlines()]


def evaluate(trained: Path, folder: Path):
    """eval.py on the trained run with the local task; its files (task, HF_HOME, results) in `folder`."""
    task = local_task(folder)
    env = {**os.environ, **OFFLINE, "HF_HOME": str(folder / "hf")}
    return run_deepy("eval.py", str(trained / "run.yml"), "--set", f"load={trained / 'ck'}",
                     "--set", f"eval_tasks=[{task}]", "--set", f"eval_results_prefix={folder / 'digits'}", env=env)


def test_trained_model_continues_the_pattern(inference):
    records = generated(*inference["continues"])
    assert [r["context"] for r in records] == ["3456", "890123"]
    assert records[0]["text"] == "789012345678" and records[1]["text"] == "456789012345"
    assert all(r["length"] == 12 and r["finished"] is False for r in records)


def test_eval_perplexity_is_exp_of_the_logged_validation_loss_and_the_harness_matches(trained, inference):
    pytest.importorskip("lm_eval")
    tmp_path, result = inference["eval"]
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = tmp_path.glob("digits_eval_results_*.json")
    results = json.loads(path.read_text())

    logged = [json.loads(line) for line in (trained / "logs" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["validation/lm_loss"] for r in logged if r.get("iteration") == 40 and "validation/lm_loss" in r]
    assert results["iteration"] == 40 and len(valid) == 1
    assert results["data"]["validation/lm_loss_ppl"] == pytest.approx(math.exp(valid[0]), rel=1e-6)
    assert "test/lm_loss" in results["data"]
    assert any(r.get("eval/validation/lm_loss_ppl") == results["data"]["validation/lm_loss_ppl"] for r in logged)

    # every request the harness sent, scored here by hand on the independently loaded weights
    model = reference_model(trained / "ck" / "global_step40")
    samples = results["tasks"]["samples"]["digits_next"]
    assert len(samples) == 3
    for doc in samples:
        for (context, continuation), resp in zip(doc["arguments"], doc["resps"]):
            logprob, greedy = resp[0]
            expected, expected_greedy = continuation_logprob(model, context, continuation)
            assert logprob == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy
    assert results["tasks"]["results"]["digits_next"]["acc,none"] == 1.0, samples  # it learned the pattern


def local_task(folder: Path) -> Path:
    """A multiple-choice task in the harness's YAML format over a local JSONL file (no hub)."""
    rows = [{"context": "n: 234", "choices": ["56", "99"], "label": 0},
            {"context": "n: 78901", "choices": ["31", "23"], "label": 1},
            {"context": "n: 5", "choices": ["6789", "6000"], "label": 0}]
    data = folder / "digits.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = folder / "digits_next.yaml"
    task.write_text(yaml.safe_dump({
        "task": "digits_next", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}", "target_delimiter": "",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    return task


def continuation_logprob(model, context: str, continuation: str) -> tuple[float, bool]:
    ctx, cont = list(context.encode()), list(continuation.encode())  # bytes: the split is exact
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ctx + cont[:-1]]))[0].double(), dim=-1)
    rows = logprobs[len(ctx) - 1:]
    total = sum(float(rows[i, token]) for i, token in enumerate(cont))
    return total, all(int(rows[i].argmax()) == token for i, token in enumerate(cont))


def test_sharded_checkpoint_generates_what_its_weights_give(inference):
    """Trained by 4 ZeRO-topo ranks (every tensor split over ranks), generated through deepy with the
    same 4-rank configs: rank 0 generates, the others exit; the tokens are those of the same weights
    read by the full-tensor path and decoded greedily by the plain loop above."""
    tmp_path, result = inference["sharded"]
    records = generated(tmp_path, result)
    model = reference_model(tmp_path / "ck" / "global_step12")
    assert [r["text"] for r in records] == [greedy_by_full_forward(model, p, 10) for p in ("0123", "7")]


def test_bad_inputs_are_one_line_errors(inference):
    tmp_path = inference["missing"][0]
    missing, no_prompts, no_task = (inference[name][1] for name in ("missing", "no_prompts", "no_task"))
    for result, line in ((missing, f"error: the load folder {tmp_path / 'nothing'} does not exist"),
                         (no_prompts, f"error: sample_input_file {tmp_path / 'none.txt'} does not exist"),
                         (no_task, f"eval_tasks: task file {tmp_path / 'none.yaml'} does not exist")):
        assert result.returncode == 2, result.stderr[-2000:]
        assert line in result.stderr and "Traceback" not in result.stderr
