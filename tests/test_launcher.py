"""The local launcher with a stub script (never train.py), and srun / DeepSpeed command construction."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron.config import ConfigError, load_config, load_config_json
from megatron.launch.launcher import (FRONTIER_ENV, deepspeed_command, first_slurm_host, launch, run_local,
                               script_command, slurm_env, srun_command)

REPO = Path(__file__).resolve().parents[1]

# Each rank records its environment and argv, then behaves as FAIL_RANK/SLEEP_RANK say.
STUB = textwrap.dedent("""\
    import json, os, sys, time
    rank = int(os.environ["RANK"])
    out = os.environ["STUB_OUT"]
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NEOX_TOPO_SIMULATED"]
    record = {k: os.environ.get(k) for k in keys}
    record["argv"] = sys.argv[1:]
    record["pid"] = os.getpid()
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # complete or absent, even if the rank is stopped right after
    print(f"hello from rank {rank}", flush=True)
    if str(rank) == os.environ.get("SLEEP_RANK"):
        time.sleep(120)
    if str(rank) == os.environ.get("FAIL_RANK"):
        # Fail only once every peer has recorded itself, so the test sees who was stopped.
        world = int(os.environ["WORLD_SIZE"])
        deadline = time.time() + 60
        while time.time() < deadline and len([n for n in os.listdir(out) if n.endswith(".json")]) < world:
            time.sleep(0.02)
        print("stub failure", flush=True)
        sys.exit(7)
""")


@pytest.fixture()
def stub(tmp_path):
    script = tmp_path / "stub_train.py"
    script.write_text(STUB)
    out = tmp_path / "out"
    out.mkdir()
    return script, out


def write_config(tmp_path, simulate: str | None) -> str:
    text = f"train_micro_batch_size_per_gpu: 1\nlog_dir: {tmp_path / 'logs'}\n"
    if simulate:
        text += f"topology: {{simulate: {simulate}}}\n"
    path = tmp_path / "run.yml"
    path.write_text(text)
    return str(path)


def deepy(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "FAIL_RANK", "SLEEP_RANK")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(REPO / "deepy.py"), *args], env=env, capture_output=True,
                          text=True, timeout=120)


def records(out: Path) -> dict:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def test_deepy_starts_one_process_per_rank_with_the_rank_environment(tmp_path, stub):
    script, out = stub
    proc = deepy(str(script), write_config(tmp_path, "[2, 1]"), "--", "--extra", "1", env_extra={"STUB_OUT": str(out)})
    assert proc.returncode == 0, proc.stderr
    recs = records(out)
    assert sorted(recs) == [0, 1]
    for rank, rec in recs.items():
        assert (rec["RANK"], rec["WORLD_SIZE"], rec["LOCAL_RANK"], rec["LOCAL_WORLD_SIZE"]) == (str(rank), "2", str(rank), "2")
        assert rec["MASTER_ADDR"] == "127.0.0.1" and rec["NEOX_TOPO_SIMULATED"] == "1"
        assert rec["argv"][0] == "--neox-config-json" and rec["argv"][2:] == ["--extra", "1"]
    assert recs[0]["MASTER_PORT"] == recs[1]["MASTER_PORT"] and int(recs[0]["MASTER_PORT"]) > 0
    # One JSON, written once under log_dir, holding the validated config.
    config_json = Path(recs[0]["argv"][1])
    assert config_json.parent == tmp_path / "logs" and recs[1]["argv"][1] == str(config_json)
    assert load_config_json(config_json).topology.world_size == 2
    # Rank 0 unprefixed, rank 1 prefixed.
    assert "hello from rank 0" in proc.stdout.splitlines() and "[rank 1] hello from rank 1" in proc.stdout


def test_a_single_rank_run_is_one_plain_process(tmp_path, stub):
    script, out = stub
    proc = deepy(str(script), write_config(tmp_path, None), env_extra={"STUB_OUT": str(out)})
    assert proc.returncode == 0, proc.stderr
    (rec,) = records(out).values()
    assert (rec["RANK"], rec["WORLD_SIZE"], rec["NEOX_TOPO_SIMULATED"]) == ("0", "1", None)
    assert proc.stdout.strip() == "hello from rank 0"


def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path, stub):
    script, out = stub
    proc = deepy(str(script), write_config(tmp_path, "[2, 1]"),
                 env_extra={"STUB_OUT": str(out), "FAIL_RANK": "1", "SLEEP_RANK": "0"})
    assert proc.returncode == 7
    assert "deepy: rank 1 exited with code 7; stopped the other 1 rank" in proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(ProcessLookupError):  # the sleeping rank 0 was terminated and reaped
        os.kill(records(out)[0]["pid"], 0)


def test_errors_only_output_shows_just_the_failing_ranks_lines(tmp_path, stub):
    script, out = stub
    cfg = load_config([write_config(tmp_path, "[3, 1]")], env={}, notices=[])
    console, errors = io.StringIO(), io.StringIO()
    env = dict(os.environ, STUB_OUT=str(out), FAIL_RANK="2")
    code = run_local(cfg, script_command(str(script), "unused.json"), env=env, rank_output="errors",
                     console=console, errors=errors)
    assert code == 7
    shown = console.getvalue()
    assert "[rank 2] hello from rank 2" in shown and "[rank 2] stub failure" in shown
    assert "[rank 1]" not in shown
    assert "rank 2 exited with code 7" in errors.getvalue()


def load(tmp_path, text: str, env=None):
    path = tmp_path / "c.yml"
    path.write_text("train_micro_batch_size_per_gpu: 1\n" + text)
    return load_config([str(path)], env=env or {}, notices=[])


def test_srun_command_for_frontier(tmp_path):
    cfg = load(tmp_path, "topology: {preset: frontier}\nlauncher: slurm\naccount: ABC123\n", env={"SLURM_JOB_NUM_NODES": "2"})
    cmd = srun_command(cfg, ["python", "train.py", "--neox-config-json", "/run/c.json"])
    assert cmd == ["srun", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--distribution=block",
                   "--gpus-per-task=1", "--gpu-bind=closest", "-c7", "--account=ABC123",
                   "--kill-on-bad-exit=1", "python", "train.py", "--neox-config-json", "/run/c.json"]


def test_srun_command_for_dgx_and_for_cpu(tmp_path):
    dgx = srun_command(load(tmp_path, "topology: {preset: dgx}\nnum_nodes: 3\nlauncher: slurm\n"), ["x"])
    assert dgx[:7] == ["srun", "--nodes=3", "--ntasks=24", "--ntasks-per-node=8", "--distribution=block",
                       "--gpus-per-task=1", "--gpu-bind=closest"]
    assert "-c7" not in dgx
    cpu = srun_command(load(tmp_path, "topology: {simulate: [2, 4]}\nlauncher: slurm\ndevice: cpu\n"), ["x"])
    assert cpu == ["srun", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--distribution=block",
                   "--kill-on-bad-exit=1", "x"]


def test_slurm_environment_and_master_address(tmp_path):
    cfg = load(tmp_path, "topology: {preset: frontier}\nlauncher: slurm\n")
    fake = lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, stdout="frontier01234\nfrontier01235\n")
    base = {"SLURM_JOB_NODELIST": "frontier[01234-01235]", "NCCL_SOCKET_IFNAME": "hsn0,hsn1"}
    host = first_slurm_host(base, run=fake)
    assert host == "frontier01234" and first_slurm_host({}, run=fake) is None
    env = slurm_env(cfg, base, host)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("frontier01234", "29500")
    assert env["NCCL_SOCKET_IFNAME"] == "hsn0,hsn1"  # the user's setting wins
    assert all(env[k] == v for k, v in FRONTIER_ENV.items() if k != "NCCL_SOCKET_IFNAME")


def test_launch_dispatches_slurm_and_hostfile_to_exec(tmp_path):
    calls = []
    execute = lambda cmd, env: calls.append((cmd, env)) or 0
    slurm = load(tmp_path, "topology: {preset: dgx}\nlauncher: slurm\nmaster_addr: head\n")
    with pytest.raises(ConfigError, match="no Slurm allocation"):
        launch(slurm, "train.py", "/c.json", env={}, execute=execute)
    launch(slurm, "train.py", "/c.json", env={"SLURM_JOB_ID": "1"}, execute=execute)
    assert calls[-1][0][0] == "srun" and calls[-1][1]["MASTER_ADDR"] == "head"
    hostfile = load(tmp_path, "topology: {preset: dgx}\nnum_nodes: 2\nlauncher: hostfile\nhostfile: /etc/hosts.txt\n")
    launch(hostfile, "train.py", "/c.json", env={}, execute=execute)
    assert calls[-1][0][0] == "deepspeed"


def test_deepspeed_command_construction(tmp_path):
    cfg = load(tmp_path, "topology: {preset: dgx}\nnum_nodes: 2\nlauncher: hostfile\nhostfile: /job/hostfile\nmaster_port: 6000\n")
    assert deepspeed_command(cfg, "train.py", "/run/c.json", ["--x"]) == [
        "deepspeed", "--hostfile=/job/hostfile", "--num_nodes=2", "--num_gpus=8", "--master_port=6000",
        "--no_local_rank", "train.py", "--neox-config-json", "/run/c.json", "--x"]
    picked = load(tmp_path, "launcher: pdsh\nhostfile: /h\ninclude: 'worker-0@worker-1:0,2'\nmaster_addr: 10.0.0.1\n")
    assert deepspeed_command(picked, "train.py", "/c.json", deepspeed=[sys.executable, "-m", "deepspeed.launcher.runner"]) == [
        sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile=/h", "--include=worker-0@worker-1:0,2",
        "--master_addr=10.0.0.1", "--master_port=29500", "--no_local_rank", "train.py", "--neox-config-json", "/c.json"]
