"""What a rank and the slurm launcher read from a Slurm environment, on fake environments (the real
Slurm checks are tests/test_slurm_real.py): GPUs from the allocation, the job's rendezvous port, the
rank's identity under srun, and how a launched rank leaves."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO
from megatron.config import ConfigError, load_config
from megatron.launch.entry_point import in_a_launched_group, leave_without_gloo_teardown
from megatron.launch.launcher import (DEFAULT_MASTER_PORT, job_master_port, slurm_env, slurm_rendezvous,
                                      srun_command)
from megatron.runtime import launch_line, launched_as, pick_device
from megatron.topology.allocation import allocation_from_env, run_uses_gpus

JOB = {"SLURM_JOB_ID": "31", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "2"}


def load(tmp_path, text: str, env: dict):
    path = tmp_path / "c.yml"
    path.write_text("train_micro_batch_size_per_gpu: 1\n" + text)
    return load_config([str(path)], env=env, notices=[])


@pytest.mark.parametrize("variables,gpus", [
    ({"SLURM_GPUS_ON_NODE": "8"}, 8), ({"SLURM_JOB_GPUS": "0,1,2,3"}, 4), ({"SLURM_GPUS_PER_NODE": "a100:2"}, 2),
    ({"SLURM_GPUS_PER_NODE": "0"}, 0), ({"SLURM_GPUS_ON_NODE": "0"}, 0), ({}, None)])
def test_the_allocations_gpus_come_from_whichever_variable_slurm_set(variables, gpus):
    assert allocation_from_env({**JOB, **variables}).gpus_per_node == gpus


def test_device_auto_follows_the_allocation_then_the_preset_then_the_visible_gpus():
    no_gpus, gpus, unsaid = (allocation_from_env({**JOB, **v}) for v in
                             ({"SLURM_GPUS_PER_NODE": "0"}, {"SLURM_GPUS_ON_NODE": "4"}, {}))
    one_visible, none_visible = (lambda: 1), (lambda: 0)
    assert run_uses_gpus("auto", None, gpus, none_visible) is True
    assert run_uses_gpus("auto", "frontier", no_gpus, one_visible) is False  # `sbatch --gpus-per-node=0`
    assert run_uses_gpus("auto", "dgx", unsaid, none_visible) is True
    assert run_uses_gpus("auto", None, unsaid, none_visible) is False  # a CPU-only Slurm
    assert run_uses_gpus("auto", None, unsaid, one_visible) is True
    assert run_uses_gpus("auto", None, None, one_visible) is True
    assert run_uses_gpus("cpu", "frontier", gpus, one_visible) is False
    assert run_uses_gpus("cuda", None, no_gpus, none_visible) is True


def test_the_srun_line_binds_gpus_only_when_the_allocation_has_them(tmp_path):
    for variables, bound in (({"SLURM_GPUS_ON_NODE": "2"}, True), ({"SLURM_GPUS_PER_NODE": "0"}, False)):
        env = {**JOB, **variables}
        cmd = srun_command(load(tmp_path, "launcher: slurm\n", env), ["x"], env)
        assert cmd[:5] == ["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--distribution=block"]
        assert ("--gpus-per-task=1" in cmd and "--gpu-bind=closest" in cmd) == bound, cmd


def test_the_rendezvous_port_follows_the_job_and_an_explicit_one_wins(tmp_path):
    assert job_master_port({"SLURM_JOB_ID": "4242"}) == 24242
    assert job_master_port({"SLURM_JOB_ID": "14242"}) == 24242  # ids 10000 apart share one: documented
    assert len({job_master_port({"SLURM_JOB_ID": str(j)}) for j in range(100, 200)}) == 100
    assert 20000 <= job_master_port({"SLURM_JOB_ID": "het_7"}) < 30000  # not a number: still in the range
    assert job_master_port({}) == DEFAULT_MASTER_PORT
    cfg = load(tmp_path, "launcher: slurm\n", JOB)
    assert slurm_env(cfg, JOB, "node1")["MASTER_PORT"] == str(20031)
    assert slurm_env(cfg, {**JOB, "MASTER_PORT": "6000"}, "node1")["MASTER_PORT"] == "6000"
    assert slurm_env(cfg, {**JOB, "MASTER_PORT": ""}, "node1")["MASTER_PORT"] == str(20031)
    pinned = load(tmp_path, "launcher: slurm\nmaster_port: 7000\n", JOB)
    assert slurm_env(pinned, {**JOB, "MASTER_PORT": "6000"}, "node1")["MASTER_PORT"] == "7000"


def test_plain_srun_tasks_get_the_jobs_rendezvous():
    hosts = lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, stdout="node7\nnode8\n")
    env = {"SLURM_JOB_ID": "55", "SLURM_JOB_NODELIST": "node[7-8]"}
    assert slurm_rendezvous(env, run=hosts) == {"MASTER_ADDR": "node7", "MASTER_PORT": "20055"}
    assert slurm_rendezvous({}, run=hosts) == {}


def test_a_rank_reads_slurms_variables_and_an_empty_world_size_is_unset():
    srun = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}
    assert launched_as(srun) == (3, 4, 1)
    assert launched_as({**srun, "WORLD_SIZE": "", "RANK": " ", "LOCAL_RANK": ""}) == (3, 4, 1)
    assert launched_as({**srun, "WORLD_SIZE": "8", "RANK": "5"}) == (5, 8, 1)  # torchrun's names first
    assert launched_as({}) == (0, 1, 0)
    with pytest.raises(ConfigError, match=r"^environment variable WORLD_SIZE='four' is not a number"):
        launched_as({"WORLD_SIZE": "four"})
    assert launch_line({"SLURMD_NODENAME": "node2", "MASTER_ADDR": "node1", "MASTER_PORT": "20031"}, 3, 4, 1) == \
        "launch: rank 3 of 4, local rank 1, node node2, rendezvous node1:20031"


def test_a_launched_rank_is_recognised_after_its_group_is_gone():
    assert in_a_launched_group({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"})  # srun sets no WORLD_SIZE
    assert in_a_launched_group({"WORLD_SIZE": "2"})
    assert not in_a_launched_group({"SLURM_NTASKS": "1"}) and not in_a_launched_group({})
    assert in_a_launched_group({"WORLD_SIZE": "x"})  # unreadable: leave the hard way
    exits = []
    leave_without_gloo_teardown(75, {"SLURM_NTASKS": "4"}, exit_now=exits.append)
    leave_without_gloo_teardown(75, {}, exit_now=exits.append)
    assert exits == [75]


# A rank script: its work returns 75 (stopped and saved); an atexit hook shows whether the process
# went through the interpreter's teardown (where gloo's threads can abort) or left by os._exit.
RANK_SCRIPT = textwrap.dedent("""\
    import atexit, sys
    sys.path.insert(0, {repo!r})
    from megatron.launch.entry_point import run_script
    atexit.register(lambda: print("interpreter teardown", flush=True))
    sys.exit(run_script(lambda config_json: 75, argv=["--neox-config-json", "unused.json"]))
""")


@pytest.mark.parametrize("env,torn_down", [({"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}, False), ({}, True)])
def test_an_srun_task_leaves_with_its_code_without_the_interpreter_teardown(tmp_path, env, torn_down):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(repo=str(REPO)))
    clean = {k: v for k, v in __import__("os").environ.items()
             if not k.startswith(("SLURM_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NEOX_"))}
    proc = subprocess.run([sys.executable, str(script)], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 75, proc.stderr
    assert ("interpreter teardown" in proc.stdout) == torn_down


def test_one_gpu_per_task_means_device_0_whatever_the_local_rank(monkeypatch):
    """Under srun --gpus-per-task=1 each task sees one GPU: local rank 3 trains (and probes) on cuda:0."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: chosen[-1])
    assert pick_device("auto", 3) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert pick_device("auto", 3) == torch.device("cuda", 3)
