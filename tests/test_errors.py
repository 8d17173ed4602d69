"""The bad inputs of docs/errors.md that no other test runs end to end: each through deepy.py, checked
for its first error line (written with the doc's `<placeholders>`) and its exit code.

Config mistakes use `--print-config` (no rank starts, ~0.4 s each); data and checkpoint mistakes
start one rank on the tiny corpus (~2 s each).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run_together, tiny_run_config
from megatron.launch.exit_codes import SUCCESS, USAGE_ERROR

LAUNCH_LINE = re.compile(r"deepy: \d+ rank\(s\), launcher ")


def deepy(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """deepy.py outside any allocation: no WORLD_SIZE, Slurm or rendezvous variables leak in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "WORLD_SIZE", "RANK", "MASTER_"))}
    return subprocess.run([sys.executable, str(REPO / "deepy.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def pattern(message: str) -> re.Pattern:
    """docs/errors.md's form of a message: literal text, `<name>` for a part that varies."""
    parts = re.split(r"<[a-z_ ]+>", message)
    return re.compile(".+?".join(re.escape(part) for part in parts))


def first_error_line(proc: subprocess.CompletedProcess) -> str:
    """The first stderr line after deepy's notices and its launch line."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("notice:") and not LAUNCH_LINE.match(line)]
    assert lines, proc.stderr
    return lines[0]


def assert_refused(proc: subprocess.CompletedProcess, message: str, code: int = USAGE_ERROR) -> None:
    line = first_error_line(proc)
    assert pattern(message).fullmatch(line), f"{line!r}\n  is not\n{message!r}"
    assert proc.returncode == code, proc.stderr[-3000:]


# --- config: one line from deepy, no rank started ---------------------------------------------------

CONFIG_MISTAKES = [
    pytest.param("zero_optimization: {stagee: 1}\n", [],
                 "deepy: error: zero_optimization.stagee: unknown key (in <file>); did you mean 'zero_optimization.stage'?",
                 id="unknown-key-suggested"),
    pytest.param(None, ["--set", "bogus_key=1"],
                 "deepy: error: bogus_key: unknown key (in --set); see docs/config.md for the accepted keys",
                 id="unknown-key"),
    pytest.param("model: {num_layers: 2}\n", [],
                 "deepy: error: model: unknown key (in <file>); keys are NeoX's flat names (e.g. num_layers), not "
                 "grouped under 'model'; see docs/config.md", id="grouped-key"),
    pytest.param("num_layers: 2\nnum_layers: 3\n", [],
                 "deepy: error: <file>:2:1: invalid YAML: key 'num_layers' appears twice (lines 1 and 2); "
                 "fix the file's syntax", id="key-twice-in-a-file"),
    pytest.param("{num_layers: [1, 2\n", [], "deepy: error: <file>:2:1: invalid YAML: <reason>; fix the file's syntax",
                 id="invalid-yaml"),
    pytest.param("- a\n", [], "deepy: error: <file>: the top level must be a mapping of keys to values, not a list",
                 id="not-a-mapping"),
    pytest.param(None, ["--set", "memory_report_allocator=true"],
                 "deepy: error: memory_report_allocator: adds the allocator's peaks to the memory report, which is "
                 "off (in --set); set memory_report: true as well", id="allocator-without-report"),
    pytest.param(None, ["--set", "profile=true", "--set", "profile_step_start=5", "--set", "profile_step_stop=5"],
                 "deepy: error: profile_step_stop: 5 is not after profile_step_start (5) (in --set); the steps "
                 "profiled are start .. stop - 1", id="profile-stops-before-it-starts"),
    pytest.param(None, ["--set", "profile=true", "--set", "memory_report=true", "--set", "memory_report_allocator=true"],
                 "deepy: error: profile: needs torch.profiler, which memory_report_allocator holds for the whole run "
                 "(in --set); turn one of them off", id="profile-with-allocator-trace"),
    pytest.param(None, ["--set", "recompute_granularity=selective"],
                 "deepy: error: recompute_granularity: 'selective' says what a checkpointed block recomputes, and "
                 "checkpoint_activations is off (in --set); set checkpoint_activations: true",
                 id="selective-without-checkpointing"),
    pytest.param(None, ["--set", "recompute_granularity=selective", "--set", "checkpoint_activations=true",
                        "--set", "compile=true"],
                 "deepy: error: recompute_granularity: 'selective' and compile: true do not go together (torch.compile "
                 "does not trace under selective checkpointing: the blocks would run eager) (in --set); keep one: "
                 "compile, or recompute_granularity: selective", id="selective-with-compile"),
    pytest.param(None, ["--set", "num_layers"],
                 "deepy: error: --set 'num_layers': expected KEY=VALUE, e.g. --set train_iters=100 or "
                 "--set zero_optimization.stage=3", id="bad-set"),
    pytest.param(None, ["--set", "num_layers=-1"], "deepy: error: num_layers: must be >= 1, got -1 (in --set)",
                 id="out-of-range"),
    pytest.param(None, ["--set", "norm=scalenorm"],
                 "deepy: error: norm: 'scalenorm' is not supported (in --set); use one of layernorm, rmsnorm",
                 id="unsupported-value"),
    pytest.param(None, ["--set", "hidden_size=100", "--set", "num_attention_heads=3"],
                 "deepy: error: num_attention_heads: 3 heads do not divide hidden_size 100 (in --set); "
                 "pick a head count that divides hidden_size", id="heads-do-not-divide"),
    pytest.param(None, ["--set", "pipe_parallel_size=2"],
                 "deepy: error: pipe_parallel_size: 2 is not accepted (accepted: 0 or 1) (in --set); pipeline "
                 "parallelism is not supported; ZeRO-topo shards instead — set pipe_parallel_size: 1 (or 0)",
                 id="pipeline-parallel"),
    pytest.param(None, ["configs/sim-2x2x2.yml", "--set", "zero_optimization.shard_factors=[4,2,8]"],
                 "deepy: error: zero_optimization.shard_factors: (w, g, os) = (4, 2, 8) must satisfy "
                 "w | g | os | N = 8: w=4 does not divide g=2 (in --set); pick factors that nest, or a preset",
                 id="shard-factors-do-not-nest"),
    pytest.param(None, ["configs/sim-2x2x2.yml", "--set", "zero_optimization.shard_factors=[1,1,16]"],
                 "deepy: error: zero_optimization.shard_factors: (w, g, os) = (1, 1, 16) must satisfy "
                 "w | g | os | N = 8: os=16 does not divide N=8 (in --set); pick factors that nest, or a preset",
                 id="shard-factors-beyond-world"),
    pytest.param(None, ["--set", "fp16.enabled=true", "--set", "fp16.hysteresis=0"],
                 "deepy: error: fp16: hysteresis must be >= 1, got 0 (in <source>); see docs/numerics.md",
                 id="fp16-block"),
    pytest.param(None, ["--set", "communication_data_type=bf16", "--set", "fp32_allreduce=true"],
                 "deepy: error: communication_data_type: bf16 contradicts fp32_allreduce: true (in --set); keep one of "
                 "the two", id="communication-dtype-contradicts-fp32-allreduce"),
    pytest.param(None, ["--set", "gradient_predivide_factor=0"],
                 "deepy: error: gradient_predivide_factor: must be > 0.0, got 0.0 (in --set)", id="predivide-not-positive"),
    pytest.param(None, ["--set", "fp16.enabled=true", "--set", "precision=bfloat16"],
                 "deepy: error: precision: the precision keys disagree: fp16.enabled asks for fp16, precision asks "
                 "for bfloat16 (in --set); keep one way of saying it", id="precision-keys-disagree"),
    pytest.param(None, ["--set", "launcher=hostfile"],
                 "deepy: error: launcher: hostfile needs `hostfile: PATH` (lines `host slots=N`) (in --set); "
                 "set hostfile", id="hostfile-missing"),
]


@pytest.mark.parametrize("text, args, message", CONFIG_MISTAKES)
def test_config_mistakes_are_one_line_from_deepy(tmp_path, text, args, message):
    files = []
    if text is not None:
        files.append(str(tmp_path / "mine.yml"))
        Path(files[0]).write_text(text)
    proc = deepy("--print-config", "configs/tiny-cpu.yml", *files, *args)
    assert_refused(proc, message)
    assert [line for line in proc.stderr.splitlines() if not line.startswith("notice:")] == [first_error_line(proc)]
    assert proc.stdout == ""
    if files:
        assert files[0] in proc.stderr  # the file is named, not just "a config"


def test_launcher_slurm_outside_an_allocation_is_refused(tmp_path):
    proc = deepy("train.py", "configs/tiny-cpu.yml", "--set", "launcher=slurm", "--set", f"log_dir={tmp_path}")
    assert_refused(proc, "deepy: error: launcher slurm: no Slurm allocation here (SLURM_JOB_ID is unset); "
                         "run deepy.py inside sbatch or salloc, or use launcher: local")
    assert proc.stdout == ""


# --- data and tokenizer: the rank says it in one line, deepy repeats it, exit 2 ----------------------

def _copy_dataset(corpus: Path, folder: Path, bin_bytes: int | None = None, idx_bytes: int | None = None) -> Path:
    prefix = folder / "copy_text_document"
    for ext, cut in ((".bin", bin_bytes), (".idx", idx_bytes)):
        data = (corpus / f"stdlib_text_document{ext}").read_bytes()
        (folder / f"{prefix.name}{ext}").write_bytes(data if cut is None else data[:cut])
    return prefix


def _other_tokenizer(corpus: Path, folder: Path) -> Path:
    """A byte-level BPE of 280 tokens trained on part of the same text: another tokenizer."""
    from megatron.data.tokenizer_training import train_bpe_tokenizer
    texts = [json.loads(line)["text"] for line in (corpus / "stdlib.jsonl").read_text().splitlines()[:20]]
    return Path(train_bpe_tokenizer(texts, 280, str(folder / "other_tokenizer.json")))


DATA_MISTAKES = {
    "truncated-bin": "error: <prefix>.bin is truncated (<n> bytes, the index points up to <m>); "
                     "re-run tools/preprocess_data.py",
    "truncated-idx": "error: <prefix>.idx is truncated (<n> bytes, header promises <m>); re-run tools/preprocess_data.py",
    "other-tokenizer": "error: <prefix>.bin: token id <id> in sequence <n> is outside the vocabulary [0, 280); it was "
                       "tokenized with another tokenizer — re-run tools/preprocess_data.py with this run's tokenizer",
    "tokenizer-not-found": "error: HFTokenizer file not found: <path>; set tokenizer.vocab_file to a tokenizer.json "
                           "(train one with tools/train_tokenizer.py)",
    "vocab-size-disagrees": "error: tokenizer.vocab_size is 500 but <path> has 320 tokens; remove vocab_size or fix it",
    "empty-train-split": "error: the train split of <prefix> has no tokens (documents 0-0); give it more data or a "
                         "larger share in `split`",
}


def _data_mistake_settings(case: str, folder: Path, corpus: Path) -> dict:
    """The config keys that make the DATA_MISTAKES case `case`, its files written into `folder`."""
    return {
        "truncated-bin": lambda: {"data_path": str(_copy_dataset(corpus, folder, bin_bytes=1000))},
        "truncated-idx": lambda: {"data_path": str(_copy_dataset(corpus, folder, idx_bytes=100))},
        "other-tokenizer": lambda: {"vocab_file": str(_other_tokenizer(corpus, folder))},
        "tokenizer-not-found": lambda: {"vocab_file": str(folder / "nope.json")},
        "vocab-size-disagrees": lambda: {"vocab_size": 500},
        "empty-train-split": lambda: {"split": "0,1,0"},
    }[case]()


@pytest.fixture(scope="module")
def data_mistake_runs(tmp_path_factory, tiny_corpus) -> dict[str, subprocess.CompletedProcess]:
    """deepy on every DATA_MISTAKES case, the runs at once (each starts a rank of one process)."""
    configs = {}
    for case in DATA_MISTAKES:
        folder = tmp_path_factory.mktemp(case)
        configs[case] = tiny_run_config(folder, tiny_corpus, train_iters=2, eval_iters=0,
                                        **_data_mistake_settings(case, folder, tiny_corpus))
    runs = run_together(*(lambda cfg=cfg: deepy("train.py", str(cfg)) for cfg in configs.values()))
    return dict(zip(configs, runs))


@pytest.mark.parametrize("case", list(DATA_MISTAKES))
def test_data_mistakes_stop_the_rank_in_one_line(data_mistake_runs, case):
    proc = data_mistake_runs[case]
    assert_refused(proc, DATA_MISTAKES[case])
    error = first_error_line(proc)
    assert f"deepy: rank 0 exited with code 2 ({error[:60]}" in proc.stderr  # deepy names the rank and repeats it
    assert "step 1/" not in proc.stdout  # refused before any step


def test_the_padded_vocabulary_is_not_the_tokenizers(tmp_path, tiny_corpus):
    """The 280-token tokenizer pads to 384 like the data's 320-token one: ids 280..319 fit the model's
    embedding, so only the tokenizer's own size tells that the data is not its own."""
    from megatron.config import pad_vocab_size
    assert pad_vocab_size(280, 128) == pad_vocab_size(320, 128) == 384
    tokens = np.frombuffer((tiny_corpus / "stdlib_text_document.bin").read_bytes(), dtype=np.uint16)
    assert 280 <= int(tokens.max()) < 320


# --- checkpoints: a folder `load` cannot use ---------------------------------------------------------

@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, tiny_corpus, tiny_two_step_save):
    """A config and the checkpoint folder 2 steps of it saved (trained once for the session: conftest;
    the tests copy it before damaging it)."""
    folder = tmp_path_factory.mktemp("saved_run")
    cfg = tiny_run_config(folder, tiny_corpus, train_iters=2, eval_iters=0, log_interval=1, save=str(folder / "ck"))
    return cfg, tiny_two_step_save


def _damage(step: Path, case: str) -> None:
    rank_file = step / "rank_00000.pt"
    if case == "damaged-index":
        (step / "index.json").write_text("not json")
    elif case == "truncated-rank-file":
        rank_file.write_bytes(rank_file.read_bytes()[:1000])
    elif case == "flipped-bytes":  # the length stays: only the checksum tells
        data = bytearray(rank_file.read_bytes())
        data[len(data) // 2:len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 64])
        rank_file.write_bytes(bytes(data))
    elif case == "truncated-unchecked":  # a step saved before checksums: torch's own read fails
        meta = json.loads((step / "meta.json").read_text())
        del meta["rank_files"]
        (step / "meta.json").write_text(json.dumps(meta))
        rank_file.write_bytes(rank_file.read_bytes()[:1000])
    elif case == "missing-rank-file":
        rank_file.unlink()


CHECKPOINT_MISTAKES = {
    "damaged-index": ([], "error: <load>/global_step2/index.json cannot be read (<reason>): the checkpoint is damaged"),
    "truncated-rank-file": ([], "error: <load>/global_step2/rank_00000.pt is damaged: it holds <n> bytes, its save "
                                "wrote <m>; no earlier step is complete: this run must start again"),
    "flipped-bytes": ([], "error: <load>/global_step2/rank_00000.pt is damaged: crc32 <found>, its save recorded "
                          "<expected>; no earlier step is complete: this run must start again"),
    "truncated-unchecked": ([], "error: <load>/global_step2/rank_00000.pt cannot be read (<reason>): the checkpoint "
                                "is damaged; to resume from an earlier step write its name into <load>/latest"),
    "missing-rank-file": ([], "error: <load>/global_step2/rank_00000.pt is missing: the checkpoint in "
                              "<load>/global_step2 is incomplete"),
    "more-layers": (["--set", "num_layers=3"], "error: checkpoint <load>/global_step2 has no parameter "
                                               "layers.2.input_layernorm.weight: it is of a different model"),
}


@pytest.fixture(scope="module")
def checkpoint_mistake_runs(tmp_path_factory, saved_run) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Per CHECKPOINT_MISTAKES case: the damaged copy of the saved run's checkpoints, and deepy loading
    it (the runs at once, each with a log folder of its own)."""
    cfg, saved = saved_run
    loads, calls = {}, []
    for case, (args, _) in CHECKPOINT_MISTAKES.items():
        folder = tmp_path_factory.mktemp(case)
        load = folder / "ck"
        shutil.copytree(saved, load)
        _damage(load / "global_step2", case)
        loads[case] = load
        calls.append(lambda load=load, folder=folder, args=args: deepy(
            "train.py", str(cfg), "--set", f"load={load}", "--set", "train_iters=3", "--set", "save=null",
            "--set", f"log_dir={folder / 'logs'}", *args))
    return {case: (load, proc) for (case, load), proc in zip(loads.items(), run_together(*calls))}


@pytest.mark.parametrize("case", list(CHECKPOINT_MISTAKES))
def test_a_checkpoint_load_cannot_use_is_one_line(checkpoint_mistake_runs, case):
    load, proc = checkpoint_mistake_runs[case]
    _, message = CHECKPOINT_MISTAKES[case]
    assert_refused(proc, message)
    assert str(load) in first_error_line(proc)
    assert "step 3/" not in proc.stdout


def test_a_load_folder_without_checkpoints_starts_from_scratch(tmp_path, saved_run):
    cfg, _ = saved_run
    proc = deepy("train.py", str(cfg), "--set", f"load={tmp_path / 'empty'}", "--set", "save=null")
    assert proc.returncode == SUCCESS, proc.stderr[-3000:]
    assert pattern("no checkpoint in <load>: starting from scratch").fullmatch(
        next(line for line in proc.stdout.splitlines() if line.startswith("no checkpoint in ")))
    assert "step 2/2" in proc.stdout


# --- Ctrl-C ------------------------------------------------------------------------------------------

@pytest.mark.slow  # test_checkpoint_interrupts.py::test_ctrl_c_saves_then_stops_the_ranks runs the same, with a save
def test_ctrl_c_stops_every_rank_and_exits_130(tmp_path, tiny_corpus):
    """A terminal's SIGINT reaches deepy only (the ranks run in their own sessions): it stops them."""
    cfg = tiny_run_config(tmp_path, tiny_corpus, train_iters=5000, eval_iters=0, log_interval=1)
    # deepy as a terminal starts it: SIGINT at its default. A shell's background job (`pytest &`) starts
    # with SIGINT ignored, which children inherit and Python then never turns into KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, str(REPO / "deepy.py"), "train.py", str(cfg)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if line.startswith("step 2/"):
                proc.send_signal(signal.SIGINT)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert [line for line in err.splitlines() if not LAUNCH_LINE.match(line)] == ["deepy: interrupted; stopped all ranks"]
