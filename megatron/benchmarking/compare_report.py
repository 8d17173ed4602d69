"""What the peer comparison (bench/compare_peers.py) makes of its launches: a row per launch from the
ranks' result files, the ratios to DeepSpeed ZeRO-3, the markdown table, the issue's goals and the
bar chart.

Pure functions of plain dicts (no torch, no processes), so tests/test_compare_peers.py checks them on
results written by hand. A row's fields are documented in docs/benchmarks.md ("The results JSON").
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

BASELINE = "ds_zero3"
MB = 1e6
# The issue's goals, at accumulation 4 on 2 x 4: zero_topo >= 2x DS ZeRO-3's speed, faster than DS
# hpZ, at most a quarter of ZeRO-3's inter-node bytes.
GOAL_LAYOUT, GOAL_ACCUMULATION = "2x4", 4
GOAL_SPEEDUP, GOAL_BYTES_FRACTION = 2.0, 0.25


class ReportError(ValueError):
    """An unreadable or malformed results file (one line)."""


def load(path: str | Path) -> dict:
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ReportError(f"cannot read results {path}: {err}") from None
    if not isinstance(results, dict) or "rows" not in results or "meta" not in results:
        raise ReportError(f"{path} is not a compare_peers results file (no 'meta' and 'rows')")
    return results


def one_line(text: str, limit: int = 160) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


# ------------------------------------------------------------------------------------ rows from ranks

def summarize_ranks(ranks: list[dict], tool: Optional[dict], exit_code: int, steps: int, warmup: int,
                    world_size: int) -> dict:
    """One launch's row fields from every rank's result file and the emulator's report.

    Step time: rank 0's timed steps (warmup excluded), median. Interface bytes per step: per node,
    (timed window - bookkeeping window) / steps, summed over nodes (what each node sent is what the
    other received). Ledger: every rank's inter-node bytes in the window, summed, / steps."""
    failed = [r for r in ranks if not r.get("ok")]
    if failed or len(ranks) != world_size or exit_code != 0:
        if failed:
            error = f"rank {failed[0]['rank']}: {failed[0]['error']}"
            where = raised_at(failed[0].get("traceback", ""))
            error += f" (at {where})" if where else ""
        else:
            missing = sorted(set(range(world_size)) - {r["rank"] for r in ranks})
            error = f"launch exited {exit_code}; no result from rank(s) {missing or 'none'}"
        return {"ok": False, "error": one_line(error)}
    by_rank = sorted(ranks, key=lambda r: r["rank"])
    first = by_rank[0]
    timed = first["step_times_s"][warmup:]
    nodes = [r for r in by_rank if r.get("interface_window") is not None]
    per_node = [(r["interface_window"]["tx_bytes"] - r["interface_bookkeeping"]["tx_bytes"]) / steps for r in nodes]
    bookkeeping = sum(r["interface_bookkeeping"]["tx_bytes"] for r in nodes) / steps
    row = {"ok": True, "error": None, "median_step_s": statistics.median(timed),
           "step_times_s": first["step_times_s"], "losses": first["losses"], "final_loss": first["losses"][-1],
           "grad_norms": first["grad_norms"], "info": first.get("info", {}),
           "iface_bytes_per_step": sum(per_node) if nodes else None,
           "iface_node_tx_per_step": per_node if nodes else None,
           "bookkeeping_bytes_per_step": bookkeeping if nodes else None,
           "peak_rss_mb": max(r["maxrss_kb"] for r in by_rank) / 1024,
           "launch_iface_bytes": tool.get("inter_node_tx_bytes") if tool else None,
           "rate_bits_per_s": tool.get("rate_bits_per_s") if tool else None}
    ledgers = [r["ledger_inter_node_window"] for r in by_rank if r.get("ledger_inter_node_window") is not None]
    if ledgers:
        phases = {p: sum(ledger.get(p, 0) for ledger in ledgers) / steps for p in ledgers[0]}
        row["ledger_phases_per_step"] = {p: v for p, v in phases.items() if v}
        row["ledger_bytes_per_step"] = sum(phases.values())
    else:
        row["ledger_phases_per_step"], row["ledger_bytes_per_step"] = None, None
    row["iface_over_ledger"] = ratio(row["iface_bytes_per_step"], row["ledger_bytes_per_step"])
    row.update(tier_fields(by_rank, steps, row["iface_bytes_per_step"]))
    row["profiled"] = profiled_summary([r.get("breakdown") for r in by_rank])
    # The time the busiest node link needs for one step's bytes: near the step time means link-bound.
    rate = row["rate_bits_per_s"]
    row["link_s_per_step"] = max(per_node) * 8 / rate if nodes and rate else None
    return row


TIERS = ("intra_gpu", "intra_node", "inter_node")


def tier_fields(by_rank: list[dict], steps: int, inter_node: Optional[float]) -> dict:
    """Three tiers: bytes per step per tier from the GPUs' counters (timed window less bookkeeping, summed
    over GPUs) -- intra_gpu from the loopbacks, intra_node = the GPU links' less the inter-node bytes --
    and, for ours, the ledger's per tier and the ratio of each. Empty on two tiers (no GPU counters)."""
    gpus = [r for r in by_rank if r.get("gpu_window") is not None]
    if not gpus or inter_node is None:
        return {}
    sent = {k: sum(r["gpu_window"][k] - r["gpu_bookkeeping"][k] for r in gpus) / steps
            for k in ("gpu_link_tx", "intra_gpu_tx")}
    iface = {"intra_gpu": sent["intra_gpu_tx"], "intra_node": sent["gpu_link_tx"] - inter_node,
             "inter_node": inter_node}
    out = {"iface_tier_bytes_per_step": iface, "ledger_tier_bytes_per_step": None, "iface_over_ledger_by_tier": None}
    ledgers = [r["ledger_tier_window"] for r in by_rank if r.get("ledger_tier_window") is not None]
    if ledgers:
        ledger = {t: sum(w.get(t, 0) for w in ledgers) / steps for t in TIERS}
        out["ledger_tier_bytes_per_step"] = ledger
        out["iface_over_ledger_by_tier"] = {t: ratio(iface[t], ledger[t]) for t in TIERS}
    return out


def raised_at(traceback_text: str) -> Optional[str]:
    """The innermost frame of a traceback outside torch and the standard library, as `pkg/file.py:LINE
    in FUNC` from the package's folder down: where a peer's own code met the error (the evidence of a
    row that cannot run)."""
    import re
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', traceback_text or "")
    for path, line, func in reversed(frames):
        if "/torch/" in path or "/lib/python3" in path and "site-packages" not in path:
            continue
        for package in ("deepspeed/", "megatron/", "bench/"):
            if package in path:
                return f"{package}{path.split(package, 1)[1]}:{line} in {func}"
        return f"{path}:{line} in {func}"
    return None


def profiled_summary(breakdowns: list[Optional[dict]]) -> Optional[dict]:
    """The profiled step of every rank (--breakdown), in seconds: the step's wall time, the compute
    (busy time less exposed communication: every op that is not a collective's) and the exposed
    communication, each as the mean over ranks and its largest; None unless every rank profiled."""
    if not breakdowns or any(b is None for b in breakdowns):
        return None
    figures = {"step_s": [b["step_ms"] / 1e3 for b in breakdowns],
               "compute_s": [(b["busy_ms"] - b["exposed_comm_ms"]) / 1e3 for b in breakdowns],
               "exposed_comm_s": [b["exposed_comm_ms"] / 1e3 for b in breakdowns]}
    return {name: {"mean": statistics.fmean(values), "max": max(values)} for name, values in figures.items()}


def ratio(a, b) -> Optional[float]:
    return a / b if a is not None and b else None


def add_ratios(rows: list[dict]) -> None:
    """Each row's step time and inter-node bytes over DS ZeRO-3's of the same layout and accumulation,
    and its speed-up over the fastest peer row (any peer configuration, default or best) there."""
    base = {(r["layout"], r["accumulation"]): r for r in rows if r["config"] == BASELINE and r["ok"]}
    fastest: dict = {}
    for r in rows:
        key = (r["layout"], r["accumulation"])
        if r["ok"] and r["peer"] != "ours" and (key not in fastest or r["median_step_s"] < fastest[key]["median_step_s"]):
            fastest[key] = r
    for row in rows:
        key = (row["layout"], row["accumulation"])
        ref = base.get(key)
        ok = row["ok"] and ref is not None
        row["time_vs_ds_zero3"] = ratio(row["median_step_s"], ref["median_step_s"]) if ok else None
        row["bytes_vs_ds_zero3"] = ratio(row["iface_bytes_per_step"], ref["iface_bytes_per_step"]) if ok else None
        best = fastest.get(key)
        row["best_peer"] = best["config"] if best else None
        row["speedup_vs_best_peer"] = ratio(best["median_step_s"], row["median_step_s"]) if row["ok"] and best else None


def progress_line(row: dict) -> str:
    name = f"{row['label']}{overlap_tag(row)} {row['layout']} acc {row['accumulation']}"
    if not row["ok"]:
        return f"{name}: FAILED ({row['launch_s']:.0f} s): {row['error']}"
    vs = f", {row['time_vs_ds_zero3']:.2f}x DS ZeRO-3's time" if row.get("time_vs_ds_zero3") else ""
    if row.get("speedup_vs_best_peer"):
        vs += f", {row['speedup_vs_best_peer']:.2f}x the best peer's speed ({row['best_peer']})"
    iface = row["iface_bytes_per_step"]
    return (f"{name}: median step {row['median_step_s']:.3f} s{vs}, loss {row['final_loss']:.4f}, "
            f"{fmt_mb(iface)} MB/step inter-node, peak {row['peak_rss_mb']:.0f} MB/rank ({row['launch_s']:.0f} s)")


def overlap_tag(row: dict) -> str:
    return f" [overlap {row['overlap']}]" if row.get("overlap") not in (None, "default") else ""


# ------------------------------------------------------------------------------------------ markdown

def fmt_mb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MB:.2f}"


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def groups(rows: list[dict]) -> list[tuple[str, int]]:
    """(layout, accumulation) in the order the rows ran."""
    seen = []
    for row in rows:
        if (row["layout"], row["accumulation"]) not in seen:
            seen.append((row["layout"], row["accumulation"]))
    return seen


COLUMNS = ("configuration", "overlap", "median step (s)", "time / DS ZeRO-3", "loss after K", "inter-node MB/step",
           "ledger MB/step", "interfaces / ledger", "link busy", "peak RSS MB/rank")


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        overlap = r.get("overlap") or "-"
        if overlap == "default":
            overlap = "-"
        if not r["ok"]:
            out.append([r["label"], overlap, f"failed: {r['error']}"] + [""] * (len(COLUMNS) - 3))
            continue
        busy = ratio(r.get("link_s_per_step"), r["median_step_s"])
        out.append([r["label"], overlap, f"{r['median_step_s']:.3f}", fmt(r.get("time_vs_ds_zero3"), ".2f"),
                    f"{r['final_loss']:.4f}", fmt_mb(r["iface_bytes_per_step"]), fmt_mb(r["ledger_bytes_per_step"]),
                    fmt(r["iface_over_ledger"], ".2f"), "-" if busy is None else f"{100 * busy:.0f}%",
                    f"{r['peak_rss_mb']:.0f}"])
    return out


THREE_TIER_COLUMNS = ("configuration", "overlap", "median step (s)", "speed / best peer", "time / DS ZeRO-3",
                      "loss after K", "inter-node MB/step", "expected", "in-node MB/step", "pair MB/step",
                      "interfaces / ledger (pair, in-node, inter-node)", "peak RSS MB/rank")


def three_tier_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        overlap = r.get("overlap") if r.get("overlap") not in (None, "default") else "-"
        label = r["label"] + (" *" if r.get("best") else "")
        if not r["ok"]:
            out.append([label, overlap, f"failed: {r['error']}"] + [""] * (len(THREE_TIER_COLUMNS) - 3))
            continue
        tiers = r.get("iface_tier_bytes_per_step") or {}
        vs = r.get("iface_over_ledger_by_tier")
        out.append([label, overlap, f"{r['median_step_s']:.3f}", fmt(r.get("speedup_vs_best_peer"), ".2f"),
                    fmt(r.get("time_vs_ds_zero3"), ".2f"), f"{r['final_loss']:.4f}", fmt_mb(r["iface_bytes_per_step"]),
                    fmt_mb(r.get("expected_inter_node_bytes_per_step") if r["peer"] != "ours"
                           else r.get("ledger_bytes_per_step")),
                    fmt_mb(tiers.get("intra_node")), fmt_mb(tiers.get("intra_gpu")),
                    "-" if not vs else ", ".join(fmt(vs[t], ".2f") for t in TIERS), f"{r['peak_rss_mb']:.0f}"])
    return out


def markdown(results: dict) -> str:
    meta, rows = results["meta"], results["rows"]
    gpu_rate = f", {meta['gpu_rate']} per GPU link on three tiers" if meta.get("gpu_rate") else ""
    dtype = f"; {meta['dtype']}" if meta.get("dtype") else ""  # the two-tier history did not record it (fp32)
    lines = [f"Rate {meta['rate']} per node link{gpu_rate}{dtype}; {meta['steps']} timed steps after {meta['warmup']} "
             f"warmup; loss after K = {meta['steps'] + meta['warmup']} steps."]
    for layout, accumulation in groups(rows):
        group = [r for r in rows if (r["layout"], r["accumulation"]) == (layout, accumulation)]
        if any(r.get("three_tier") for r in group):
            lines += ["", f"**{layout} (three tiers), accumulation {accumulation}** (* a peer as an expert runs it; "
                      "expected: the bytes its algorithm should send across nodes, the ledger's for ours)", "",
                      "| " + " | ".join(THREE_TIER_COLUMNS) + " |", "|" + "---|" * len(THREE_TIER_COLUMNS)]
            lines += ["| " + " | ".join(cells) + " |" for cells in three_tier_rows(group)]
            continue
        lines += ["", f"**{layout}, accumulation {accumulation}**", "",
                  "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(group)]
    profiled = [r for r in rows if r.get("ok") and r.get("profiled")]
    if profiled:
        lines += ["", "One more step per rank under the profiler (--breakdown), s: mean over ranks (largest)", "",
                  "| layout | A | configuration | overlap | step | compute | exposed communication | exposed share |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in profiled:
            p = r["profiled"]
            overlap = r.get("overlap") if r.get("overlap") not in (None, "default") else "-"
            cells = [r["layout"], str(r["accumulation"]), r["label"], overlap]
            cells += [f"{p[k]['mean']:.3f} ({p[k]['max']:.3f})" for k in ("step_s", "compute_s", "exposed_comm_s")]
            cells.append(fmt(ratio(100 * p["exposed_comm_s"]["mean"], p["step_s"]["mean"]), ".0f") + "%")
            lines.append("| " + " | ".join(cells) + " |")
    verdicts = goals_three_tier(rows)
    if verdicts:
        lines += ["", f"Goals (accumulation {GOAL_ACCUMULATION} on {THREE_TIER_GOAL_LAYOUT}, against the fastest peer row):", ""]
        lines += [f"- {v['row']}: {v['goal']}: measured {v['measured']} -> {'met' if v['met'] else 'NOT met'}"
                  for v in verdicts]
    verdicts = goals(rows)
    if verdicts:
        lines += ["", f"Goals (accumulation {GOAL_ACCUMULATION} on {GOAL_LAYOUT}):", ""]
        lines += [f"- {v['row']}: {v['goal']}: measured {v['measured']} -> {'met' if v['met'] else 'NOT met'}"
                  for v in verdicts]
    return "\n".join(lines)


THREE_TIER_GOAL_LAYOUT = "2x2x2"
THREE_TIER_GOALS = {"ours_zero_topo": 1.3, "ours_zero_topo_q": 2.0}  # speed-up over the fastest peer (issue 41)


def goals_three_tier(rows: list[dict]) -> list[dict]:
    """Issue 41's speed goals on the three-tier cluster at accumulation 4: zero_topo >= 1.3x and zero_topo
    INT8/INT4 >= 2x the fastest peer configuration (default or best) of the same run."""
    out = []
    for r in rows:
        want = THREE_TIER_GOALS.get(r["config"])
        if (want is None or not r["ok"] or r.get("speedup_vs_best_peer") is None
                or (r["layout"], r["accumulation"]) != (THREE_TIER_GOAL_LAYOUT, GOAL_ACCUMULATION)):
            continue
        out.append({"row": r["label"] + overlap_tag(r), "goal": f"at least {want:g}x the fastest peer ({r['best_peer']})",
                    "measured": f"{r['speedup_vs_best_peer']:.2f}x", "met": r["speedup_vs_best_peer"] >= want})
    return out


def goals(rows: list[dict]) -> list[dict]:
    """The issue's three goals for every zero_topo row at accumulation 4 on 2 x 4 (each overlap and
    quantization variant); empty when that group or its DeepSpeed rows did not run."""
    group = [r for r in rows if r["ok"] and (r["layout"], r["accumulation"]) == (GOAL_LAYOUT, GOAL_ACCUMULATION)]
    ds = next((r for r in group if r["config"] == BASELINE), None)
    hpz = next((r for r in group if r["config"] == "ds_hpz"), None)
    out = []
    for r in group:
        if not r["config"].startswith("ours_zero_topo") or ds is None:
            continue
        name = r["label"] + overlap_tag(r)
        speedup = ds["median_step_s"] / r["median_step_s"]
        out.append({"row": name, "goal": f"at least {GOAL_SPEEDUP:g}x DS ZeRO-3's speed",
                    "measured": f"{speedup:.2f}x", "met": speedup >= GOAL_SPEEDUP})
        if hpz is not None:
            out.append({"row": name, "goal": "faster than DS hpZ",
                        "measured": f"{r['median_step_s']:.3f} s vs {hpz['median_step_s']:.3f} s",
                        "met": r["median_step_s"] < hpz["median_step_s"]})
        fraction = ratio(r["iface_bytes_per_step"], ds["iface_bytes_per_step"])
        if fraction is not None:
            out.append({"row": name, "goal": f"at most {GOAL_BYTES_FRACTION:g} of DS ZeRO-3's inter-node bytes",
                        "measured": f"{fraction:.3f}", "met": fraction <= GOAL_BYTES_FRACTION})
    return out


# ------------------------------------------------------------------------------------------- chart

def bar_chart(results: dict, path: str | Path) -> None:
    """Step time / DS ZeRO-3's per configuration, one cluster of bars per layout x accumulation; for a
    three-tier run, step time / the fastest peer row's (issue 41's yardstick)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    three = any(r.get("three_tier") for r in rows)

    def height(row):
        if not three:
            return row.get("time_vs_ds_zero3")
        return 1 / row["speedup_vs_best_peer"] if row.get("speedup_vs_best_peer") else None

    series = []  # (config, overlap) in the order they ran
    for r in rows:
        key = (r["config"], r.get("overlap"))
        if key not in series:
            series.append(key)
    clusters = groups(rows)
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(14, 7))
    cmap = plt.get_cmap("tab20")
    for i, (config, overlap) in enumerate(series):
        xs, heights = [], []
        for j, (layout, accumulation) in enumerate(clusters):
            row = next((r for r in rows if (r["config"], r.get("overlap"), r["layout"], r["accumulation"])
                        == (config, overlap, layout, accumulation)), None)
            if row is not None and height(row) is not None:
                xs.append(j + (i - (len(series) - 1) / 2) * width)
                heights.append(height(row))
        label = next(r["label"] for r in rows if r["config"] == config) + overlap_tag({"overlap": overlap})
        ax.bar(xs, heights, width=width, label=label, color=cmap(i % 20))
    ax.axhline(1.0, color="black", linewidth=0.8)
    if three:
        for want, style in zip(sorted(set(THREE_TIER_GOALS.values())), ("--", ":")):
            ax.axhline(1 / want, color="gray", linewidth=0.8, linestyle=style, label=f"{want:g}x faster than the best peer")
    else:
        ax.axhline(1 / GOAL_SPEEDUP, color="gray", linewidth=0.8, linestyle="--",
                   label=f"{GOAL_SPEEDUP:g}x faster than DS ZeRO-3")
    ax.set_xticks(range(len(clusters)))
    ax.set_xticklabels([f"{layout}, accumulation {acc}" for layout, acc in clusters])
    if three:
        ax.set_ylabel("median step time / the fastest peer configuration's (lower is faster)")
        ax.set_title(f"Emulated 2 nodes x 2 GPUs x 2 ranks, {results['meta']['rate']} per node link, "
                     f"{results['meta'].get('gpu_rate')} per GPU link")
    else:
        ax.set_ylabel("median step time / DeepSpeed ZeRO-3's (lower is faster)")
        ax.set_title(f"Emulated 2-node cluster, {results['meta']['rate']} per node link")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
