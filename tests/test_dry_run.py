"""`deepy.py --dry-run`: validate, print the launch (commands, environment, layout, groups, parameter
count, model-state memory per device), start and write nothing; inside a Slurm allocation the node
and task counts come from the allocation, and a layout that does not match it is refused."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, run_together
from megatron.config import load_config
from megatron.launch.launcher import launch, plan_launch

BIG = ["configs/20B.yml", "configs/frontier.yml", "configs/zero_topo.yml", "configs/local_setup.yml"]
# GPT-NeoX-20B as published (Hugging Face EleutherAI/gpt-neox-20b): 20,554,567,680 parameters with
# its vocabulary padded to 50,432. Our 20B.yml pads 50,277 to a multiple of 128 only (50,304): two
# matrices of 128 x 6144 fewer.
PARAMS_20B = 20_554_567_680 - 2 * (50_432 - 50_304) * 6144


def deepy(*args: str, env_extra: dict | None = None, cwd=REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "WORLD_SIZE", "RANK", "MASTER_"))}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(REPO / "deepy.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def slurm_job(nodes: int, per_node: int | None = None, gpus: int | None = None) -> dict:
    env = {"SLURM_JOB_ID": "777", "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NODELIST": f"frontier[1-{nodes}]"}
    if per_node is not None:
        env["SLURM_NTASKS_PER_NODE"] = f"{per_node}(x{nodes})"
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return env


def test_dry_run_of_the_20B_inside_a_two_node_frontier_allocation(tmp_path):
    proc = deepy("--dry-run", *BIG, "--set", f"log_dir={tmp_path / 'logs'}", env_extra=slurm_job(2, per_node=8))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    srun = re.search(r"^  (srun .*)$", out, re.M).group(1).split()
    assert srun[:8] == ["srun", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--distribution=block",
                        "--gpus-per-task=1", "--gpu-bind=closest", "-c7"]
    assert srun[8:12] == ["--kill-on-bad-exit=1", sys.executable, "train.py", "--neox-config-json"]
    assert srun[12].startswith(str(tmp_path / "logs" / "neox_config_")) and len(srun) == 13
    assert "world size: 16 ranks = 2 nodes x 4 GPUs x 2 GCDs (frontier); 8 rank(s) per node" in out
    # Rank mapping: rank = node x 8 + gpu x 2 + gcd; rank 5 is node 0, GPU 2, GCD 1.
    assert re.search(r"^\s+5\s+0\s+2\s+1$", out, re.M)
    # The port follows the job (20000 + 777 mod 10000); Frontier's libfabric settings and a node-local Triton cache.
    assert "MASTER_PORT=20777" in out and "FI_MR_CACHE_MONITOR=kdreg2" in out and "FI_CXI_RDZV_EAGER_SIZE=0" in out
    assert re.search(r"^  TRITON_CACHE_DIR=/tmp/triton-\S+-777$", out, re.M)
    # Groups and the tier each spans, for (w, g, os) = (2, 8, 16).
    assert "(w, g, os) = (2, 8, 16) on N = 16" in out
    assert re.search(r"weight\s+group of\s+2: .*spans intra_gpu; rank 0's: \{0, 1\}", out)
    assert re.search(r"stride\s+group of\s+4: .*spans intra_node; rank 0's: \{0, 2, 4, 6\}", out)
    assert re.search(r"cross\s+group of\s+2: .*spans inter_node; rank 0's: \{0, 8\}", out)
    assert f"{PARAMS_20B:,} parameters" in out
    # Per GCD, by hand: bf16 weights over 2 (1 byte/param), fp32 gradients over 8 (0.5), fp32 master
    # and two Adam moments over 16 (0.25 + 0.5): 2.25 bytes per parameter (padding is < 1 kB).
    total_gb = 2.25 * PARAMS_20B / 1e9
    line = re.search(r"model states per device .*: ([\d.]+) GB = (.*) GB", out)
    assert abs(float(line.group(1)) - total_gb) < 0.006
    parts = dict(re.findall(r"([a-z ]+?) ([\d.]+)(?:,|$)", line.group(2)))
    expected = {"weights": PARAMS_20B / 1e9, "grad accumulator": PARAMS_20B / 2e9, "master": PARAMS_20B / 4e9,
                "moments": PARAMS_20B / 2e9}
    assert {k.strip(): pytest.approx(float(v), abs=0.006) for k, v in parts.items()} == expected
    assert not (tmp_path / "logs").exists()  # nothing written


def test_dry_run_takes_the_nodes_from_the_allocation_never_from_this_machine(tmp_path):
    proc = deepy("--dry-run", *BIG, "--set", f"log_dir={tmp_path}", env_extra=slurm_job(48, gpus=8))
    assert proc.returncode == 0, proc.stderr
    assert "srun --nodes=48 --ntasks=384 --ntasks-per-node=8" in proc.stdout
    assert "(w, g, os) = (2, 8, 384) on N = 384" in proc.stdout


@pytest.mark.parametrize("alloc, needs", [
    (slurm_job(2, per_node=4), "needs 8 ranks per node"),
    (slurm_job(2, gpus=4), "needs 8 ranks per node"),
])
def test_a_mismatched_allocation_is_refused_in_one_line(tmp_path, alloc, needs):
    for mode in (["--dry-run"], ["train.py"]):
        proc = deepy(*mode, *BIG, "--set", f"log_dir={tmp_path}", env_extra=alloc)
        assert proc.returncode == 2 and proc.stdout == ""
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith("deepy: error: the Slurm allocation (job 777) has 2 nodes") and needs in line, line


def test_explicit_node_count_must_match_the_allocation(tmp_path):
    proc = deepy("--dry-run", *BIG, "--set", "num_nodes=4", env_extra=slurm_job(2, per_node=8))
    assert proc.returncode == 2
    assert "has 2 nodes x 8 ranks per node" in proc.stderr and "needs 4 nodes" in proc.stderr


def test_slurm_launcher_without_a_topology_takes_the_layout_from_the_allocation(tmp_path):
    cfg_file = tmp_path / "c.yml"
    cfg_file.write_text("launcher: slurm\ntrain_micro_batch_size_per_gpu: 1\nvocab_size: 1000\n")
    log_dir = f"log_dir={tmp_path}"
    proc, given, none, unknown = run_together(  # four dry runs at once
        lambda: deepy("--dry-run", str(cfg_file), "--set", log_dir, env_extra=slurm_job(3, per_node=4)),
        lambda: deepy("--dry-run", str(cfg_file), "--set", log_dir, env_extra=slurm_job(3, per_node=4, gpus=4)),
        lambda: deepy("--dry-run", str(cfg_file), "--set", log_dir,
                      env_extra={**slurm_job(3, per_node=4), "SLURM_GPUS_PER_NODE": "0"}),
        lambda: deepy("--dry-run", str(cfg_file), env_extra=slurm_job(3)))
    assert proc.returncode == 0, proc.stderr
    assert "srun --nodes=3 --ntasks=12 --ntasks-per-node=4" in proc.stdout
    # `device: auto` in an allocation that names no GPUs: the GPUs this machine sees decide (none on a
    # CPU-only Slurm, where --gpus-per-task=1 is refused and the dry run used to say "4 GPUs").
    from megatron.topology.allocation import visible_gpu_count
    on_gpus = visible_gpu_count() > 0
    assert ("--gpus-per-task=1" in proc.stdout) == on_gpus
    assert f"world size: 12 ranks = 3 nodes x 4 {'GPUs' if on_gpus else 'ranks per node'}" in proc.stdout
    # The allocation's word wins either way: GPUs given, or none (`sbatch --gpus-per-node=0`).
    assert "--gpus-per-task=1 --gpu-bind=closest" in given.stdout and "3 nodes x 4 GPUs" in given.stdout, given.stderr
    assert "--gpus-per-task" not in none.stdout and "3 nodes x 4 ranks per node" in none.stdout, none.stderr
    assert unknown.returncode == 2 and "does not fix the ranks per node" in unknown.stderr


def test_local_dry_run_lists_the_processes_and_starts_none(tmp_path):
    proc = deepy("--dry-run", "configs/tiny-cpu.yml", "configs/sim-2x2x2.yml", "configs/zero3.yml",
                 "--set", f"log_dir={tmp_path / 'logs'}", "--set", "vocab_size=512")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "launcher: local (this machine)" in out
    assert "commands: 8 processes on this machine, each running" in out
    assert "RANK=0" in out and "WORLD_SIZE=8" in out and "NEOX_TOPO_SIMULATED=1" in out
    assert "MASTER_PORT=<a free port, picked at launch>" in out
    assert "(w, g, os) = (8, 8, 8) on N = 8" in out
    assert re.search(r"weight\s+group of\s+8: .*spans inter_node", out)
    assert not (tmp_path / "logs").exists()


def test_slurm_dry_run_outside_an_allocation_says_launch_would_refuse(tmp_path):
    proc = deepy("--dry-run", *BIG, "--set", "num_nodes=2")
    assert proc.returncode == 0, proc.stderr
    assert "note: launcher slurm: no Slurm allocation here (SLURM_JOB_ID is unset)" in proc.stdout
    assert "srun --nodes=2 --ntasks=16" in proc.stdout


def test_the_plan_is_what_launch_executes(tmp_path):
    env = dict(slurm_job(2, per_node=8), MASTER_ADDR="head0", PATH=os.environ["PATH"])
    cfg = load_config([str(REPO / p) for p in BIG], env=env, notices=[])
    plan = plan_launch(cfg, "train.py", "/run/c.json", ["--x"], env)
    calls = []
    launch(cfg, "train.py", "/run/c.json", extra_args=["--x"], env=env, execute=lambda cmd, e: calls.append((cmd, e)) or 0)
    assert calls == [(plan.commands[0], plan.envs[0])]
    assert plan.envs[0]["MASTER_ADDR"] == "head0" and plan.commands[0][-1] == "--x"


def test_dry_run_with_plan_auto_shows_the_chosen_layout_and_the_predicted_step(tmp_path):
    """plan: auto has no layout in the config: the dry run runs the planner (what every rank will do
    at start-up), shows its layout and reason, and the time model's step for it."""
    args = ["configs/20B.yml", "configs/frontier.yml", "configs/local_setup.yml", "--set", "zero_optimization.plan=auto",
            "--set", "zero_optimization.plan_memory_per_device_gb=40", "--dry-run"]
    out = deepy(*args, env_extra=slurm_job(8, gpus=8))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    chosen = re.search(r"sharding: (\S+), \(w, g, os\) = \((\d+), (\d+), (\d+)\) on N = 64", text)
    assert chosen, text
    w, g, os_ = map(int, chosen.groups()[1:])
    assert g % w == 0 and os_ % g == 0 and 64 % os_ == 0
    reason = next(line for line in text.splitlines() if "chosen by zero_optimization.plan auto" in line)
    peak, budget = map(float, re.search(r"peak ([\d.]+) GB of ([\d.]+) GB", reason).groups())
    assert budget == 40.0 and peak <= budget
    # on Frontier with no probe file: the published figures, named, and one line saying how to replace them
    assert re.search(r"predicted optimizer step \(time model, figures frontier-measured \(published RCCL[^)]*\)\): "
                     r"[\d.]+ s", text), text
    assert "figures: frontier-measured (a Frontier topology and no probe file" in reason + text
    assert "figures: frontier-measured (published RCCL" in reason
    # the same configs without a vocabulary: the plan cannot be made, and the dry run says why
    no_vocab = deepy(*args, "--set", "vocab_size=null", "--set", "vocab_file=/nonexistent/tokenizer.json",
                     env_extra=slurm_job(8, gpus=8))
    assert no_vocab.returncode == 0, no_vocab.stderr
    assert "chosen at start-up by zero_optimization.plan auto; the vocabulary is unknown here" in no_vocab.stdout
