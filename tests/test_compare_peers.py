"""bench/compare_peers.py and megatron/benchmarking/ (compare_peers, compare_report; docs/benchmarks.md).

Fast: the row, ratio, table, goal and chart logic on rank files and results written here with values
worked out by hand, and the argument errors. Slow (`-m slow`, emulated cluster: root + iproute2, and
deepspeed for its rows): parity of our zero3 with DeepSpeed ZeRO-3 and of our hsdp with FSDP2 HSDP on
2 x 2 rate-limited ranks, and a smoke run of the benchmark itself.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

from megatron.benchmarking import compare_peers, peers
from megatron.benchmarking import compare_report as report

SCRIPT = REPO / "bench" / "compare_peers.py"
_spec = importlib.util.spec_from_file_location("compare_peers_cli", SCRIPT)
cli = importlib.util.module_from_spec(_spec)  # the command line: main() and its exit codes
_spec.loader.exec_module(cli)


# --- rows from rank files -------------------------------------------------------------------------

def rank_file(rank, local_rank, times, tx=None, bookkeeping_tx=None, ledger=None, rss_kb=100_000):
    out = {"ok": True, "rank": rank, "local_rank": local_rank, "step_times_s": times,
           "losses": [7.0, 6.5, 6.25, 6.0], "grad_norms": [1.0, 0.9, 0.8], "info": {"factors": [2, 2, 4]},
           "interface_window": None, "interface_bookkeeping": None, "ledger_inter_node_window": ledger,
           "maxrss_kb": rss_kb}
    if tx is not None:
        out["interface_window"] = {"tx_bytes": tx, "rx_bytes": 0}
        out["interface_bookkeeping"] = {"tx_bytes": bookkeeping_tx, "rx_bytes": 0}
    return out


def two_by_two_ranks(ledger=True):
    """2 nodes x 2 ranks, 1 warmup + 3 timed steps. Node 0 sent 1,000 B in the window (100 of them
    bookkeeping), node 1 1,600 B (100): per step (900 + 1,500) / 3 = 800 B, busiest node 500 B."""
    led = (lambda b: {"grad_reduce": b, "refresh": 0, "control": 10}) if ledger else (lambda b: None)
    return [rank_file(0, 0, [10.0, 1.0, 3.0, 2.0], tx=1000, bookkeeping_tx=100, ledger=led(140)),
            rank_file(1, 1, [9.0, 9.0, 9.0, 9.0], ledger=led(140), rss_kb=300_000),
            rank_file(2, 0, [9.0, 9.0, 9.0, 9.0], tx=1600, bookkeeping_tx=100, ledger=led(140)),
            rank_file(3, 1, [9.0, 9.0, 9.0, 9.0], ledger=led(140))]


def test_a_row_from_rank_files():
    tool = {"inter_node_tx_bytes": 5000, "rate_bits_per_s": 8000.0}
    row = report.summarize_ranks(two_by_two_ranks(), tool, 0, steps=3, warmup=1, world_size=4)
    assert row["ok"] and row["error"] is None
    assert row["median_step_s"] == 2.0                 # rank 0's [1, 3, 2]; the 10 s warmup is out
    assert row["final_loss"] == 6.0
    assert row["iface_node_tx_per_step"] == [300.0, 500.0]
    assert row["iface_bytes_per_step"] == 800.0
    assert row["bookkeeping_bytes_per_step"] == pytest.approx(200 / 3)
    assert row["ledger_bytes_per_step"] == 200.0       # 4 ranks x (140 + 10) / 3
    assert row["ledger_phases_per_step"] == {"grad_reduce": pytest.approx(560 / 3), "control": pytest.approx(40 / 3)}
    assert row["iface_over_ledger"] == 4.0
    assert row["link_s_per_step"] == 0.5               # 500 B x 8 / 8,000 bit/s
    assert row["peak_rss_mb"] == pytest.approx(300_000 / 1024)
    assert row["launch_iface_bytes"] == 5000


def test_the_profiled_step_of_every_rank():
    """--breakdown: each rank's profiled step (ms) -> seconds, mean over ranks and largest; compute is
    the busy time less the exposed communication. Worked out by hand: compute 600, 500, 600, 600 ms."""
    ranks = two_by_two_ranks()
    for rank, (step, busy, exposed) in zip(ranks, [(1000, 900, 300), (1200, 1000, 500), (800, 700, 100),
                                                     (1000, 900, 300)]):
        rank["breakdown"] = {"step_ms": step, "busy_ms": busy, "exposed_comm_ms": exposed}
    row = report.summarize_ranks(ranks, None, 0, steps=3, warmup=1, world_size=4)
    assert row["profiled"] == {"step_s": {"mean": pytest.approx(1.0), "max": 1.2},
                               "compute_s": {"mean": pytest.approx(0.575), "max": 0.6},
                               "exposed_comm_s": {"mean": pytest.approx(0.3), "max": 0.5}}
    assert report.summarize_ranks(two_by_two_ranks(), None, 0, steps=3, warmup=1, world_size=4)["profiled"] is None
    res = results()
    res["rows"][6]["profiled"] = row["profiled"]
    assert "| 2x2 | 1 | ours zero_topo | on | 1.000 (1.200) | 0.575 (0.600) | 0.300 (0.500) | 30% |" in \
        report.markdown(res)
    args = compare_peers.parse_args(["--breakdown"])
    command = compare_peers.launch_command(args, compare_peers.BY_KEY["ours_zero_topo"], "2x2", 1, "on", REPO)
    assert "--breakdown" in command[-1]  # the ranks' command line


def test_a_peer_without_a_ledger_has_no_ledger_columns():
    row = report.summarize_ranks(two_by_two_ranks(ledger=False), None, 0, steps=3, warmup=1, world_size=4)
    assert row["ledger_bytes_per_step"] is None and row["iface_over_ledger"] is None
    assert row["link_s_per_step"] is None and row["iface_bytes_per_step"] == 800.0


def test_a_failed_launch_is_a_one_line_error():
    ranks = two_by_two_ranks()[:2] + [{"ok": False, "rank": 2, "error": "ValueError: This op had not\nbeen"}]
    row = report.summarize_ranks(ranks, None, 1, steps=3, warmup=1, world_size=4)
    assert row == {"ok": False, "error": "rank 2: ValueError: This op had not been"}
    row = report.summarize_ranks(two_by_two_ranks()[:3], None, 124, steps=3, warmup=1, world_size=4)
    assert row["error"] == "launch exited 124; no result from rank(s) [3]"


# --- ratios, table, goals, chart --------------------------------------------------------------------

def row(config, label, median, nbytes, layout="2x4", accumulation=4, overlap=None, ok=True, error=None,
        ledger=None):
    return {"config": config, "label": label, "peer": config.split("_")[0], "layout": layout,
            "accumulation": accumulation, "overlap": overlap, "ok": ok, "error": error, "launch_s": 30.0,
            "median_step_s": median, "final_loss": 7.5, "iface_bytes_per_step": nbytes,
            "ledger_bytes_per_step": ledger, "iface_over_ledger": report.ratio(nbytes, ledger),
            "link_s_per_step": None if median is None else median / 2, "peak_rss_mb": 300.0}


def results():
    rows = [row("ds_zero3", "DeepSpeed ZeRO-3", 8.0, 400e6),
            row("ds_hpz", "DeepSpeed ZeRO-3 + hpZ", 6.0, 300e6),
            row("ds_zeropp", "DeepSpeed ZeRO++", None, None, ok=False, error="rank 0: ValueError: no CPU op"),
            row("ours_zero_topo", "ours zero_topo", 2.0, 80e6, overlap="on", ledger=50e6),
            row("ours_zero_topo", "ours zero_topo", 5.0, 120e6, overlap="off", ledger=50e6),
            row("ds_zero3", "DeepSpeed ZeRO-3", 4.0, 100e6, layout="2x2", accumulation=1),
            row("ours_zero_topo", "ours zero_topo", 1.0, 50e6, layout="2x2", accumulation=1, overlap="on"),
            row("ours_hsdp", "ours hsdp", 3.0, 10e6, layout="2x2", accumulation=4, overlap="on")]
    report.add_ratios(rows)
    return {"meta": {"rate": "300mbit", "steps": 3, "warmup": 1}, "rows": rows}


def test_ratios_are_to_ds_zero3_of_the_same_layout_and_accumulation():
    rows = results()["rows"]
    assert [r["time_vs_ds_zero3"] for r in rows] == [1.0, 0.75, None, 0.25, 0.625, 1.0, 0.25, None]
    assert [r["bytes_vs_ds_zero3"] for r in rows] == [1.0, 0.75, None, 0.2, 0.3, 1.0, 0.5, None]


def test_markdown_table():
    text = report.markdown(results())
    assert text.splitlines()[0] == ("Rate 300mbit per node link; 3 timed steps after 1 warmup; "
                                    "loss after K = 4 steps.")
    assert "**2x4, accumulation 4**" in text and "**2x2, accumulation 1**" in text
    assert "| ours zero_topo | on | 2.000 | 0.25 | 7.5000 | 80.00 | 50.00 | 1.60 | 50% | 300 |" in text
    assert "| DeepSpeed ZeRO-3 | - | 8.000 | 1.00 | 7.5000 | 400.00 | - | - | 50% | 300 |" in text
    assert "| ours hsdp | on | 3.000 | - | 7.5000 | 10.00 | - | - | 50% | 300 |" in text  # no baseline ran
    assert "| DeepSpeed ZeRO++ | - | failed: rank 0: ValueError: no CPU op |" in text


def test_goals():
    verdicts = [(v["row"], v["measured"], v["met"]) for v in report.goals(results()["rows"])]
    assert verdicts == [
        ("ours zero_topo [overlap on]", "4.00x", True),
        ("ours zero_topo [overlap on]", "2.000 s vs 6.000 s", True),
        ("ours zero_topo [overlap on]", "0.200", True),
        ("ours zero_topo [overlap off]", "1.60x", False),
        ("ours zero_topo [overlap off]", "5.000 s vs 6.000 s", True),
        ("ours zero_topo [overlap off]", "0.300", False)]
    assert "- ours zero_topo [overlap off]: at least 2x DS ZeRO-3's speed: measured 1.60x -> NOT met" in \
        report.markdown(results())


def test_bar_chart_is_a_png(tmp_path):
    path = tmp_path / "chart.png"
    report.bar_chart(results(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_from_json_prints_the_table_and_draws(tmp_path, capsys):
    data, png = tmp_path / "r.json", tmp_path / "r.png"
    data.write_text(json.dumps(results()))
    assert cli.main(["--from-json", str(data), "--png", str(png), "--markdown"]) == 1  # a row failed
    assert "| ours zero_topo | off | 5.000 | 0.62 |" in capsys.readouterr().out
    assert png.exists()


# --- the plan and the arguments -----------------------------------------------------------------------

def test_the_plan_runs_ds_zero3_first_and_overlap_twice_for_ours_only():
    args = compare_peers.parse_args(["--only", "ours_hsdp", "fsdp2", "ds_zero3", "--layouts", "2x2",
                                     "--accumulation", "1", "4"])
    runs = [(c.key, layout, acc, overlap) for c, layout, acc, overlap in compare_peers.plan(args)]
    assert runs == [("ds_zero3", "2x2", 1, "default"), ("fsdp2", "2x2", 1, "default"),
                    ("ours_hsdp", "2x2", 1, "off"), ("ours_hsdp", "2x2", 1, "on"),
                    ("ds_zero3", "2x2", 4, "default"), ("fsdp2", "2x2", 4, "default"),
                    ("ours_hsdp", "2x2", 4, "off"), ("ours_hsdp", "2x2", 4, "on")]
    args = compare_peers.parse_args(["--layouts", "2x2", "--accumulation", "1", "--overlap", "on"])
    default = [c.key for c, *_ in compare_peers.plan(args)]
    eight_only = [c.key for c in compare_peers.CONFIGS if c.layouts and "2x2" not in c.layouts]
    assert eight_only == ["ours_topo_148", "ours_topo_228", "ours_topo_288", "ours_topo_448"]
    assert "ds_zeropp" not in default and len(default) == len(compare_peers.CONFIGS) - 2 - len(eight_only)
    args = compare_peers.parse_args(["--accumulation", "4", "--overlap", "on"])  # the default layout: 2x2x2
    assert {layout for _, layout, *_ in compare_peers.plan(args)} == {"2x2x2"}
    assert len(compare_peers.plan(args)) == len(compare_peers.CONFIGS) - 2


def test_shapes_share_the_global_batch():
    for layout, world, micro in (("2x4", 8, 1), ("2x2", 4, 2)):
        shape = compare_peers.bench_shape("bench", layout, 4)
        assert (shape.world_size, shape.micro_batch, shape.describe()["global_batch"]) == (world, micro, 32)


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--warmup", "-1"], "--warmup -1: must be non-negative"),
    (["--only", "ds_zero9"], "--only ds_zero9: unknown configuration"),
    (["--layouts", "3x3"], "--layouts 3x3: unknown layout"),
    (["--accumulation", "0"], "every count must be at least 1"),
    (["--rate", "fast"], "--rate 'fast': expected a tc rate"),
    (["--from-json", "/nonexistent/r.json"], "cannot read results /nonexistent/r.json"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys):
    assert cli.main([*argv, "--png", ""]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_without_root_one_line_and_exit_69(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["--only", "ds_zero3", "--png", ""]) == 69
    assert capsys.readouterr().err == ("compare_peers: cannot emulate a cluster here: needs root "
                                       "(network namespaces, veth, tc); run it as root\n")


# --- on the emulated cluster (slow) ---------------------------------------------------------------------

LOSS_TOL = 1e-4
MIN_TRAINING_EFFECT = 20 * LOSS_TOL  # as tests/test_peers.py: "within 1e-4" must not pass for a frozen side


@pytest.fixture(scope="module")
def network():
    from test_emulate_cluster import _network_problem
    problem = _network_problem()
    if problem:
        pytest.skip(f"emulated cluster: {problem}")


def bench(tmp_path, *argv, timeout=900) -> dict:
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *argv, "--out", str(out), "--png", str(tmp_path / "c.png")],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def needs_deepspeed():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install deepspeed: the `baselines` extra)")


@pytest.mark.slow
def test_parity_on_the_emulated_cluster(network, tmp_path):
    """2 x 2 ranks over 1 Gbit/s links, fp32, the parity model, accumulation 1 and 2, overlap on and off:
    every step's global mean loss of ours zero3 = DeepSpeed ZeRO-3's and ours hsdp = FSDP2 HSDP's."""
    needs_deepspeed()
    steps, warmup = 4, 1
    res = bench(tmp_path, "--only", "ds_zero3", "ours_zero3", "fsdp2_hsdp", "ours_hsdp", "--layouts", "2x2",
                "--accumulation", "1", "2", "--steps", str(steps), "--warmup", str(warmup), "--model", "tiny",
                "--overlap", "both", "--rate", "1gbit")
    rows = {(r["config"], r["accumulation"], r["overlap"]): r for r in res["rows"]}
    for acc in (1, 2):
        shape = compare_peers.bench_shape("tiny", "2x2", acc)
        untrained = peers.untrained_losses(peers.run_config(shape, "zero3"), shape, steps + warmup)
        for ours, theirs in (("ours_zero3", "ds_zero3"), ("ours_hsdp", "fsdp2_hsdp")):
            b = rows[(theirs, acc, None)]["losses"]
            for overlap in ("off", "on"):
                a = rows[(ours, acc, overlap)]["losses"]
                assert len(a) == len(b) == steps + warmup
                assert max(abs(x - y) for x, y in zip(a, b)) <= LOSS_TOL, (ours, overlap, acc, a, theirs, b)
                assert abs(a[0] - untrained[0]) <= LOSS_TOL
                moved = max(abs(x - y) for x, y in zip(a[1:], untrained[1:]))
                assert moved > MIN_TRAINING_EFFECT, f"{ours} acc {acc}: moved only {moved:.2e} from untrained"


@pytest.mark.slow
def test_smoke_two_configs_two_steps(network, tmp_path):
    needs_deepspeed()
    res = bench(tmp_path, "--only", "ds_zero3", "ours_zero_topo", "--layouts", "2x2", "--accumulation", "1",
                "--steps", "2", "--warmup", "1", "--model", "tiny", "--overlap", "on")
    assert res["meta"]["rate"] == "640mbit" and res["meta"]["model"]["parameters"] == 149_248
    assert [(r["config"], r["overlap"]) for r in res["rows"]] == [("ds_zero3", None), ("ours_zero_topo", "on")]
    for r in res["rows"]:
        assert r["ok"], r["error"]
        assert len(r["step_times_s"]) == 3 and r["median_step_s"] > 0 and r["peak_rss_mb"] > 0
        assert r["iface_bytes_per_step"] > 0 and r["launch_iface_bytes"] > r["iface_bytes_per_step"]
        assert all(n > 0 for n in r["iface_node_tx_per_step"])
    ds, ours = res["rows"]
    assert ds["time_vs_ds_zero3"] == 1.0 and ds["ledger_bytes_per_step"] is None
    assert ours["ledger_bytes_per_step"] > 0 and ours["iface_over_ledger"] > 1.0
    assert ours["info"]["factors"] == [2, 2, 4]
    assert (tmp_path / "c.png").exists()


@pytest.mark.slow
def test_three_tier_peers_at_their_best_train_alike_and_send_what_they_should(network, tmp_path):
    """2 x 2 x 2 on three tiers, the tiny model, accumulation 4, 1 timed step: FSDP2 HSDP at its default
    and with the cross-node reduction deferred (all-reduce or whole sync), fully_shard resharding to the
    node, ours zero_topo. The same losses on every side; the HSDP rows send their expected cross-node
    bytes (4 all-reduces, or 1) within headers; ours sends its ledger's bytes on every tier."""
    res = bench(tmp_path, "--only", "fsdp2_node", "fsdp2_hsdp", "fsdp2_hsdp_best", "fsdp2_hsdp_nosync", "ours_zero_topo",
                "--layouts", "2x2x2", "--accumulation", "4", "--steps", "1", "--warmup", "1", "--model", "tiny",
                "--overlap", "on")
    rows = {r["config"]: r for r in res["rows"]}
    assert all(r["ok"] and r["three_tier"] for r in rows.values()), [r["error"] for r in rows.values()]
    first = rows["fsdp2_hsdp"]["losses"]
    for r in rows.values():
        assert max(abs(x - y) for x, y in zip(r["losses"], first)) <= LOSS_TOL, r["config"]
    for key, once in (("fsdp2_hsdp", False), ("fsdp2_hsdp_best", True), ("fsdp2_hsdp_nosync", True)):
        r = rows[key]
        assert r["expected_inter_node_bytes_per_step"] == 8 * 149_248 * (1 if once else 4)
        assert 1.0 <= r["iface_bytes_per_step"] / r["expected_inter_node_bytes_per_step"] <= 1.15, key
    assert rows["fsdp2_node"]["info"] == {"mesh": [8], "reshard_after_forward": 4, "defer": "gradient"}
    assert rows["fsdp2_hsdp_best"]["info"] == {"mesh": [2, 4], "reshard_after_forward": False, "defer": "all_reduce"}
    ours = rows["ours_zero_topo"]
    assert ours["info"]["factors"] == [2, 4, 8]
    for tier, measured in ours["iface_over_ledger_by_tier"].items():
        assert 1.0 <= measured <= 1.2, (tier, measured)  # headers and ACKs on a step of ~1 MB per tier
    assert ours["speedup_vs_best_peer"] is not None


# --- issue 41: three tiers, the peers at their best -----------------------------------------------------

def three_tier_ranks():
    """2 x 2 x 2, 1 timed step: node uplinks sent 300 + 500 B (no bookkeeping); GPU links 1,000 / 0 / 800 / 0
    (their first ranks: 0, 2, 4, 6), loopbacks 4,000 each, bookkeeping 100 on GPU links and 10 on loopbacks."""
    ranks = []
    for r in range(8):
        tx = {0: 300, 4: 500}.get(r)
        f = rank_file(r, r % 4, [1.0, 2.0], tx=tx, bookkeeping_tx=0 if tx is not None else None,
                      ledger={"grad_reduce": 100})
        first_of_gpu = r % 2 == 0
        f["gpu_window"] = {"gpu_link_tx": {0: 1100, 2: 100, 4: 900, 6: 100}[r], "intra_gpu_tx": 4010} if first_of_gpu else None
        f["gpu_bookkeeping"] = {"gpu_link_tx": 100, "intra_gpu_tx": 10} if first_of_gpu else None
        f["ledger_tier_window"] = {"intra_gpu": 2000, "intra_node": 200, "inter_node": 100}
        ranks.append(f)
    return ranks


def test_three_tier_bytes_per_tier_against_the_ledger():
    row = report.summarize_ranks(three_tier_ranks(), None, 0, steps=1, warmup=1, world_size=8)
    assert row["iface_bytes_per_step"] == 800.0
    # GPU links sent 1,000 + 0 + 800 + 0; less the 800 that went on across nodes
    assert row["iface_tier_bytes_per_step"] == {"intra_gpu": 16000.0, "intra_node": 1000.0, "inter_node": 800.0}
    assert row["ledger_tier_bytes_per_step"] == {"intra_gpu": 16000.0, "intra_node": 1600.0, "inter_node": 800.0}
    assert row["iface_over_ledger_by_tier"] == {"intra_gpu": 1.0, "intra_node": 0.625, "inter_node": 1.0}
    two_tier = report.summarize_ranks(two_by_two_ranks(), None, 0, steps=3, warmup=1, world_size=4)
    assert "iface_tier_bytes_per_step" not in two_tier


def test_speed_is_over_the_fastest_peer_row_and_the_three_tier_goals():
    rows = [row("ds_zero3", "DeepSpeed ZeRO-3", 8.0, 400e6, layout="2x2x2"),
            row("fsdp2_hsdp_best", "FSDP2 HSDP best", 4.0, 100e6, layout="2x2x2"),
            row("fsdp2_hsdp", "FSDP2 HSDP", None, None, layout="2x2x2", ok=False, error="x"),
            row("ours_zero_topo", "ours zero_topo", 2.0, 50e6, layout="2x2x2", overlap="on"),
            row("ours_zero_topo_q", "ours zero_topo INT8w/INT4g", 2.5, 20e6, layout="2x2x2", overlap="on"),
            row("ours_hsdp", "ours hsdp", 1.0, 50e6, layout="2x2x2", accumulation=1, overlap="on")]
    for r in rows:
        r["peer"] = "ours" if r["config"].startswith("ours") else "fsdp2"
        r["three_tier"] = True
    report.add_ratios(rows)
    assert [r["speedup_vs_best_peer"] for r in rows] == [0.5, 1.0, None, 2.0, 1.6, None]
    assert rows[3]["best_peer"] == "fsdp2_hsdp_best" and rows[5]["best_peer"] is None  # no peer at accumulation 1
    verdicts = report.goals_three_tier(rows)
    assert [(v["measured"], v["met"]) for v in verdicts] == [("2.00x", True), ("1.60x", False)]
    text = report.markdown({"meta": {"rate": "640mbit", "gpu_rate": "640mbit", "steps": 3, "warmup": 1},
                            "rows": rows})
    assert "**2x2x2 (three tiers), accumulation 4**" in text and "speed / best peer" in text
    assert "- ours zero_topo INT8w/INT4g [overlap on]: at least 2x the fastest peer (fsdp2_hsdp_best): " \
           "measured 1.60x -> NOT met" in text


def test_the_expected_cross_node_bytes_of_the_hsdp_like_peers():
    shape = compare_peers.bench_shape("tiny", "2x2x2", 4)
    by = compare_peers.BY_KEY
    expected = {k: compare_peers.expected_inter_node_bytes(by[k], shape, 1000)
                for k in ("fsdp2_hsdp", "fsdp2_hsdp_best", "fsdp2_hsdp_nosync", "ds_mics", "ds_zero3", "ours_hsdp")}
    # 2 replicas: each of the 4 shard positions all-reduces 4,000 / 4 B between 2 ranks, 1,000 B each
    assert expected == {"fsdp2_hsdp": 4 * 8000, "fsdp2_hsdp_best": 8000, "fsdp2_hsdp_nosync": 8000,
                        "ds_mics": 8000, "ds_zero3": None, "ours_hsdp": None}


def test_the_peers_best_options_and_the_three_tier_launch():
    shape = compare_peers.bench_shape("tiny", "2x2x2", 4)
    by = compare_peers.BY_KEY
    assert by["fsdp2"].trainer_options(shape) == {"reshard_after_forward": True, "defer": "none"}
    assert by["fsdp2_node"].trainer_options(shape) == {"reshard_after_forward": 4, "defer": "gradient"}
    assert by["fsdp2_hsdp_best"].trainer_options(shape) == {"reshard_after_forward": False, "defer": "all_reduce"}
    assert by["ds_mics"].trainer_options(shape)["mics"] == 4 and by["ds_hpz"].trainer_options(shape)["hpz"] == 4
    assert by["ds_zero3"].trainer_options(shape) == {"hpz": 1, "quantized_weights": False,
                                                     "quantized_gradients": False, "mics": 0, "mics_hierarchical": True}
    assert by["ds_mics_flat"].trainer_options(shape)["mics_hierarchical"] is False
    zero = peers.deepspeed_config(peers.run_config(shape, "zero3"), shape,
                                  **by["ds_mics"].trainer_options(shape))["zero_optimization"]
    assert zero == {"stage": 3, "mics_shard_size": 4, "mics_hierarchical_params_gather": True}
    cfg = peers.run_config(shape, "zero_topo", by["ours_topo_148"].overrides)
    assert cfg.zero.resolved_factors == [1, 4, 8]
    args = compare_peers.parse_args(["--gpu-rate", "500mbit"])
    command = compare_peers.launch_command(args, by["ds_zero3"], "2x2x2", 4, "default", REPO)
    i = command.index("--gpus-per-node")
    assert command[i:i + 4] == ["--gpus-per-node", "2", "--gpu-rate", "500mbit"]
    assert "--gpus-per-node" not in compare_peers.launch_command(args, by["ds_zero3"], "2x4", 4, "default", REPO)


def test_mics_without_its_deepspeed_is_a_one_line_row(monkeypatch, tmp_path):
    monkeypatch.setattr(compare_peers, "DEEPSPEED_MICS_DIR", tmp_path / "absent")
    args = compare_peers.parse_args(["--only", "ds_mics"])
    got = compare_peers.run_one(args, compare_peers.BY_KEY["ds_mics"], "2x2x2", 4, "default")
    assert not got["ok"] and "MiCS was removed from DeepSpeed in 0.19.7" in got["error"]
    assert "\n" not in got["error"]


def test_a_failed_row_says_where_the_peer_met_the_error():
    tb = ('Traceback (most recent call last):\n  File "/b/bench/compare_peers.py", line 9, in main\n'
          '  File "/c/deepspeed-0.19.6/deepspeed/runtime/zero/mics.py", line 286, in _hierarchical_all_gather_params\n'
          '  File "/v/site-packages/deepspeed/comm/torch.py", line 389, in all_gather_coalesced\n'
          '  File "/p/lib/python3.11/contextlib.py", line 137, in __enter__\n'
          '  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 2876, in _coalescing_manager\n'
          'RuntimeError: Backend gloo does not implement startCoalescing\n')
    assert report.raised_at(tb) == "deepspeed/comm/torch.py:389 in all_gather_coalesced"
    ranks = [{"ok": False, "rank": 0, "error": "RuntimeError: Backend gloo does not implement startCoalescing",
              "traceback": tb}]
    row = report.summarize_ranks(ranks, None, 1, steps=1, warmup=1, world_size=8)
    assert row["error"] == ("rank 0: RuntimeError: Backend gloo does not implement startCoalescing "
                            "(at deepspeed/comm/torch.py:389 in all_gather_coalesced)")


def test_bf16_puts_every_side_in_its_16_bit_mode():
    shape = compare_peers.bench_shape("tiny", "2x2x2", 4)
    by = compare_peers.BY_KEY
    assert by["ours_zero_topo"].dtype_overrides("bf16") == ["bf16.enabled=true", "fp32_allreduce=false"]
    assert by["ours_zero_topo"].dtype_overrides("fp32") == [] and by["ds_zero3"].dtype_overrides("bf16") == []
    assert by["fsdp2_hsdp_best"].trainer_options(shape, "bf16")["bf16"] is True
    options = by["ds_zero3"].trainer_options(shape, "bf16")
    assert peers.deepspeed_config(peers.run_config(shape, "zero3"), shape, **options)["bf16"] == {"enabled": True}
    cfg = peers.run_config(shape, "zero_topo", by["ours_zero_topo"].dtype_overrides("bf16"))
    assert cfg.precision.precision == "bfloat16" and cfg.precision.fp32_allreduce is False
    assert compare_peers.expected_inter_node_bytes(by["fsdp2_hsdp_best"], shape, 1000, elem=2) == 4000
    args = compare_peers.parse_args(["--dtype", "bf16"])
    assert "--dtype bf16" in compare_peers.launch_command(args, by["ds_zero3"], "2x2x2", 4, "default", REPO)[-1]
