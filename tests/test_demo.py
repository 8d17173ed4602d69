"""The embedded demo, exactly as `make demo` runs it (slow: a few CPU minutes)."""
import re

import pytest

from conftest import REPO, run_deepy


@pytest.mark.slow
def test_demo_learns_well_below_unigram_entropy(tmp_path):
    result = run_deepy("train.py", str(REPO / "configs/tiny-cpu.yml"), str(REPO / "configs/sim-2x2x2.yml"),
                       str(REPO / "configs/zero_topo.yml"), "--set", f"log_dir={tmp_path / 'logs'}",
                       "--set", f"save={tmp_path / 'ck'}", timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    valid = float(re.search(r"final validation loss ([\d.]+)", result.stdout).group(1))
    entropy = float(re.search(r"unigram entropy of the training data ([\d.]+)", result.stdout).group(1))
    assert valid < entropy - 1.0, (valid, entropy)
    assert re.search(r"communication per optimizer step .*inter_node", result.stdout)
