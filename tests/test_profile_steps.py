"""GPT-NeoX's `profile`, `profile_step_start`, `profile_step_stop` through deepy: the steps in the
window are profiled on every rank (trace and breakdown files), rank 0 logs the breakdown, and
training is the same as without profiling."""
from __future__ import annotations

import gzip
import json

import pytest

from conftest import run_deepy, run_together, tiny_run_config, train_losses


def _metrics(log_dir) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record["iteration"], {}).update(record)
    return out


@pytest.mark.slow  # a deepy run with the profiler on (~9 s); the breakdown's parts are tests/test_step_profile.py's
def test_profiled_steps_leave_traces_and_breakdowns_and_train_the_same(tmp_path, tiny_corpus):
    runs = {
        "plain": {},
        "profiled": {"profile": True, "profile_step_start": 2, "profile_step_stop": 4},
        "sharded": {"profile": True, "profile_step_start": 2, "profile_step_stop": 3,
                    "topology": {"simulate": [2, 1]}, "zero_optimization": {"stage": 3},
                    "train_micro_batch_size_per_gpu": 2},
    }
    configs = {}
    for name, extra in runs.items():
        (tmp_path / name).mkdir()
        configs[name] = tiny_run_config(tmp_path / name, tiny_corpus, train_iters=4, eval_iters=0, log_interval=5,
                                        **extra)
    calls = [lambda c=c: run_deepy("train.py", str(c)) for c in configs.values()]
    done = dict(zip(configs, run_together(*calls)))
    for name, result in done.items():
        assert result.returncode == 0, (name, result.stderr[-3000:])

    # Profiling changes nothing the run computes (the plain run logs steps 1 and 4, the profiled 1 to 4).
    plain, profiled = (train_losses(tmp_path / name / "logs") for name in ("plain", "profiled"))
    assert sorted(plain) == [1, 4] and sorted(profiled) == [1, 2, 3, 4]
    assert {step: profiled[step] for step in plain} == pytest.approx(plain, rel=1e-6)

    # One process: steps 2 and 3, not 1 or 4, each with its trace, breakdown, metrics and log line.
    logs = tmp_path / "profiled" / "logs"
    files = sorted(p.name for p in (logs / "profile").iterdir())
    assert files == [f"step_000000{n}_rank_00000.{kind}" for n in (2, 3) for kind in ("breakdown.json", "json.gz")]
    metrics = _metrics(logs)
    for iteration in (2, 3):
        record = metrics[iteration]
        assert record["profile/matmul_ms"] > 0 and record["profile/optimizer_ms"] > 0
        assert record["profile/busy_ms"] <= record["profile/step_ms"]
        assert record["profile/communication_ms"] == 0.0 and "train/lm_loss" in record  # logged in full
        saved = json.loads((logs / "profile" / f"step_000000{iteration}_rank_00000.breakdown.json").read_text())
        assert saved["by_kind"]["matmul"] == pytest.approx(record["profile/matmul_ms"])
        assert f"profile step {iteration} (rank 0, host): " in done["profiled"].stdout
    assert not any(key.startswith("profile/") for key in metrics[1]) and not any(
        key.startswith("profile/") for key in metrics[4])
    with gzip.open(logs / "profile" / "step_0000002_rank_00000.json.gz", "rt") as trace:
        assert any(e.get("name", "").startswith("aten::addmm") for e in json.load(trace)["traceEvents"])

    # Two ranks under ZeRO-3: each writes its own; their gathers and reductions are communication.
    profile = tmp_path / "sharded" / "logs" / "profile"
    for rank in (0, 1):
        saved = json.loads((profile / f"step_0000002_rank_0000{rank}.breakdown.json").read_text())
        assert saved["rank"] == rank and saved["by_kind"]["communication"] > 0
        assert 0 < saved["exposed_comm_ms"] <= saved["busy_ms"]
        assert (profile / f"step_0000002_rank_0000{rank}.json.gz").exists()
    assert _metrics(tmp_path / "sharded" / "logs")[2]["profile/communication_ms"] > 0
