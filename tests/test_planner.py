"""The planner (megatron/analytic/planner.py, tools/plan.py, zero_optimization.plan: auto): it only
ever proposes layouts that nest and fit, the best it marks is the fastest of those, and a run with
plan auto trains under the layout it logs."""
from __future__ import annotations

import itertools
import math
import sys

import pytest

from conftest import REPO, run_deepy, tiny_run_config
from megatron.config import ConfigError, load_config
from megatron.config.quant_spec import QuantSpec
from megatron.analytic.planner import (PlanInputs, apply_plan, candidate_layouts, plan_for_config, planned_config,
                                        search)
from megatron.analytic.hardware import Device, Hardware, TierLink
from megatron.analytic.time_model import StepWork

UNITS = (20_000, 60_000, 60_000, 60_000, 30_000)  # embedding, 3 blocks, head


def inputs(budget: float, micro_batches: int = 2) -> PlanInputs:
    links = {"inter_node": TierLink(1e9, 1e-5), "intra_node": TierLink(1e10, 2e-6), "intra_gpu": TierLink(4e10, 1e-6)}
    hw = Hardware(links, Device("toy", 1e12, 1e10, 1e10, 0.5, 1e12), "nccl")
    work = StepWork(512, (0.0, 2e5, 2e5, 2e5, 1e5))
    return PlanInputs(UNITS, work, micro_batches, 2, True, {False: 3_000_000, True: 1_000_000}, hw, budget)


def nests(w: int, g: int, os_: int, n: int) -> bool:
    return g % w == 0 and os_ % g == 0 and n % os_ == 0


@pytest.mark.parametrize("tiers", [(2, 2, 2), (2, 4), (4, 2, 2), (3, 2)])
def test_the_candidates_are_exactly_the_nested_layouts_and_zeropp(tiers):
    n = math.prod(tiers)
    layouts = candidate_layouts(tiers)
    ladder = {lay.factors.as_tuple() for lay in layouts if not lay.hpz}
    every = {(w, g, o) for w, g, o in itertools.product(range(1, n + 1), repeat=3) if nests(w, g, o, n)}
    assert ladder == every
    assert sum(lay.hpz for lay in layouts) == 1


def test_the_best_plan_fits_the_budget_and_is_the_fastest_that_does():
    quants = {"none": QuantSpec(), "int8w-int4g": QuantSpec.from_settings(True, True, block_size=256)}
    everything = search((2, 2, 2), inputs(1e15), quants=quants, checkpointing=(False, True))
    peaks = sorted({row.peak_bytes for row in everything.rows})
    assert len(everything.rows) == (len(candidate_layouts((2, 2, 2)))) * 2 * 2
    for budget in [peaks[0], *peaks[len(peaks) // 4::len(peaks) // 4], peaks[-1]]:
        plan = search((2, 2, 2), inputs(budget), quants=quants, checkpointing=(False, True))
        best = plan.best
        assert best is not None and best.feasible and best.peak_bytes <= budget
        w, g, os_ = best.factors
        assert nests(w, g, os_, 8)
        fitting = [r for r in plan.rows if r.peak_bytes <= budget]
        assert best.time.total_s == min(r.time.total_s for r in fitting)
        assert all(r.feasible == (r.peak_bytes <= budget) for r in plan.rows)
    below = search((2, 2, 2), inputs(peaks[0] * 0.99), quants=quants, checkpointing=(False, True))
    assert below.best is None and "no layout fits" in below.reason()


def test_a_smaller_budget_never_gives_a_faster_plan():
    times = []
    for budget in (1e15, 3e6, 2e6, 1.5e6):
        plan = search((2, 2, 2), inputs(budget), checkpointing=(False, True))
        times.append(plan.best.time.total_s if plan.best else math.inf)
    assert times == sorted(times)


def _auto_config(tmp_path, tiny_corpus, **zero):
    path = tiny_run_config(tmp_path, tiny_corpus, zero_optimization={"plan": "auto", **zero}, train_micro_batch_size_per_gpu=2,
                           topology={"simulate": [2, 2]})
    return load_config([str(path)], [], notices=[])


def test_plan_auto_writes_explicit_factors_that_the_layout_accepts(tmp_path, tiny_corpus):
    cfg = _auto_config(tmp_path, tiny_corpus)
    assert cfg.zero.resolved_factors is None
    planned, plan = planned_config(cfg, 4)
    assert plan is not None and plan.best.feasible
    assert planned.zero.resolved_factors == list(plan.best.factors)
    from megatron.topology.layout import ShardLayout
    layout = ShardLayout.from_config(planned)
    assert layout.factors.as_tuple() == plan.best.factors
    assert "figures: nominal (preset sim2x2" in plan.reason()
    again, _ = planned_config(cfg, 4)  # pure arithmetic: every rank gets the same plan
    assert again.zero.resolved_factors == planned.zero.resolved_factors
    assert apply_plan(cfg, plan.best).zero.shard_factors in (list(plan.best.factors), None)


def test_plan_auto_says_why_nothing_fits(tmp_path, tiny_corpus):
    cfg = _auto_config(tmp_path, tiny_corpus, plan_memory_per_device_gb=1e-6)
    with pytest.raises(ConfigError, match="no layout fits 1e-06 GB per device.*raise plan_memory_per_device_gb"):
        plan_for_config(cfg, cfg.model.padded_vocab_size or 384, 4)


@pytest.mark.parametrize("zero,match", [({"plan": "auto", "stage": 3}, "is set together with plan: auto"),
                                        ({"plan": "auto", "preset": "zero_topo"}, "is set together with plan: auto"),
                                        ({"plan_quantize": True}, "only applies with plan: auto")])
def test_plan_auto_conflicts_are_config_errors(tmp_path, tiny_corpus, zero, match):
    path = tiny_run_config(tmp_path, tiny_corpus, zero_optimization=zero, topology={"simulate": [2, 2]},
                           train_micro_batch_size_per_gpu=2)
    with pytest.raises(ConfigError, match=match):
        load_config([str(path)], [], notices=[])


def test_a_run_with_plan_auto_trains_under_the_layout_it_logs(tmp_path, tiny_corpus):
    path = tiny_run_config(tmp_path, tiny_corpus, zero_optimization={"plan": "auto"},
                           topology={"simulate": [2, 2]}, train_micro_batch_size_per_gpu=2, train_iters=4, eval_interval=100, log_interval=2)
    result = run_deepy("train.py", str(path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "shard factors chosen at start-up (plan: auto)" in out
    line = next(x for x in out.splitlines() if "zero_optimization.plan auto chose" in x)
    assert "predicted" in line and "figures: nominal (preset sim2x2" in line
    assert (tmp_path / "logs" / "metrics.jsonl").exists()


def test_plan_cli_marks_the_best_row_per_node_count(capsys):
    sys.path.insert(0, str(REPO / "tools"))
    import plan as plan_cli
    code = plan_cli.main([str(REPO / "configs" / "20B.yml"), "--topology", "frontier", "--nodes", "8,16",
                          "--quantization", "config", "--checkpointing", "config", "--top", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("8 nodes:") == 1 and out.count("16 nodes:") == 1
    assert out.count("\n*") >= 2 or out.count("*  ") >= 2
    assert "summary: the best layout per node count" in out and "scaling efficiency" in out
    assert out.count("best, seconds on the critical path by phase: compute ") == 2


def test_plan_cli_bad_input_is_one_line(capsys):
    sys.path.insert(0, str(REPO / "tools"))
    import plan as plan_cli
    code = plan_cli.main([str(REPO / "configs" / "20B.yml"), "--topology", "sim"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("plan: error: --topology sim needs --layout") and err.count("\n") == 1


def test_plan_cli_names_the_missing_tokenizer(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "tools"))
    import plan as plan_cli
    missing = tmp_path / "no-tokenizer.json"
    code = plan_cli.main([str(REPO / "configs" / "tiny-cpu.yml"), "--topology", "sim", "--layout", "2", "2",
                          "--set", f"vocab_file={missing}"])
    err = capsys.readouterr().err
    assert code == 2 and str(missing) in err and "--set vocab_size=N" in err and err.count("\n") == 1


def _markdown_rows(out: str) -> list:
    """The table's data rows as {column: cell} (tools/plan.py --markdown)."""
    lines = [x for x in out.splitlines() if x.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in x.strip("|").split("|")))) for x in lines[2:]]


def _plan_cli(capsys, *args) -> list:
    sys.path.insert(0, str(REPO / "tools"))
    import plan as plan_cli
    code = plan_cli.main([str(REPO / "configs" / "20B.yml"), "--topology", "frontier", "--nodes", "2", "--markdown", *args])
    assert code == 0
    return _markdown_rows(capsys.readouterr().out)


def test_plan_cli_lists_every_named_preset_once_beside_the_top_rows(capsys):
    from megatron.analytic.planner import PRESET_CONFIGS
    rows = _plan_cli(capsys, "--top", "2")
    labels = [label for r in rows for label in r["preset"].split(", ") if label]
    assert sorted(labels) == sorted(label for label, _, _ in PRESET_CONFIGS)
    assert len(rows) <= 2 + len(PRESET_CONFIGS) and rows[0][""] == "*"
    by_label = {label: r for r in rows for label in r["preset"].split(", ") if label}
    # 16 ranks, 8 per node, 2 per GPU: the presets' factors and bits as configs/<name>.yml mean them
    expected = {"zero3": ("zero3", "(16, 16, 16)", "0/0/0/0"), "zero3 int8/int4": ("zero3", "(16, 16, 16)", "8/4/4/8"),
                "hsdp": ("hsdp", "(8, 8, 8)", "0/0/0/0"), "zeropp int8/int4": ("zeropp", "(16, 16, 16)", "8/4/4/8"),
                "zero_topo": ("zero_topo", "(2, 8, 16)", "0/0/0/0"),
                "zero_topo_paper": ("zero_topo (all_reduce)", "(2, 8, 16)", "8/4/0/8"),
                "zero_topo_paper 16-bit": ("zero_topo (all_reduce)", "(2, 8, 16)", "0/0/0/0")}
    for label, (layout, factors, bits) in expected.items():
        r = by_label[label]
        assert (r["layout"], r["(w, g, os)"], r["bits w/g/x/r"], r["ckpt"]) == (layout, factors, bits, "on"), label
    # the paper's all-reduce sends twice our reduce-scatter's bytes across nodes in the cross hop
    assert float(by_label["zero_topo_paper 16-bit"]["inter GB"]) > float(by_label["zero_topo"]["inter GB"])


def test_plan_cli_marks_a_preset_among_the_top_rows_with_the_searchs_own_numbers(capsys):
    every = _plan_cli(capsys, "--top", "0", "--checkpointing", "on")
    searched = [r for r in every if "(all_reduce)" not in r["layout"]]
    assert len(searched) == len(candidate_layouts((2, 4, 2))) * 3  # every candidate, three quantizations
    marked = {r["preset"]: r for r in searched if r["preset"]}
    assert set(marked) == {"zero3", "zero3 int8/int4", "zeropp", "zeropp int8/int4", "hsdp", "hsdp int8/int4",
                           "zero_topo", "zero_topo int8/int4"}
    # below a shorter table's top rows, a preset shows the numbers of its row in the full table
    top = _plan_cli(capsys, "--top", "1", "--checkpointing", "on")
    for r in top[1:]:
        if "(all_reduce)" not in r["layout"]:
            assert r.items() <= marked[r["preset"]].items(), r["preset"]


def test_plan_cli_says_why_a_preset_does_not_fit(capsys):
    rows = _plan_cli(capsys, "--top", "1", "--memory-per-device", "30GB")
    hsdp = next(r for r in rows if r["preset"] == "hsdp")
    assert hsdp["fits"] == "no" and float(hsdp["peak GB"]) > 30
    why = hsdp["why it does not fit"]
    assert why.startswith(f"step {hsdp['peak GB']} GB > 30 GB: states ") and "activations" in why
