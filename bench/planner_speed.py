#!/usr/bin/env python
"""The planner's time for one node count, before and after its shortcuts, in one process.

    .venv/bin/python bench/planner_speed.py                      # 20B + frontier.yml, 48 nodes
    .venv/bin/python bench/planner_speed.py --nodes 16 --old-commit af858db --no-cli

The search ``tools/plan.py`` runs by default (every nested layout and ZeRO++, every quantization
choice, activation checkpointing off and on, the device's memory as the budget), then its --top
rows. New: this checkout's planner (only the candidates that fit are timed; the time model shares
work between candidates). Old: the planner of --old-commit (every candidate timed one by one),
extracted with ``git archive`` into a temporary folder and imported in this process in place of
this checkout's ``megatron`` package while it runs. Each is timed cold (its first search in the
process: the time model's caches start empty), in wall and CPU seconds; CPU time is the fairer
figure on a shared machine. Then whether the two choose the same candidate with the same top rows
(they can differ only if the figure sets changed between the commits: tests/test_planner_exact.py
holds the choices equal within one checkout), and, unless --no-cli, the wall time of the whole
``tools/plan.py`` command (imports, config, the preset rows) for this checkout.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OLD_COMMIT = "af858db"  # the last commit before the planner's shortcuts (issue 39, part 4)
TOP = 12


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["configs/20B.yml", "configs/frontier.yml"])
    p.add_argument("--nodes", type=int, default=48)
    p.add_argument("--old-commit", default=OLD_COMMIT)
    p.add_argument("--no-cli", action="store_true", help="skip timing the whole tools/plan.py command")
    return p.parse_args(argv)


@contextmanager
def megatron_from(root: Path):
    """Import ``megatron`` from ``root`` inside the block, this checkout's again after it: every
    module of the package is swapped, so each version only ever sees its own modules."""
    def ours() -> dict:
        return {name: mod for name, mod in sys.modules.items() if name == "megatron" or name.startswith("megatron.")}

    saved = ours()
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        for name in ours():
            del sys.modules[name]
        sys.modules.update(saved)
        sys.path.remove(str(root))


def timed_plan(configs: list, nodes: int) -> dict:
    """One search and its top rows with whichever ``megatron`` is imported now (names both versions share)."""
    from megatron.config import load_config
    from megatron.topology import Topology
    from megatron.analytic import planner
    from megatron.analytic.hardware import Hardware
    from megatron.analytic.model_inputs import figure_set_of, padded_vocab_of
    cfg = load_config([str(REPO / c) for c in configs], ["topology.preset=frontier", f"num_nodes={nodes}"], notices=[])
    hw = Hardware.from_topology(Topology.from_config(cfg, cfg.topology.world_size), backend="nccl",
                                figures=figure_set_of(cfg))
    inputs = planner.inputs_from_config(cfg, padded_vocab_of(cfg), hw)
    quants = {name: planner.quant_spec(name, inputs.quant_block) for name in planner.QUANT_CHOICES}
    wall, cpu = time.perf_counter(), time.process_time()
    plan = planner.search(cfg.topology.layout, inputs, quants=quants, checkpointing=(False, True))
    if hasattr(planner, "ranked"):
        top = planner.ranked(plan, inputs, TOP)
    else:  # the old table's order: those that fit, fastest first, then the others
        top = sorted(plan.rows, key=lambda r: (not r.feasible, r.time.total_s))[:TOP]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu

    def key(row) -> tuple:
        c = row.candidate
        return (c.layout.factors.as_tuple(), c.layout.hpz, c.quant_name, c.checkpointed, row.time.total_s)

    return {"wall": wall, "cpu": cpu, "candidates": len(plan.rows), "fit": sum(r.feasible for r in plan.rows),
            "best": key(plan.best) if plan.best else None, "top": [key(r) for r in top],
            "source": plan.source}


def old_plan(commit: str, configs: list, nodes: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "megatron"], capture_output=True)
        if archive.returncode:
            raise SystemExit(f"planner_speed: git archive {commit} failed: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        with megatron_from(Path(tmp)):
            return timed_plan(configs, nodes)


def main(argv=None) -> int:
    args = parse_args(argv)
    new = timed_plan(args.configs, args.nodes)
    old = old_plan(args.old_commit, args.configs, args.nodes)
    what = f"{' + '.join(args.configs)}, {args.nodes} nodes"
    print(f"{what}: {new['candidates']} candidates, {new['fit']} fit; figures {new['source']}")
    print(f"{'':>26}  {'wall s':>8}  {'CPU s':>8}")
    print(f"{'old (' + args.old_commit + ', exhaustive)':>26}  {old['wall']:8.2f}  {old['cpu']:8.2f}")
    print(f"{'new (this checkout)':>26}  {new['wall']:8.2f}  {new['cpu']:8.2f}")
    print(f"old / new: {old['wall'] / new['wall']:.1f}x wall, {old['cpu'] / new['cpu']:.1f}x CPU")
    same = old["best"] == new["best"] and old["top"] == new["top"]
    print(f"same choice and top {TOP} rows: {'yes' if same else 'NO'}"
          + ("" if same or old["source"] == new["source"] else f" (old figures: {old['source']})"))
    if not same:
        print(f"  old best {old['best']}\n  new best {new['best']}")
    if not args.no_cli:
        wall = time.perf_counter()
        done = subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), *args.configs, "--nodes", str(args.nodes)],
                              cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"planner_speed: tools/plan.py failed:\n{done.stderr[-2000:]}")
        print(f"tools/plan.py {' '.join(args.configs)} --nodes {args.nodes}, whole command (new): "
              f"{time.perf_counter() - wall:.2f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
