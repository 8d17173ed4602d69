"""The shipped job scripts under a real Slurm: Debian's slurm-wlm 22.05, slurmctld and two slurmd on
this machine as nodes node1 and node2 (tools/slurm/local_cluster.sh, started here if it is not up and
stopped again after). Every job is submitted with `sbatch` as docs/launch.md says ("Job scripts on
CPUs"): 2 nodes x 2 tasks, the tiny model on CPU ranks (configs/slurm-cpu.yml), the DGX script with
`--gpus-per-node=0`, the Frontier scripts with NEOX_TOPO_SKIP_MODULES=1.

`make test-slurm` (slow: not in the default suite; the run time is in docs/launch.md)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, tiny_run_config
from slurm_cluster import FINAL_STATES, LocalSlurm, launches, output_of, processes_mentioning, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

DGX = REPO / "tools/slurm/dgx/train.sbatch"
FRONTIER_20B = REPO / "tools/slurm/frontier/train_20B.sbatch"
FRONTIER_10B = REPO / "tools/slurm/frontier/train_10B.sbatch"
LOSS_CURVES = REPO / "tools/slurm/frontier/loss_curves.sbatch"
SHAPE = ["-N", "2", "--ntasks-per-node=2", "-t", "20"]
SLURM_CPU = str(REPO / "configs/slurm-cpu.yml")
USER = os.environ.get("USER") or "neox"


@pytest.fixture(scope="module")
def slurm():
    cluster, started, said = start_cluster()
    if cluster is None:
        pytest.fail(f"tools/slurm/local_cluster.sh start failed:\n{said}")
    yield cluster
    if started:  # a cluster that was already up (someone's) is left as it was
        subprocess.run([str(REPO / "tools/slurm/local_cluster.sh"), "stop"], capture_output=True, timeout=120)


def run_config(folder: Path, corpus: Path, **overrides) -> Path:
    """The tiny model, its logs and checkpoints in `folder` (load = save: a requeued job resumes)."""
    keys = dict(train_iters=6, eval_interval=6, eval_iters=1, log_interval=1, train_batch_size=8,
                train_micro_batch_size_per_gpu=2, save=str(folder / "checkpoints"), load=str(folder / "checkpoints"),
                log_dir=str(folder / "logs"))
    keys.update(overrides)
    return tiny_run_config(folder, corpus, **keys)


def steps_logged(log_dir: Path) -> list[int]:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line rank 0 is writing right now
            continue
        if "train/lm_loss" in record:
            steps.append(record["iteration"])
    return steps


def check_launch(text: str, job: str, ranks_per_node: int = 2, nodes=("node1", "node2")) -> None:
    """Every rank's RANK, LOCAL_RANK, WORLD_SIZE, node and rendezvous, as the ranks themselves read them."""
    seen = sorted(launches(text))
    world = ranks_per_node * len(nodes)
    assert [r[0] for r in seen] == list(range(world)), text[-3000:]
    for rank, size, local, node, addr, port in seen:
        assert (size, local, node) == (world, rank % ranks_per_node, nodes[rank // ranks_per_node])
        assert (addr, port) == (nodes[0], 20000 + int(job) % 10000)  # launcher.job_master_port


@pytest.fixture(scope="module")
def script_runs(slurm, tiny_corpus, tmp_path_factory):
    """Each shipped job script, submitted at once (Slurm runs two at a time on the 4-CPU nodes)."""
    runs = {}
    for script, args, extra in ((DGX, ["--gpus-per-node=0"], {"WORLD_SIZE": ""}), (FRONTIER_20B, [], {}),
                                (FRONTIER_10B, [], {}), (LOSS_CURVES, [], {})):
        folder = tmp_path_factory.mktemp(script.stem)
        cfg = run_config(folder, tiny_corpus)
        env = slurm.job_env(NEOX_CONFIGS=f"{cfg} {SLURM_CPU}", **extra)
        script_args = []
        if script == LOSS_CURVES:  # the run's folders are the script's own: runs/<model>_<preset>_s<seed>
            env.update(LOSS_CURVES_DIR=str(folder / "runs"), TOKENS=str(6 * 8 * 32), GLOBAL_BATCH="8")
            script_args = ["20B", "zero3"]
        job = slurm.submit(script, SHAPE + args, script_args, folder, env)
        runs[script] = (job, folder)
    ends = {script: slurm.wait_done(job, timeout_s=900) for script, (job, _) in runs.items()}
    return {script: (job, folder, ends[script]) for script, (job, folder) in runs.items()}


@pytest.mark.parametrize("script", [DGX, FRONTIER_20B, FRONTIER_10B, LOSS_CURVES], ids=lambda p: p.name)
def test_a_shipped_script_trains_the_tiny_model_over_two_nodes(slurm, script_runs, script):
    job, folder, end = script_runs[script]
    name = {DGX: "neox-topo", FRONTIER_20B: "neox-topo-20B", FRONTIER_10B: "neox-topo-10B",
            LOSS_CURVES: "neox-topo-loss-curves"}[script]
    out = output_of(folder, name, job)  # -o %x-%j.out in the submit folder (docs/launch.md)
    assert (end.state, end.exit_code) == ("COMPLETED", "0:0"), out[-3000:]
    assert slurm.job_ends(job) == ["COMPLETED"]
    check_launch(out, job)
    run = folder / "runs" / "20B_zero3_s1234" if script == LOSS_CURVES else folder
    assert steps_logged(run / "logs") == [1, 2, 3, 4, 5, 6]
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step6"
    if script != DGX:  # env.sh's node-local caches are gone from every node when the job ends
        assert not any(Path(f"/tmp/{kind}-{USER}-{job}").exists() for kind in ("miopen", "triton"))
    if script == LOSS_CURVES:  # the banner's tokens per step come from the run's own seq_length (32)
        assert "loss curves: 20B zero3 seed 1234: 6 steps x 8 x 32 tokens" in out


def _requeue_chain(slurm: LocalSlurm, folder: Path, corpus: Path, signals: int, results: dict) -> None:
    try:
        _signal_and_follow(slurm, folder, corpus, signals, results)
    except BaseException as err:  # noqa: BLE001 - a thread's failure is reported by the test
        results["error"] = repr(err)


def _signal_and_follow(slurm: LocalSlurm, folder: Path, corpus: Path, signals: int, results: dict) -> None:
    """One job of the Frontier 20B script, sent USR1 (`scancel --signal=USR1`, what --signal=USR1@300
    sends at the time limit) `signals` times, each once its current start has trained a step."""
    cfg = run_config(folder, corpus, train_iters=80, eval_interval=80, checkpoint_factor=1000)
    job = slurm.submit(FRONTIER_20B, SHAPE, [], folder, slurm.job_env(NEOX_CONFIGS=f"{cfg} {SLURM_CPU}"))
    results["job"] = job
    last = 0
    for k in range(signals):
        def trained_a_step(st, k=k, since=last):
            assert st.state not in FINAL_STATES, f"start {k} of job {job} ended before its signal: {st}"
            return st.state == "RUNNING" and st.restarts == k and max(steps_logged(folder / "logs"), default=0) > since
        slurm.wait(job, trained_a_step, timeout_s=300, poll_s=0.2)
        slurm.command("scancel", "--signal=USR1", job)
        st = slurm.wait(job, lambda st: st.restarts > k or st.state in FINAL_STATES, timeout_s=300)
        assert st.restarts == k + 1, f"signal {k + 1} of job {job} did not requeue it: {st}"
        last = max(steps_logged(folder / "logs"))
        results.setdefault("stops", []).append(last)
    results["end"] = slurm.wait_done(job, timeout_s=600)


@pytest.mark.timeout(1800)
def test_the_time_limit_signal_saves_exits_75_requeues_and_resumes_every_time(slurm, tiny_corpus, tmp_path):
    """Two requeue chains at once, five signals each: 10 of 10 signals end in 75 on every rank and a
    requeue, every start resumes from `latest`, and both jobs finish COMPLETED with rc 0."""
    signals = 5
    chains = [({}, tmp_path / f"chain{i}") for i in range(2)]
    threads = []
    for results, folder in chains:
        folder.mkdir()
        threads.append(threading.Thread(target=_requeue_chain, args=(slurm, folder, tiny_corpus, signals, results)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for results, folder in chains:
        job = results.get("job")
        out = output_of(folder, "neox-topo-20B", job) if job else ""
        assert "error" not in results and len(results.get("stops", [])) == signals, f"chain {folder.name}: {results}\n{out[-3000:]}"
        assert (results["end"].state, results["end"].exit_code) == ("COMPLETED", "0:0"), out[-3000:]
        # No start of the job ended FAILED: five requeues (Slurm logs them PENDING), then COMPLETED.
        assert slurm.job_ends(job) == ["PENDING"] * signals + ["COMPLETED"]
        # Every rank of every stopped start exited with 75, and nothing else (no 143, no Terminated).
        exits = re.findall(r"^srun: error: node\d: tasks? ([\d,-]+): (.+)$", out, re.M)
        assert all(what == "Exited with exit code 75" for _, what in exits), exits
        assert sum(_task_count(tasks) for tasks, _ in exits) == 4 * signals, exits
        assert out.count("deepy exited with 75 (stopped and saved): requeueing job") == signals
        # Each start resumed from the step the previous one saved; every step trained exactly once.
        for stop in results["stops"]:
            assert f"checkpoints/global_step{stop} at step {stop}" in out, out[-3000:]
        assert steps_logged(folder / "logs") == list(range(1, 81))
        assert (folder / "checkpoints" / "latest").read_text().strip() == "global_step80"


def _task_count(spec: str) -> int:
    """'0-1' -> 2, '3' -> 1, '0,2-3' -> 3: how srun names the tasks of one line."""
    count = 0
    for part in spec.split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def test_scancel_saves_and_leaves_no_rank(slurm, tiny_corpus, tmp_path):
    cfg = run_config(tmp_path, tiny_corpus, train_iters=100000, eval_interval=100000, checkpoint_factor=100000)
    job = slurm.submit(FRONTIER_10B, SHAPE, [], tmp_path, slurm.job_env(NEOX_CONFIGS=f"{cfg} {SLURM_CPU}"))
    slurm.wait(job, lambda st: st.state == "RUNNING" and len(steps_logged(tmp_path / "logs")) >= 2, timeout_s=300)
    slurm.command("scancel", job)
    end = slurm.wait_done(job, timeout_s=120)
    assert end.state == "CANCELLED"
    out = output_of(tmp_path, "neox-topo-10B", job)
    assert re.search(rf"\*\*\* (JOB|STEP) {job}(\.\d+)? ON node1 CANCELLED AT ", out), out[-2000:]
    stop = re.search(r"^stop signal received at step (\d+): saving and exiting$", out, re.M)
    assert stop, out[-2000:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"global_step{stop.group(1)}"
    deadline = time.monotonic() + 30
    while processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(tmp_path)) == []
    for kind in ("miopen", "triton"):  # a cancelled job cannot clean its node caches (docs/launch.md)
        shutil.rmtree(f"/tmp/{kind}-{USER}-{job}", ignore_errors=True)


def test_two_jobs_share_a_node_each_on_its_own_port(slurm, tiny_corpus, tmp_path):
    jobs = []
    for i in range(2):
        folder = tmp_path / f"job{i}"
        folder.mkdir()
        cfg = run_config(folder, tiny_corpus, train_iters=15, eval_interval=15)
        env = slurm.job_env(NEOX_CONFIGS=f"{cfg} {SLURM_CPU}")
        jobs.append((slurm.submit(DGX, ["-N", "1", "-w", "node1", "--ntasks-per-node=2", "--gpus-per-node=0", "-t", "20"],
                                  [], folder, env), folder))
    # Both run on node1 at the same time (2 + 2 of its 4 CPUs).
    slurm.wait(jobs[0][0], lambda st: st.state == "RUNNING" and slurm.state(jobs[1][0]).state == "RUNNING",
               timeout_s=300, poll_s=0.2)
    for job, folder in jobs:
        end = slurm.wait_done(job, timeout_s=600)
        out = output_of(folder, "neox-topo", job)
        assert (end.state, end.exit_code, end.nodes) == ("COMPLETED", "0:0", "node1"), out[-3000:]
        check_launch(out, job, nodes=("node1",))
        assert steps_logged(folder / "logs") == list(range(1, 16))


def test_a_config_that_does_not_match_the_allocation_is_refused_in_one_line(slurm, tiny_corpus, tmp_path):
    cfg = run_config(tmp_path, tiny_corpus, train_batch_size=16)  # a valid batch on 4 nodes x 2 ranks
    job = slurm.submit(DGX, SHAPE + ["--gpus-per-node=0"], ["--set", "num_nodes=4"], tmp_path,
                       slurm.job_env(NEOX_CONFIGS=f"{cfg} {SLURM_CPU}"))
    end = slurm.wait_done(job, timeout_s=300)
    out = output_of(tmp_path, "neox-topo", job)
    assert (end.state, end.exit_code) == ("FAILED", "2:0")
    lines = out.strip().splitlines()
    # sbatch's SLURM_NTASKS (2 nodes x 2) is what the 4 x 2 layout meets first.
    assert len(lines) == 1, out
    assert lines[0].startswith("deepy: error: the configured layout has 8 ranks (topology.layout [4, 2]) but "
                               "SLURM_NTASKS=4"), out


def test_probe_links_runs_under_plain_srun(slurm, tmp_path):
    """As a Slurm user starts it: srun sets no RANK/WORLD_SIZE/MASTER_*; the probe reads Slurm's."""
    out_json = tmp_path / "probe.json"
    probe = (f"srun -N 2 --ntasks-per-node=2 {sys.executable} {REPO}/tools/probe_links.py --layout 2 2 "
             f"--out {out_json} --sizes-kb 16 128 --repeats 1 --model 1 32 2 16 64 1 --optimizer-elements 20000")
    job = slurm.submit("--wrap", ["-N", "2", "--ntasks-per-node=2", "-t", "10", "-J", "probe",
                                        "-o", "%x-%j.out"], [probe], tmp_path, slurm.job_env())
    end = slurm.wait_done(job, timeout_s=600)
    out = output_of(tmp_path, "probe", job)
    assert (end.state, end.exit_code) == ("COMPLETED", "0:0"), out[-3000:]
    data = json.loads(out_json.read_text())
    assert data["layout"] == [2, 2] and data["backend"] == "gloo" and data["samples"]


def test_a_failing_rank_under_kill_on_bad_exit_shows_as_143(slurm, tmp_path):
    """docs/launch.md's exit codes: srun --kill-on-bad-exit=1 SIGTERMs the other tasks when one fails,
    and returns the highest code, 143, not the failing rank's 1; the first `srun: error` line names it."""
    code = "import os, sys, time; sys.exit(1) if os.environ['SLURM_PROCID'] == '1' else time.sleep(60)"
    proc = slurm.command("srun", "-N", "2", "--ntasks-per-node=2", "--kill-on-bad-exit=1", sys.executable, "-c", code,
                         check=False, timeout=120, cwd=tmp_path)
    assert proc.returncode == 143, proc.stderr
    first = re.search(r"^srun: error: node\d: tasks? [\d,-]+: (.+)$", proc.stderr, re.M)
    assert first and first.group(1) == "Exited with exit code 1", proc.stderr
