"""What the analytic models say one rehearsed rank does (megatron/analytic/: they import nothing from
the engine, so a rehearsal's counts are checked against an independent statement of the algorithm).

- ``collective_counts``: collectives per optimizer step by (op, group kind), from the comm model's
  ``step_collectives`` (a group of one rank issues none);
- ``rank_ledger``: the bytes the rank sends per step by (phase, tier), ``predict_ledger_per_rank``;
- ``memory_peaks``: each phase's peak for the rank, ``predict_peak_bytes`` (the device's terms on a
  GPU, the whole on a CPU, where host and device are one memory);
- ``extrapolate``: a quantity measured at two layer counts, carried to another along its slope.
"""
from __future__ import annotations

from megatron.analytic.comm_model import CommSpec, groups_of_kind, predict_ledger_per_rank, step_collectives
from megatron.analytic.memory_model import device_phase_bytes, predict_peak_bytes
from megatron.analytic.model_inputs import activations_from_config, autocast_copies_from_config, comm_spec_from_config
from megatron.topology.names import GROUP_KINDS


def spec_of(cfg, vocab: int, layout) -> CommSpec:
    return comm_spec_from_config(cfg, vocab, layout)


def group_labels(spec: CommSpec, rank: int) -> dict[str, tuple[str, int]]:
    """{kind: (label, size)} of the groups holding ``rank``: each named by the last kind (world last)
    with the same members, as the rehearsal names the engine's (zero3's weight group is the world)."""
    members = {kind: next(g for g in groups_of_kind(kind, spec) if rank in g) for kind in GROUP_KINDS}
    return {kind: (next(k for k in reversed(GROUP_KINDS) if members[k] == members[kind]), len(members[kind]))
            for kind in GROUP_KINDS}


def collective_counts(spec: CommSpec, rank: int) -> dict[str, int]:
    """{"op/kind": collectives rank ``rank`` issues per optimizer step} (a group of one issues none)."""
    labels = group_labels(spec, rank)
    counts: dict[str, int] = {}
    for col in step_collectives(spec):
        label, size = labels[col.group]
        if size > 1:
            key = f"{col.op}/{label}"
            counts[key] = counts.get(key, 0) + col.count
    return counts


def rank_ledger(spec: CommSpec, rank: int) -> dict[str, int]:
    """{"phase/tier": bytes rank ``rank`` sends per optimizer step} (non-zero entries)."""
    mine = predict_ledger_per_rank(spec)[rank]
    return {f"{phase}/{tier}": n for (phase, tier), n in mine.items() if n}


def memory_peaks(cfg, vocab: int, spec: CommSpec, device: str) -> dict[str, int]:
    """{phase: predicted peak bytes}: the device's terms on a GPU, the whole on a CPU; and
    ``step states``, the model states the step holds (zeropp's secondary copy included), which the
    engine holds exactly as counted (tests/test_ledger_equals_model.py::test_memory_equals_model)."""
    peaks = predict_peak_bytes(spec, activations_from_config(cfg, vocab), autocast_copies_from_config(cfg, vocab))
    out = {phase: device_phase_bytes(terms) if device == "cuda" else terms["total"] for phase, terms in peaks.items()}
    return {**out, "step states": peaks["step"].get("states", 0)}


def extrapolate(points: dict[int, float], to_layers: int) -> tuple[float, float]:
    """(slope per layer, value at ``to_layers``) through the two largest layer counts measured."""
    (l1, v1), (l2, v2) = sorted(points.items())[-2:]
    slope = (v2 - v1) / (l2 - l1)
    return slope, v2 + slope * (to_layers - l2)


def predictions(cfg, vocab: int, layout, rank: int, device: str) -> dict:
    """What the models say of rank ``rank`` of this run: collectives, ledger bytes, memory per phase."""
    spec = spec_of(cfg, vocab, layout)
    return {"collectives_per_step": collective_counts(spec, rank), "ledger_per_step": rank_ledger(spec, rank),
            "memory": memory_peaks(cfg, vocab, spec, device)}
