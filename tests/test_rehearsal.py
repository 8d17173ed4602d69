"""The rehearsal (tools/rehearse.py, megatron/rehearsal/): one rank of a 64-rank world (8 Frontier nodes)
on the fake backend, checked against the comm model; the fake backend's outputs as documented; the
engine's build, steps, save and load on the meta device for every preset, quantized or not, overlap
on and off, so a tensor made on the host and mixed into device work fails here as on a GPU.

Every rehearsal runs in a process of its own (it initialises a process group and, on meta, replaces
meta kernels process-wide)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["configs/tiny-cpu.yml", "configs/frontier.yml"]
TINY_SETS = ["train_batch_size=null", "vocab_size=500", "build_demo_corpus=false", "eval_iters=0",
             "checkpoint_factor=null", "load=null", "tensorboard_dir=null", "seq_length=32",
             "train_micro_batch_size_per_gpu=2"]


def _python(code: str, timeout: float = 240) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _child(tmp_path: Path, name: str, kind: str, preset: str, sets: list[str], rank: int = 3) -> dict:
    """tools/rehearse.py's own child process for one run."""
    folder = tmp_path / name
    folder.mkdir()
    spec = {"name": name, "kind": kind, "device": {"meta": "meta"}.get(kind, "cpu"),
            "files": TINY + [f"configs/{preset}.yml"], "sets": TINY_SETS + sets, "env": {"SLURM_JOB_NUM_NODES": "8"},
            "rank": rank, "steps": 2, "layers_override": None, "work_dir": str(folder), "out": str(folder / "out.json")}
    (folder / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "tools/rehearse.py", "--child", str(folder / "spec.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((folder / "out.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rehearsal")
    quantized = ["zero_optimization.zero_quantized_weights=true", "zero_optimization.zero_quantized_gradients=true"]
    return {"zero_topo meta": _child(tmp, "a", "meta", "zero_topo", []),
            "zeropp int8/int4 meta": _child(tmp, "b", "meta", "zeropp", quantized),
            "zero_topo cpu": _child(tmp, "c", "memory", "zero_topo", quantized, rank=0)}


@pytest.mark.parametrize("name", ["zero_topo meta", "zeropp int8/int4 meta", "zero_topo cpu"])
def test_counts_equal_the_comm_model(runs, name):
    run = runs[name]
    assert run["world_size"] == 64 and run["units"] == 4
    assert run["collectives_per_step"] == run["predicted"]["collectives_per_step"]
    assert run["ledger_per_step"] == run["predicted"]["ledger_per_step"]
    assert sum(run["collectives_per_step"].values()) > 10


def test_the_host_waits_once_in_the_optimizer_step_and_once_in_the_trainer(runs):
    """On meta every wait shows: none in forward-backward; the norm in the optimizer step; the step
    vector read back in the trainer, its batch and its values copied without waiting (pinned on a GPU)."""
    for name in ("zero_topo meta", "zeropp int8/int4 meta"):
        syncs = runs[name]["host_syncs"]
        assert sum(syncs["micro step"].values()) == 0, syncs
        assert syncs["optimizer step"]["reads"] == 1 and sum(syncs["optimizer step"].values()) == 1, syncs
        trainer = syncs["trainer"]
        assert trainer["device_to_host"] == 1 and trainer["reads"] == 0 and trainer["blocking_host_to_device"] == 0
        assert trainer["pageable_host_to_device"] == 3  # tokens, labels, the step vector's floats


def test_the_rank_writes_its_file_and_the_commit(runs):
    ckpt = runs["zero_topo meta"]["checkpoint"]
    assert set(ckpt["files"]) == {"rank_00003.pt", "index.json", "meta.json"}
    assert ckpt["bytes"] > 0 and ckpt["load_s"] >= 0


def test_memory_is_measured_and_predicted_per_phase(runs):
    """A CPU run: the allocator's peak of each phase against the memory model (a tiny model: the
    allocator's fixed costs weigh, so only the order of magnitude is checked here; docs/rehearsal.md
    has the 20B-wide figures)."""
    run = runs["zero_topo cpu"]
    for phase in ("build", "step", "save", "load"):
        got, want = run["memory"][phase], run["predicted"]["memory"][phase]
        assert 0.5 < got / want < 1.5, (phase, got, want)


def test_the_fake_backend_leaves_what_the_docs_say():
    out = _python("""
import torch, torch.distributed as dist
from megatron.rehearsal.fake_world import join_fake_world
join_fake_world(5, 8)
g = dist.new_group([4, 5, 6])
x = torch.arange(6.0)
ag = torch.full((18,), -1.0); dist.all_gather_into_tensor(ag, x, group=g)
rs = torch.full((2,), -1.0); dist.reduce_scatter_tensor(rs, x, group=g)
ar = x.clone(); dist.all_reduce(ar)
a2a = torch.full((6,), -1.0); dist.all_to_all_single(a2a, x, group=g)
print(ag.tolist() == x.tolist() * 3, rs.tolist() == [2.0, 3.0], ar.tolist() == x.tolist(), a2a.tolist() == x.tolist())
""")
    assert out.split() == ["True"] * 4


PLACEMENT = """
import dataclasses, json, sys, torch
from pathlib import Path
from megatron.config import load_config
from megatron.rehearsal.run import Settings, rehearse
cases = json.loads(sys.argv[1])
work = Path(sys.argv[2])
out = {}
for name, preset, sets, rank in cases:
    cfg = load_config(["configs/tiny-cpu.yml", "configs/frontier.yml", f"configs/{preset}.yml"],
                      TINY_SETS + sets + [f"save={work / name}", f"log_dir={work / name}"],
                      env={"SLURM_JOB_NUM_NODES": "2"}, notices=[])
    r = rehearse(cfg, Settings(rank=rank, device="meta", steps=1, work_dir=work / name, allocator=False))
    assert "load_s" in r["checkpoint"], r["checkpoint"]
    out[name] = [r["collectives_per_step"] == r["predicted"]["collectives_per_step"],
                 r["ledger_per_step"] == r["predicted"]["ledger_per_step"], r["host_syncs"]["micro step"]]
print(json.dumps(out))
"""
QUANT = ["zero_optimization.zero_quantized_weights=true", "zero_optimization.zero_quantized_gradients=true"]
# (name, preset, overrides, rank): a rank of the first replica (ddp has one rank there), whose load
# reads its own file (the others read the first replica's, absent in a rehearsal of one rank)
PLACEMENT_CASES = [("ddp", "ddp", [], 0), ("zero1", "zero1", [], 9), ("zero2", "zero2", ["gradient_clipping=0.0"], 9),
                   ("zero3", "zero3", [], 9), ("hsdp", "hsdp", ["zero_optimization.overlap_comm=false"], 5),
                   ("zeropp", "zeropp", [], 9), ("zeropp_q", "zeropp", QUANT, 9), ("zero_topo", "zero_topo", [], 9),
                   ("zero_topo_q", "zero_topo", QUANT + ["zero_optimization.quantization_error_feedback=true"], 9),
                   ("zero_topo_no_overlap", "zero_topo", ["zero_optimization.overlap_comm=false",
                                                          "checkpoint_activations=true"], 9),
                   ("zero_topo_bf16", "zero_topo", ["bf16.enabled=true"], 9)]


def test_every_preset_runs_on_a_device_that_is_not_the_host(tmp_path):
    """Build, steps (clipping, the loss all-reduce), save and load of one rank of 16 on meta: any tensor
    made on the host and mixed into device work raises there, as on a GPU; the counts still equal the
    comm model and the forward-backward never waits for the device."""
    code = f"TINY_SETS = {TINY_SETS!r}\n" + PLACEMENT
    out = json.loads(_python(code.replace("sys.argv[1]", repr(json.dumps(PLACEMENT_CASES)))
                             .replace("sys.argv[2]", repr(str(tmp_path)))).splitlines()[-1])
    assert set(out) == {case[0] for case in PLACEMENT_CASES}
    for name, (collectives, ledger, micro_syncs) in out.items():
        assert collectives and ledger, name
        assert sum(micro_syncs.values()) == 0, (name, micro_syncs)


def test_a_host_tensor_in_device_work_fails_on_meta():
    """The check above can fail: a gradient accumulator left on the host makes the first step raise
    (its reduction's first collective meets a host tensor)."""
    out = _python(f"TINY_SETS = {TINY_SETS!r}\n" + """
import torch
from megatron.config import load_config
import megatron.engine.flat_unit as flat_unit
from megatron.rehearsal.run import Settings, rehearse
original = flat_unit.FlatUnit.__init__
def host_accumulator(self, *args, **kwargs):
    original(self, *args, **kwargs)
    self.grad_accum = torch.zeros(self.grad_accum.shape)  # on the host: the bug
flat_unit.FlatUnit.__init__ = host_accumulator
cfg = load_config(["configs/tiny-cpu.yml", "configs/frontier.yml", "configs/zero_topo.yml"],
                  TINY_SETS + ["save=/tmp/never", "log_dir=/tmp/never"], env={"SLURM_JOB_NUM_NODES": "2"}, notices=[])
try:
    rehearse(cfg, Settings(rank=1, device="meta", steps=1, work_dir="/tmp/never", allocator=False))
except Exception as err:  # the strict communicator's NcclRuleError, or torch's device check in an op
    print("raised:", type(err).__name__, str(err).splitlines()[0])
""")
    assert "raised:" in out and "a tensor on cpu" in out and "meta" in out, out


def test_writing_one_kind_of_run_keeps_the_other_kinds_tables(tmp_path):
    """`--runs host --write` rewrites the host table only: the meta and memory tables of the page
    (runs of ~half an hour) stay as they were."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("rehearse_tool", REPO / "tools" / "rehearse.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    page = tmp_path / "page.md"
    page.write_text("intro\n" + tool.BEGIN + "\n" + tool.joined({"meta": "META 1", "host": "HOST 1", "memory": "MEM 1"})
                    + tool.END + "\nafter\n")
    tool.write_section(page, {"host": "HOST 2\n\n| a |"})
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("\nafter\n")
    assert "META 1" in text and "MEM 1" in text and "HOST 2\n\n| a |" in text and "HOST 1" not in text
    assert text.index("META 1") < text.index("HOST 2") < text.index("MEM 1")


def test_the_cpu_share_and_the_steal_tell_a_slow_sitting_from_slow_code(runs):
    """The host table's last column: the micro-step's CPU time (this thread's) never exceeds its wall
    time, and the steal share is /proc/stat's eighth state over the first eight, by hand."""
    from megatron.rehearsal.run import cpu_ticks, steal_share
    host = runs["zero_topo cpu"]["host_s"]
    assert 0 < host["micro step cpu"] <= host["micro step"] * 1.01
    before = [100, 0, 50, 800, 5, 0, 1, 4, 0, 0]
    after = [160, 0, 70, 880, 5, 0, 1, 24, 30, 0]  # guest time (ninth) is inside user time: not added again
    assert steal_share(before, after) == pytest.approx(20 / 180)
    assert steal_share(None, after) is None and steal_share(before, before) == 0.0
    if sys.platform.startswith("linux"):
        assert len(cpu_ticks()) >= 8
