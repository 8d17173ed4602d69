#!/usr/bin/env python
"""Rehearse one rank of the Frontier job on this machine: rank R of the whole world (20B on 48 nodes =
384 ranks by default) on torch's fake process-group backend, with the real engine (docs/rehearsal.md).

    .venv/bin/python tools/rehearse.py                                # 20B, 48 nodes, rank 0, five presets
    .venv/bin/python tools/rehearse.py --presets zero_topo --rank 7 --json out.json
    .venv/bin/python tools/rehearse.py configs/tiny-cpu.yml --nodes 8 --memory-layers 1 2 --memory-seq 32
    .venv/bin/python tools/rehearse.py --write docs/rehearsal.md      # regenerate the doc's tables
    .venv/bin/python tools/rehearse.py --device-runs cuda             # on a GPU: its memory at full size

Per preset, in processes of their own:
- on ``meta`` at the full shape: start-up (process group, groups, data index, build per unit, first
  step), host time per micro-step (the engine's own: forward-backward with the engine less the same
  model's without it), per optimizer step and the trainer's rest, collectives and ledger bytes per
  step against the comm model, host syncs by kind, the checkpoint's files and bytes;
- on ``cpu`` at ``--memory-layers`` (a 20B rank does not fit this machine: zero_topo holds ~31 GB)
  and a short ``--memory-seq`` (the compute of a 6144-wide block is slow here), each phase's peak of
  the allocator against the memory model, the slope per layer and the extrapolation to the full
  layer count, said as an extrapolation; ``--device-runs cuda`` measures the full shape on a GPU.
Prints one table per kind and writes JSON (``--json``) and the doc's marked section (``--write``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_CONFIGS = ["configs/20B.yml", "configs/frontier.yml", "configs/local_setup.yml"]
Z = "zero_optimization."
PRESETS = {"zero3": ("configs/zero3.yml", []), "zeropp": ("configs/zeropp.yml", []), "hsdp": ("configs/hsdp.yml", []),
           "zero_topo": ("configs/zero_topo.yml", []),
           "zero_topo INT8/INT4": ("configs/zero_topo.yml", [Z + "zero_quantized_weights=true",
                                                            Z + "zero_quantized_gradients=true"])}
BEGIN, END = "<!-- rehearsal:begin -->", "<!-- rehearsal:end -->"
# The host run: the full depth, world and layout, every width small, so the CPU's compute is a few
# milliseconds and what a micro-step costs the host (the engine's Python, autograd's) stands out.
HOST_SHAPE = ["hidden_size=64", "num_attention_heads=4", "seq_length=16", "max_position_embeddings=16",
              "train_micro_batch_size_per_gpu=1", "vocab_size=500"]
RUNS = ("meta", "host", "memory")
PHASES = ("build", "step", "save", "load")
DEVICE_OF = {"meta": "meta", "host": "cpu", "memory": "cpu", "cuda": "cuda:0"}
GB, MS = 1e9, 1e3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS, help="config files (default: 20B on Frontier)")
    p.add_argument("--nodes", type=int, default=48, help="Slurm nodes the topology preset spans")
    p.add_argument("--rank", type=int, default=0, help="the rank this process plays")
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--set", dest="sets", action="append", default=[], help="config override, KEY=VALUE")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps after the first (meta)")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS) + ["cuda"],
                   help="meta: the full shape on the meta device (start-up, counts, syncs, files); host: the engine's "
                        "host time on the CPU at the full depth and world, narrow; memory: the CPU's peaks at "
                        "--memory-layers; cuda: the full shape on a GPU (memory, host time)")
    p.add_argument("--memory-layers", type=int, nargs="+", default=[2, 4],
                   help="layer counts of the memory runs (>= 2; one block is not a steady state: its step holds "
                        "fewer units in flight than a deeper model does)")
    p.add_argument("--memory-seq", type=int, default=8, help="seq_length of the memory runs")
    p.add_argument("--memory-micro", type=int, default=1, help="micro-batch of the memory runs")
    p.add_argument("--work-dir", default=None, help="where data, checkpoints and logs go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write every run's measurements and predictions here")
    p.add_argument("--write", default=None, help="replace the marked section of this markdown file with the tables")
    p.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                   help="render the report from saved --json files (a later file's runs replace an earlier's), "
                        "predicting again with the models as they are now")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- one process -----------------------------------------------------------------------------------

def child(spec_path: str) -> int:
    """Run one configuration (a JSON spec written by the parent) and write its result beside it."""
    from megatron.config import load_config
    from megatron.rehearsal.run import Settings, rehearse
    spec = json.loads(Path(spec_path).read_text())
    if spec["kind"] == "host":  # one thread: a GPU rank's host runs Python and launches, not kernels
        import torch
        torch.set_num_threads(1)
    if spec["kind"] != "host":  # checked against NCCL's rules (the host run times what a job runs: no checks)
        from megatron.engine.nccl_rules import STRICT_ENV
        os.environ[STRICT_ENV] = "1"
    work = Path(spec["work_dir"])
    sets = spec["sets"] + [f"save={work / 'checkpoints'}", f"log_dir={work / 'logs'}"]
    cfg = load_config([REPO / f for f in spec["files"]], sets, env=spec["env"], notices=[])
    result = rehearse(cfg, Settings(rank=spec["rank"], device=spec["device"], steps=spec["steps"],
                                    work_dir=Path(spec["work_dir"]), allocator=spec["kind"] == "memory"))
    result["config"] = {"files": spec["files"], "sets": sets, "env": spec["env"]}  # to predict again later
    Path(spec["out"]).write_text(json.dumps(result, indent=1))
    return 0


def predict_again(run: dict) -> dict:
    """The run's predictions from the models as they are now (its config is in the JSON): saved runs
    stay comparable after a model changes, without measuring again."""
    from megatron.config import load_config, world_size_of
    from megatron.engine.setup import layout_from_config
    from megatron.rehearsal.predict import predictions
    spec = run["config"]
    cfg = load_config([REPO / f for f in spec["files"]], spec["sets"], env=spec["env"], notices=[])
    _cfg, layout, _plan = layout_from_config(cfg, world_size_of(cfg))
    return {**run, "predicted": predictions(cfg, run["vocab"], layout, run["rank"], run["device"])}


def run_child(spec: dict, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "work_dir": str(folder), "out": str(folder / "result.json")}
    path = folder / "spec.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(path)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
                              "OMP_NUM_THREADS", str(os.cpu_count() or 1))})
    if done.returncode != 0:
        raise SystemExit(f"rehearsal of {spec['name']} ({spec['kind']} run) failed:\n{done.stderr[-4000:]}")
    return json.loads(Path(spec["out"]).read_text())


def runs_of(args) -> list[dict]:
    """Every process to start: (preset, kind of run, layers)."""
    env = {"SLURM_JOB_NUM_NODES": str(args.nodes)}
    common = ["eval_iters=0", "checkpoint_factor=null", "keep_last_n_checkpoints=null", "load=null",
              "use_wandb=false", "tensorboard_dir=null", "log_interval=1"]
    runs = []
    for name in args.presets:
        preset_file, extra = PRESETS[name]
        for kind in args.runs:
            for layers in (args.memory_layers if kind == "memory" else [None]):
                sets = common + extra + list(args.sets)
                if kind == "host":
                    sets += HOST_SHAPE
                if kind == "memory":
                    sets += [f"num_layers={layers}", f"seq_length={args.memory_seq}",
                             f"max_position_embeddings={args.memory_seq}",
                             f"train_micro_batch_size_per_gpu={args.memory_micro}"]
                runs.append({"name": name, "kind": kind, "device": DEVICE_OF[kind], "files": list(args.configs) + [preset_file],
                             "sets": sets, "env": env, "rank": args.rank,
                             "steps": 1 if kind == "memory" else args.steps if kind == "meta" else max(args.steps, 10), "layers_override": layers})
    return runs


# -- the report ------------------------------------------------------------------------------------

def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _agree(measured: dict, predicted: dict) -> str:
    if measured == predicted:
        return "=="
    keys = sorted(set(measured) | set(predicted))
    diff = [f"{k}: {measured.get(k, 0)} vs {predicted.get(k, 0)}" for k in keys if measured.get(k) != predicted.get(k)]
    return "DIFFERS (" + "; ".join(diff[:3]) + ")"


def report(results: list[dict], args) -> dict[str, str]:
    """The tables by kind of run (meta, host, memory), for the kinds the results hold."""
    out = {}
    meta = [r for r in results if r["kind"] == "meta"]
    if meta:
        out["meta"] = meta_report(meta)
    host = [r for r in results if r["kind"] in ("host", "cuda")]
    if host:
        out["host"] = host_report(host)
    memory = [r for r in results if r["kind"] in ("memory", "cuda") and r.get("memory")]
    if memory:
        out["memory"] = memory_report(memory, {r["label"]: r["layers"] for r in meta})
    return out


def block_marker(kind: str) -> str:
    return f"<!-- rehearsal:{kind} -->"


def joined(blocks: dict[str, str]) -> str:
    """The section's text: each kind's tables after its marker, in the order of RUNS."""
    return "\n\n".join(f"{block_marker(k)}\n{blocks[k]}" for k in RUNS if k in blocks) + "\n"


def _shape(r: dict) -> str:
    return (f"rank {r['rank']} of {r['world_size']}, {r['layers']} layers ({r['units']} units), micro-batch "
            f"{r['micro_batch']} x {r['seq_length']} tokens, {r['precision']}")


def meta_report(runs: list[dict]) -> str:
    rows, checks = [], []
    for r in runs:
        st = r["startup_s"]
        block = sorted(r["unit_build_s"][1:-1] or r["unit_build_s"])
        ckpt = r["checkpoint"]
        rows.append([r["label"], f"{st['process group']:.2f}", f"{st['groups']:.2f}", f"{st['data index']:.2f}",
                     f"{st['model build']:.0f}", f"{block[len(block) // 2]:.2f}", f"{st['first step']:.1f}",
                     f"{ckpt['save_s']:.1f}" if "save_s" in ckpt else "-", f"{ckpt['load_s']:.1f}" if "load_s" in ckpt else "-"])
        syncs, coll = r["host_syncs"], r["collectives_per_step"]
        checks.append([r["label"], sum(coll.values()), _agree(coll, r["predicted"]["collectives_per_step"]),
                       f"{sum(r['ledger_per_step'].values()) / GB:.2f}",
                       _agree(r["ledger_per_step"], r["predicted"]["ledger_per_step"]),
                       _syncs(syncs["micro step"]), _syncs(syncs["optimizer step"]), _syncs(syncs["trainer"]),
                       len(ckpt["files"]) if "files" in ckpt else "-",
                       f"{ckpt['bytes'] / GB:.3f}" if "bytes" in ckpt else f"({ckpt['piece_bytes'] / GB:.1f}: not saved)"])
    skipped = [f"{r['label']}: {r['checkpoint']['skipped']}" for r in runs if "skipped" in r["checkpoint"]]
    note = ("; not saved here (" + "; ".join(skipped) + ")") if skipped else ""
    return (f"On the meta device at the full shape ({_shape(runs[0])}): start-up, seconds (the build draws every "
            f"unit's init on the CPU, as every rank does; the data index is a synthetic corpus's{note})\n\n"
            + table(["preset", "process group", "groups", "data index", "model build", "build per block",
                     "first step", "save", "load"], rows)
            + "\n\nPer optimizer step: collectives issued and ledger bytes sent by this rank against the comm "
              "model; what makes the host wait (HostSyncs); the checkpoint this rank wrote (its file and the "
              "commit's, done for the absent rank 0)\n\n"
            + table(["preset", "collectives", "vs comm model", "ledger GB", "vs comm model", "syncs / micro-step",
                     "syncs / optimizer step", "syncs / trainer", "checkpoint files", "checkpoint GB"], checks))


def host_report(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        host = r["host_s"]
        coll = sum(r["collectives_per_step"].values())
        rows.append([r["label"], f"{host['micro step'] * MS:.1f}", f"{host['engine in micro step'] * MS:.1f}",
                     f"{host['backend in micro step'] * MS:.1f}", f"{host['kernels in micro step'] * MS:.1f}",
                     f"{(host['optimizer step'] - host['backend in optimizer step'] - host['kernels in optimizer step']) * MS:.1f}",
                     f"{(host['train step'] - r['accumulation'] * host['micro step'] - host['optimizer step']) * MS:.1f}",
                     coll, _cpu_share(r)])
    return (f"Host time on the CPU at the full depth and world, every width small ({_shape(runs[0])}): medians in ms. "
            "The engine's share is the time inside its hooks and pass bookkeeping less the backend's calls (fake: a "
            "copy per group member NCCL does not make) and the quantization kernels (computed here, launched on a "
            "GPU), both shown apart. The last column tells a slow sitting of this VM from slow code: the main thread's CPU "
            "time over the wall time of a micro-step, and the share of the machine's time the hypervisor gave other "
            "guests (steal) while the steps ran\n\n"
            + table(["preset", "micro-step", "engine per micro-step", "backend per micro-step",
                     "quantization kernels per micro-step", "optimizer step (engine)", "trainer's rest",
                     "collectives / step", "CPU / wall, steal"], rows))


def _cpu_share(run: dict) -> str:
    """`0.97, 2% steal` (runs before these were measured: -)."""
    host = run["host_s"]
    if "micro step cpu" not in host:
        return "-"
    steal = run.get("steal_share")
    return f"{host['micro step cpu'] / host['micro step']:.2f}" + (f", {steal:.0%} steal" if steal is not None else "")


def _syncs(by_kind: dict) -> str:
    parts = [f"{n} {kind.replace('_', ' ')}" for kind, n in by_kind.items() if n and kind != "async_host_to_device"]
    return ", ".join(parts) or "0"


def memory_report(runs: list[dict], full: dict) -> str:
    from megatron.rehearsal.predict import extrapolate
    rows = []
    layers = sorted({r["layers"] for r in runs})
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = sorted((r for r in runs if r["label"] == label), key=lambda r: r["layers"])
        got_by = {phase: {r["layers"]: r["memory"].get(phase) for r in mine} for phase in PHASES}
        want_by = {phase: {r["layers"]: r["predicted"]["memory"][phase] for r in mine} for phase in PHASES}
        for phase in PHASES:
            got, want = got_by[phase], want_by[phase]
            if any(v is None for v in got.values()):
                continue
            cells = [f"{got[n] / GB:.2f} / {want[n] / GB:.2f} = {got[n] / want[n]:.2f}" if n in got else "-"
                     for n in layers]
            if len(got) >= 2 and label in full:
                # states grow with every layer; the step's transients (units gathered and in flight) stop
                # growing after a few blocks: the step carries on along its states' slope
                if phase == "step":
                    states = {r["layers"]: r["predicted"]["memory"]["step states"] for r in mine}
                    slope, _ = extrapolate(states, full[label])
                else:
                    slope, _ = extrapolate(got, full[label])
                want_slope, want_full = extrapolate(want, full[label])
                deepest = max(got)
                at_full = got[deepest] + slope * (full[label] - deepest)
                cells += [f"{slope / GB:.3f} / {want_slope / GB:.3f}", f"{at_full / GB:.1f} / {want_full / GB:.1f}"]
            else:
                cells += ["-", "-"]
            rows.append([label, phase] + cells)
    first = runs[0]
    measure = "the GPU's allocation" if first["device"] == "cuda" else "the CPU allocator's peak"
    return (f"Memory per phase on {first['device']} ({measure}; {_shape(first)} at {', '.join(map(str, layers))} "
            "layers): measured / predicted by the memory model. The slope per layer and the value at the full "
            "layer count are an extrapolation from the deepest runs, not a measurement: each phase along its own "
            "measured slope, the step along its states' (which the engine holds exactly as the memory model counts "
            "them: tests/test_ledger_equals_model.py); its transients, the units gathered and the reductions in "
            "flight, stop growing after a few blocks\n\n"
            + table(["preset", "phase"] + [f"{n} layers, GB" for n in layers] +
                    ["GB per layer, measured / model", "full model GB, extrapolated / model"], rows))


def merged(paths: list[str]) -> list[dict]:
    """The runs of several --json files, one per (preset, kind, layers): a later file's run replaces."""
    runs: dict = {}
    for path in paths:
        for run in json.loads(Path(path).read_text()):
            runs[(run["label"], run["kind"], run["layers"])] = run
    return list(runs.values())


def write_section(path: Path, blocks: dict[str, str]) -> None:
    """Replace the tables of the kinds run in the page's marked section; the other kinds' tables stay
    (a host run alone rewrites the host table only)."""
    page = path.read_text()
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section")
    head, rest = page.split(BEGIN, 1)
    old, tail = rest.split(END, 1)
    parts = re.split(r"<!-- rehearsal:(" + "|".join(RUNS) + r") -->\n", old)  # [before, kind, text, kind, text ...]
    kept = {parts[i]: parts[i + 1].strip("\n") for i in range(1, len(parts), 2)}
    path.write_text(head + BEGIN + "\n" + joined({**kept, **blocks}) + END + tail)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args.child)
    if args.from_json:
        results = [predict_again(r) if "config" in r else r for r in merged(args.from_json)]
        blocks = report(results, args)
        print(joined(blocks))
        if args.write:
            write_section(Path(args.write), blocks)
        return 0
    if "memory" in args.runs and len(args.memory_layers) < 2:
        raise SystemExit("--memory-layers needs two layer counts or more (the slope per layer)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        for i, spec in enumerate(runs_of(args)):
            print(f"[rehearse] {spec['name']}: {spec['kind']} run"
                  + (f", {spec['layers_override']} layers" if spec["layers_override"] else ""), file=sys.stderr, flush=True)
            result = run_child(spec, work / f"run{i}")
            result["label"], result["kind"] = spec["name"], spec["kind"]
            results.append(result)
    blocks = report(results, args)
    print(joined(blocks))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write:
        write_section(Path(args.write), blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
