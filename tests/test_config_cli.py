"""deepy.py --print-config through a subprocess: exit codes and the one-line error contract."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
NEOX_SAMPLES = REPO.parent / "shared" / "external" / "gpt-neox" / "configs"


def deepy(*args: str, env_extra: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SLURM_NTASKS", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(REPO / "deepy.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("notice:")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("deepy: error: ") and "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_print_config_prints_the_derived_config_and_exits_0():
    proc = deepy("--print-config", "configs/tiny-cpu.yml", "configs/sim-2x2x2.yml", "configs/zero_topo.yml",
                 "--set", "train_iters=50", "--set", "zero_optimization.zero_quantized_weights=true")
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)
    assert data["topology"]["world_size"] == 8 and data["zero"]["resolved_factors"] == [2, 4, 8]
    assert data["training"]["gradient_accumulation_steps"] == 1 and data["training"]["train_iters"] == 50
    assert data["zero"]["zero_quantized_weights"] is True
    assert data["config_files"] == ["configs/tiny-cpu.yml", "configs/sim-2x2x2.yml", "configs/zero_topo.yml"]
    assert "Traceback" not in proc.stderr


def test_print_config_accepts_a_script_argument_and_conf_dir(tmp_path):
    proc = deepy("--print-config", "train.py", "-d", "configs", "tiny-cpu.yml", cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["training"]["gradient_accumulation_steps"] == 8


@pytest.mark.parametrize("args,fragments", [
    (["configs/tiny-cpu.yml", "configs/tiny-cpu.yml"], ["num_layers: set in both configs/tiny-cpu.yml and configs/tiny-cpu.yml"]),
    (["configs/tiny-cpu.yml", "--set", "num_layer=3"], ["num_layer: unknown key (in --set); did you mean 'num_layers'?"]),
    (["configs/tiny-cpu.yml", "--set", "num_layers=many"], ["num_layers: expected an integer, got 'many' (in --set)"]),
    (["configs/missing.yml"], ["config file not found: configs/missing.yml"]),
    (["configs/tiny-cpu.yml", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["configs/tiny-cpu.yml", "--set", "topology.simulate=[3, 1]"], ["train_batch_size: 32 is not a multiple"]),
])
def test_print_config_errors_are_one_line_without_traceback(args, fragments):
    assert_one_line_error(deepy("--print-config", *args), *fragments)


def test_launch_without_a_script_is_a_one_line_error():
    assert_one_line_error(deepy("configs/tiny-cpu.yml"), "no training script given")
    assert_one_line_error(deepy("missing_train.py", "configs/tiny-cpu.yml"), "training script not found")


def test_an_external_world_size_that_disagrees_with_the_layout_is_an_error():
    proc = deepy("--print-config", "configs/tiny-cpu.yml", "configs/sim-2x2.yml", env_extra={"WORLD_SIZE": "8"})
    assert_one_line_error(proc, "the configured layout has 4 ranks", "WORLD_SIZE=8")


@pytest.mark.skipif(not (NEOX_SAMPLES / "20B.yml").is_file(), reason=f"GPT-NeoX samples not found at {NEOX_SAMPLES}")
def test_neox_samples_through_the_cli():
    ok = deepy("--print-config", str(NEOX_SAMPLES / "125M.yml"), str(NEOX_SAMPLES / "local_setup.yml"))
    assert ok.returncode == 0 and "notice: ignoring" in ok.stderr
    assert_one_line_error(deepy("--print-config", str(NEOX_SAMPLES / "20B.yml")),
                          "pipeline parallelism is not supported; ZeRO-topo shards instead")


def test_without_config_files_the_embedded_tiny_cpu_default_is_used():
    proc = deepy("--print-config")
    assert proc.returncode == 0, proc.stderr
    assert "tiny-cpu.yml" in proc.stderr
    assert yaml.safe_load(proc.stdout)["config_files"][0].endswith("configs/tiny-cpu.yml")
