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
GB, MS = 1e9, 1e3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS, help="config files (default: 20B on Frontier)")
    p.add_argument("--nodes", type=int, default=48, help="Slurm nodes the topology preset spans")
    p.add_argument("--rank", type=int, default=0, help="the rank this process plays")
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--set", dest="sets", action="append", default=[], help="config override, KEY=VALUE")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps after the first (meta)")
    p.add_argument("--device-runs", nargs="+", default=["meta", "cpu"], choices=("meta", "cpu", "cuda"),
                   help="meta: time, counts, syncs at full shape; cpu: memory at --memory-layers; cuda: memory at full shape")
    p.add_argument("--memory-layers", type=int, nargs="+", default=[1, 3], help="layer counts of the cpu runs (>= 2 values)")
    p.add_argument("--memory-seq", type=int, default=8, help="seq_length of the cpu runs")
    p.add_argument("--memory-micro", type=int, default=1, help="micro-batch of the cpu runs")
    p.add_argument("--work-dir", default=None, help="where data, checkpoints and logs go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write every run's measurements and predictions here")
    p.add_argument("--write", default=None, help="replace the marked section of this markdown file with the tables")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- one process -----------------------------------------------------------------------------------

def child(spec_path: str) -> int:
    """Run one configuration (a JSON spec written by the parent) and write its result beside it."""
    from megatron.config import load_config
    from megatron.engine.setup import layout_from_config
    from megatron.config import world_size_of
    from megatron.rehearsal import predict
    from megatron.rehearsal.run import Settings, rehearse
    spec = json.loads(Path(spec_path).read_text())
    cfg = load_config([REPO / f for f in spec["files"]], spec["sets"], env=spec["env"], notices=[])
    result = rehearse(cfg, Settings(rank=spec["rank"], device=spec["device"], steps=spec["steps"],
                                    work_dir=Path(spec["work_dir"])))
    _cfg, layout, _plan = layout_from_config(cfg, world_size_of(cfg))
    model_spec = predict.spec_of(cfg, result["vocab"], layout)
    result["predicted"] = {"collectives_per_step": predict.collective_counts(model_spec),
                           "ledger_per_step": predict.rank_ledger(model_spec, spec["rank"]),
                           "memory": predict.memory_peaks(cfg, result["vocab"], model_spec, spec["device"])}
    Path(spec["out"]).write_text(json.dumps(result, indent=1))
    return 0


def run_child(spec: dict, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "work_dir": str(folder), "out": str(folder / "result.json")}
    path = folder / "spec.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(path)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
                              "OMP_NUM_THREADS", str(os.cpu_count() or 1))})
    if done.returncode != 0:
        raise SystemExit(f"rehearsal of {spec['name']} on {spec['device']} failed:\n{done.stderr[-4000:]}")
    return json.loads(Path(spec["out"]).read_text())


def runs_of(args) -> list[dict]:
    """Every process to start: (preset, device, layers)."""
    env = {"SLURM_JOB_NUM_NODES": str(args.nodes)}
    base = list(args.configs)
    common = ["eval_iters=0", "checkpoint_factor=null", "keep_last_n_checkpoints=null", "load=null",
              "use_wandb=false", "tensorboard_dir=null", "log_interval=1"]
    runs = []
    for name in args.presets:
        preset_file, extra = PRESETS[name]
        files = base + [preset_file]
        for device in args.device_runs:
            layer_counts = args.memory_layers if device == "cpu" else [None]
            for layers in layer_counts:
                sets = common + extra + list(args.sets)
                if device == "cpu":
                    sets += [f"num_layers={layers}", f"seq_length={args.memory_seq}",
                             f"max_position_embeddings={args.memory_seq}",
                             f"train_micro_batch_size_per_gpu={args.memory_micro}"]
                runs.append({"name": name, "device": device, "files": files, "sets": sets, "env": env,
                             "rank": args.rank, "steps": args.steps if device == "meta" else 1,
                             "layers_override": layers})
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


def report(results: list[dict], args) -> str:
    meta = [r for r in results if r["device"] == "meta"]
    out = []
    if meta:
        first = meta[0]
        out.append(f"Rank {first['rank']} of {first['world_size']} ({first['layers']} layers, {first['units']} units, "
                   f"micro-batch {first['micro_batch']} x {first['seq_length']} tokens, {first['precision']}), on the "
                   "meta device: no compute, so the times are the host's.\n")
        rows = []
        for r in meta:
            st, host = r["startup_s"], r["host_s"]
            engine_ms = (host["micro step"] - r["model_only_micro_step_s"]) * MS
            rows.append([r["label"], f"{st['process group']:.2f}", f"{st['groups']:.2f}", f"{st['data index']:.2f}",
                         f"{st['model build']:.1f}", f"{st['model build'] / r['units']:.2f}", f"{st['first step']:.2f}",
                         f"{host['micro step'] * MS:.1f}", f"{r['model_only_micro_step_s'] * MS:.1f}", f"{engine_ms:.1f}",
                         f"{host['optimizer step'] * MS:.1f}",
                         f"{(host['train step'] - r['accumulation'] * host['micro step'] - host['optimizer step']) * MS:.1f}"])
        out.append(table(["preset", "process group s", "groups s", "data index s", "model build s", "build s / unit",
                          "first step s", "micro-step ms", "model alone ms", "engine ms / micro-step",
                          "optimizer step ms", "trainer's rest ms"], rows))
        rows = []
        for r in meta:
            syncs = r["host_syncs"]
            coll = r["collectives_per_step"]
            rows.append([r["label"], sum(coll.values()), _agree(coll, r["predicted"]["collectives_per_step"]),
                         f"{sum(r['ledger_per_step'].values()) / GB:.3f}",
                         _agree(r["ledger_per_step"], r["predicted"]["ledger_per_step"]),
                         _syncs(syncs["micro step"]), _syncs(syncs["optimizer step"]), _syncs(syncs["trainer"]),
                         syncs["per step"], len(r["checkpoint"]["files"]), f"{r['checkpoint']['bytes'] / GB:.3f}"])
        out.append("\n" + table(["preset", "collectives / step", "vs comm model", "ledger GB / step", "vs comm model",
                                 "syncs / micro-step", "syncs / optimizer step", "syncs / trainer", "syncs / step",
                                 "checkpoint files", "checkpoint GB"], rows))
    cpu = [r for r in results if r["device"] in ("cpu", "cuda") and r.get("memory")]
    if cpu:
        out.append("\n" + memory_report(cpu, meta, args))
    return "\n".join(out) + "\n"


def _syncs(by_kind: dict) -> str:
    parts = [f"{n} {kind.replace('_', ' ')}" for kind, n in by_kind.items() if n and kind != "async_host_to_device"]
    return ", ".join(parts) or "0"


def memory_report(runs: list[dict], meta: list[dict], args) -> str:
    from megatron.rehearsal.predict import extrapolate
    full = {r["label"]: r["layers"] for r in meta}
    rows = []
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = sorted((r for r in runs if r["label"] == label), key=lambda r: r["layers"])
        for phase in ("build", "step", "save", "load"):
            got = {r["layers"]: r["memory"].get(phase) for r in mine}
            want = {r["layers"]: r["predicted"]["memory"][phase] for r in mine}
            if any(v is None for v in got.values()):
                continue
            cells = [f"{got[l] / GB:.2f} / {want[l] / GB:.2f} = {got[l] / want[l]:.2f}" for l in got]
            if len(got) >= 2 and label in full:
                slope, at_full = extrapolate(got, full[label])
                want_slope, want_full = extrapolate(want, full[label])
                cells += [f"{slope / GB:.3f} / {want_slope / GB:.3f}", f"{at_full / GB:.1f} / {want_full / GB:.1f}"]
            else:
                cells += ["-", "-"]
            rows.append([label, phase] + cells)
    layers = sorted({r["layers"] for r in runs})
    device = runs[0]["device"]
    first = runs[0]
    head = (f"Memory of rank {first['rank']} of {first['world_size']} on {device} (the allocator's peak per phase; "
            f"micro-batch {first['micro_batch']} x {first['seq_length']} tokens), measured / predicted by the memory "
            f"model, at {', '.join(map(str, layers))} layers; the slope per layer and the value at the full layer "
            "count are an extrapolation from the two largest runs, not a measurement.\n")
    return head + table(["preset", "phase"] + [f"{l} layers GB" for l in layers] +
                        ["GB per layer (measured / model)", "full model GB, extrapolated / model"], rows)


def write_section(path: Path, text: str) -> None:
    page = path.read_text()
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section")
    head, rest = page.split(BEGIN, 1)
    path.write_text(head + BEGIN + "\n" + text + END + rest.split(END, 1)[1])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args.child)
    if "cpu" in args.device_runs and len(args.memory_layers) < 2:
        raise SystemExit("--memory-layers needs two layer counts or more (the slope per layer)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        for i, spec in enumerate(runs_of(args)):
            print(f"[rehearse] {spec['name']} on {spec['device']}"
                  + (f", {spec['layers_override']} layers" if spec["layers_override"] else ""), file=sys.stderr, flush=True)
            result = run_child(spec, work / f"run{i}")
            result["label"] = spec["name"]
            results.append(result)
    text = report(results, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write:
        write_section(Path(args.write), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
