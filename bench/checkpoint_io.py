"""Checkpoint save and load time and size for tiny-cpu.yml under each layout, and a reshard load
(each layout's checkpoint loaded by the single process), measured in one run.

    .venv/bin/python bench/checkpoint_io.py

Times are what the trainer reports: save = every rank writes + fsync + atomic commit (wall time on
rank 0); load = reassembling full tensors from every rank's pieces + cutting this layout's slices.
The baseline row is the single process; other rows show their ratio to it.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"single": [], "zero3 on 2x2": ["configs/sim-2x2.yml", "configs/zero3.yml"],
           "zero_topo on 2x2x2": ["configs/sim-2x2x2.yml", "configs/zero_topo.yml"],
           "hsdp on 2x2x2": ["configs/sim-2x2x2.yml", "configs/hsdp.yml"]}
SAVED = re.compile(r"saved checkpoint (\S+) \(([\d.]+ \w+), ([\d.]+) s\)")
LOADED = re.compile(r"resumed from \S+ at step \d+ \(([\d.]+) s\)")


def deepy(files, sets):
    cmd = [sys.executable, str(REPO / "deepy.py"), "train.py", str(REPO / "configs/tiny-cpu.yml"),
           *[str(REPO / f) for f in files], *sum((["--set", s] for s in sets), [])]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return done.stdout


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, files in LAYOUTS.items():
            ck = Path(tmp) / name.replace(" ", "_")
            common = ["eval_iters=0", f"log_dir={ck}/logs", "checkpoint_factor=null"]
            saved = SAVED.search(deepy(files, common + ["train_iters=2", f"save={ck}"]))
            same = LOADED.search(deepy(files, common + ["train_iters=2", f"load={ck}", "save=null"]))
            single = LOADED.search(deepy([], common + ["train_iters=2", f"load={ck}", "save=null"]))
            rows.append((name, saved.group(2), float(saved.group(3)), float(same.group(1)), float(single.group(1))))
    base = rows[0][2]
    print("layout | size | save s (x single) | load, same layout s | load into 1 process s")
    for name, size, save, load_same, load_single in rows:
        print(f"{name} | {size} | {save:.2f} ({save / base:.1f}x) | {load_same:.2f} | {load_single:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
