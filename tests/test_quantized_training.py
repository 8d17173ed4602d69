"""tiny-cpu.yml with INT8 weights + INT4 gradients on the simulated 2x2x2 topology ends within 2% of
the unquantized run after 30 steps, and sends fewer inter-node bytes (slow: two 8-rank runs)."""
import json
import re

import pytest

from conftest import REPO, run_deepy


def _run(tmp_path, quantized: bool):
    logs = tmp_path / ("q" if quantized else "plain")
    result = run_deepy("train.py", str(REPO / "configs/tiny-cpu.yml"), str(REPO / "configs/sim-2x2x2.yml"),
                       str(REPO / "configs/zero_topo.yml"), "--set", "train_iters=30", "--set", "eval_interval=30",
                       "--set", "log_interval=1", "--set", "save=null", "--set", "checkpoint_factor=null",
                       "--set", f"log_dir={logs}",
                       "--set", f"zero_optimization.zero_quantized_weights={str(quantized).lower()}",
                       "--set", f"zero_optimization.zero_quantized_gradients={str(quantized).lower()}")
    assert result.returncode == 0, result.stderr[-3000:]
    valid = float(re.search(r"final validation loss ([\d.]+)", result.stdout).group(1))
    records = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    inter = [r["comm/bytes/inter_node"] for r in records if "comm/bytes/inter_node" in r]
    return valid, inter[-1]


@pytest.mark.slow
def test_quantized_zero_topo_within_two_percent(tmp_path):
    plain_loss, plain_bytes = _run(tmp_path, False)
    quant_loss, quant_bytes = _run(tmp_path, True)
    assert abs(quant_loss - plain_loss) / plain_loss < 0.02, (quant_loss, plain_loss)
    assert quant_bytes < 0.25 * plain_bytes, (quant_bytes, plain_bytes)
