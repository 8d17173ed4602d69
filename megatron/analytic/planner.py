"""Choose the shard layout: every nested (w, g, os) (and ZeRO++), with quantization bits per phase,
scored by the time model under a memory budget (docs/time_model.md, "The planner").

A candidate is a ``ShardLayout`` (made by ``ShardLayout.resolve``, so the nesting rule is the
layout's, never restated here), a ``QuantSpec`` and whether activations are checkpointed. For each
the comm model gives the bytes per tier, the memory model the peak per device (model states,
buffers in flight, activations), the time model the step time; the best is the feasible one with
the shortest step (ties: fewer inter-node bytes, then the larger factors). ``tools/plan.py`` prints
the whole table; ``zero_optimization.plan: auto`` runs the same search at start-up
(``planned_config``) over the config's quantization and activation checkpointing (and, with
``plan_quantize``, the quantization choices below) and logs why it chose what it chose.

A candidate whose peak does not fit is never chosen and a table lists those that fit first, so
``search`` times only the candidates that fit (the memory model is cheap, the time model is not);
``exhaustive=True`` times every one, as the search did before, and tests/test_planner_exact.py
holds the two to the same choice and rows. ``preset_rows`` scores the named presets a user
compares the choice with (configs/zero3.yml, zeropp, hsdp, zero_topo, zero_topo_paper; each also
quantized) on the same inputs, whether or not the search ranks them high.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron.topology.layout import CUSTOM, PRESETS, ZEROPP, ShardLayout, _preset_factors, display_name
from megatron.topology.errors import TopologyError
from megatron.analytic.comm_model import CommSpec, step_collectives, transformer_block_units
from megatron.config.quant_spec import QuantSpec
from megatron.analytic.memory_model import HOST_TERMS, device_phase_bytes, predict_peak_bytes
from megatron.analytic.hardware import Hardware
from megatron.analytic.time_model import StepTime, StepWork, collectives_bytes_by_tier, step_time

GB = 1e9
# Quantization choices the planner tries (when asked to): none, the step boundary only (INT4
# cross-node gradients, INT8 refresh), and ZeRO++'s qwZ + qgZ (INT8 gathers, INT4 reductions,
# and with them the boundary hops).
QUANT_CHOICES = {
    "none": dict(),
    "boundary": dict(cross_node_grad_bits=4, refresh_bits=8),
    "int8w-int4g": dict(quantized_weights=True, quantized_gradients=True),
}


@dataclass(frozen=True)
class PlanInputs:
    """Everything but the layout: the model, the run's batch and precision, the hardware."""
    unit_numels: tuple
    work: StepWork
    micro_batches: int
    compute_bytes: int
    fp32_allreduce: bool
    activation_bytes: dict
    """{checkpointed: one micro-batch's activation bytes, at the start of backward and in a block's
    backward (``model.sizes.BackwardActivations``, or one figure for both)}: the choices of activation
    checkpointing."""
    hardware: Hardware
    memory_budget: float
    reductions_in_flight: int = 2
    reduce_bucket_elements: int = 500_000_000
    quant_block: int = 256
    autocast_copies: dict = field(default_factory=dict)
    """{checkpointed: bytes of autocast's weight copies}: counted by the memory model on one process only."""


@dataclass(frozen=True)
class Candidate:
    layout: ShardLayout
    quant_name: str
    quant: QuantSpec
    checkpointed: bool
    cross_node_reduction: str = "reduce_scatter"
    """The step boundary's cross hop: the search scores ours; the paper's zero_topo (all_reduce) is a preset row."""

    @property
    def key(self) -> tuple:
        """What the models read of a candidate (not the quantization's name): equal keys, equal rows."""
        return (self.layout.tiers, self.layout.factors, self.layout.hpz, self.quant, self.checkpointed,
                self.cross_node_reduction)


@dataclass(frozen=True)
class PlanRow:
    candidate: Candidate
    peak_bytes: float
    """The largest phase peak of one device, host-side staging left out (memory_model.device_peak_bytes)."""
    bytes_per_tier: Optional[dict]
    """{tier: bytes one rank sends per step} (all ranks' ledger / N); None where not timed (``time``)."""
    time: Optional[StepTime]
    """None for a candidate that does not fit and was not asked for (``search``: exhaustive)."""
    feasible: bool
    peak_terms: dict = field(default_factory=dict, compare=False)
    """{term: bytes} of the phase that sets ``peak_bytes`` (device terms; "phase": its name): why it fits or not."""

    @property
    def name(self) -> str:
        return _layout_name(self.candidate.layout)

    @property
    def factors(self) -> tuple:
        return self.candidate.layout.factors.as_tuple()


@dataclass(frozen=True)
class Plan:
    rows: tuple
    best: Optional[PlanRow]
    budget: float
    """The memory budget per device the rows were checked against."""
    source: str = ""
    """Where the time model's figures came from (``Hardware.source``: a probe file or a preset)."""

    def reason(self) -> str:
        """One paragraph: what was chosen and why (the runner-up, the budget, the figures' source)."""
        if self.best is None:
            smallest = min(self.rows, key=lambda r: r.peak_bytes)
            return (f"no layout fits {self.budget / GB:.3g} GB per device: the smallest peak is "
                    f"{smallest.peak_bytes / GB:.3g} GB ({describe(smallest)})")
        best = self.best
        feasible = [r for r in self.rows if r.feasible]
        others = sorted((r for r in feasible if r is not best), key=_score)
        runner = f"; next {describe(others[0])} at {others[0].time.total_s:.4g} s" if others else ""
        return (f"{describe(best)}: predicted {best.time.total_s:.4g} s per step, "
                f"{best.time.tflops_per_device:.3g} TFLOPS per device, peak {best.peak_bytes / GB:.3g} GB of "
                f"{self.budget / GB:.3g} GB; {len(feasible)} of {len(self.rows)} candidates fit{runner}; "
                f"figures: {self.source}")


def describe(row: PlanRow) -> str:
    c = row.candidate
    w, g, os_ = row.factors
    what = "zeropp (hpZ)" if c.layout.hpz else f"{display_name(row.name)} (w, g, os) = ({w}, {g}, {os_})"
    if c.cross_node_reduction != "reduce_scatter":
        what += f", cross hop {c.cross_node_reduction}"
    bits = c.quant.phase_bits
    quant = "unquantized" if not c.quant.enabled else "bits " + "/".join(
        str(bits[k]) for k in ("weight_gather_bits", "grad_reduce_bits", "cross_node_grad_bits", "refresh_bits"))
    return f"{what}, {quant}, activation checkpointing {'on' if c.checkpointed else 'off'}"


def _layout_name(layout: ShardLayout) -> str:
    """A named preset's name when the factors are one (zero_topo, hsdp, stage3...), else custom."""
    if layout.preset != CUSTOM:
        return layout.preset
    for preset in PRESETS:
        if preset != ZEROPP and _preset_factors(preset, layout.tiers) == layout.factors.as_tuple():
            return preset
    return CUSTOM


def nested_factors(world_size: int) -> list:
    """Every (w, g, os) of divisors of N that ``ShardLayout`` accepts (w | g | os | N)."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [(w, g, os_) for os_ in divisors for g in divisors if os_ % g == 0 for w in divisors if g % w == 0]


def candidate_layouts(tiers: Sequence[int], include_zeropp: bool = True) -> list:
    layouts = []
    for factors in nested_factors(math.prod(tiers)):
        try:
            layouts.append(ShardLayout.resolve(tiers, shard_factors=factors))
        except TopologyError:
            continue  # the layout's own rule said no
    if include_zeropp:
        layouts.append(ShardLayout.resolve(tiers, preset=ZEROPP))
    return layouts


def quant_spec(name: str, block: int) -> QuantSpec:
    return QuantSpec.from_settings(block_size=block, **QUANT_CHOICES[name])


def comm_spec(candidate: Candidate, inputs: PlanInputs) -> CommSpec:
    units = inputs.unit_numels
    return CommSpec(units, candidate.layout,
                    micro_batches=inputs.micro_batches, compute_bytes=inputs.compute_bytes,
                    fp32_allreduce=inputs.fp32_allreduce, quant=candidate.quant,
                    checkpointed_units=transformer_block_units(len(units)) if candidate.checkpointed else frozenset(),
                    reductions_in_flight=inputs.reductions_in_flight,
                    reduce_bucket_elements=inputs.reduce_bucket_elements,
                    cross_node_reduction=candidate.cross_node_reduction)


def evaluate(candidate: Candidate, inputs: PlanInputs, timed: bool = True) -> PlanRow:
    """The candidate's memory peak, and unless ``timed`` is false its bytes per tier and step time."""
    spec = comm_spec(candidate, inputs)
    row = _memory_row(candidate, spec, inputs)
    return _timed_row(row, spec, inputs) if timed else row


def _memory_row(candidate: Candidate, spec: CommSpec, inputs: PlanInputs) -> PlanRow:
    peaks = predict_peak_bytes(spec, inputs.activation_bytes[candidate.checkpointed],
                               inputs.autocast_copies.get(candidate.checkpointed, 0))
    phase = max(peaks, key=lambda name: device_phase_bytes(peaks[name]))  # device_peak_bytes, and which
    peak = device_phase_bytes(peaks[phase])
    terms = {"phase": phase, **{t: b for t, b in peaks[phase].items() if t not in HOST_TERMS and t != "total"}}
    return PlanRow(candidate, float(peak), None, None, peak <= inputs.memory_budget, terms)


def _timed_row(row: PlanRow, spec: CommSpec, inputs: PlanInputs) -> PlanRow:
    collectives = step_collectives(spec)  # once for both models: building them is half the cost
    per_tier = {tier: nbytes / spec.world_size for tier, nbytes in collectives_bytes_by_tier(spec, collectives).items()}
    return dataclasses.replace(row, bytes_per_tier=per_tier,
                               time=step_time(spec, inputs.hardware, inputs.work, collectives))


def _score(row: PlanRow) -> tuple:
    return (row.time.total_s, row.bytes_per_tier.get("inter_node", 0.0), tuple(-f for f in row.factors))


def choose(rows: Sequence[PlanRow]) -> Optional[PlanRow]:
    """The row the search picks among timed ``rows``: the fastest that fits (ties: fewer inter-node
    bytes, then the larger factors); None when none fits. Also for a list the caller chose (the
    layouts a benchmark measured)."""
    feasible = [r for r in rows if r.feasible]
    return min(feasible, key=_score) if feasible else None


def search(tiers: Sequence[int], inputs: PlanInputs, quant_names: Sequence[str] = ("none",),
           checkpointing: Sequence[bool] = (True,), include_zeropp: bool = True,
           quants: Optional[dict] = None, exhaustive: bool = False) -> Plan:
    """Every candidate on ``tiers``, scored; ``quants`` ({name: QuantSpec}) overrides ``quant_names``.
    Only the candidates that fit are timed unless ``exhaustive`` (the others: ``time`` None; the
    choice cannot be one of them, and ``ranked`` times them when a table reaches them)."""
    quants = quants or {name: quant_spec(name, inputs.quant_block) for name in quant_names}
    rows = []
    for layout in candidate_layouts(tiers, include_zeropp):
        for qname, quant in quants.items():
            for checkpointed in checkpointing:
                candidate = Candidate(layout, qname, quant, checkpointed)
                spec = comm_spec(candidate, inputs)
                row = _memory_row(candidate, spec, inputs)
                rows.append(_timed_row(row, spec, inputs) if row.feasible or exhaustive else row)
    return Plan(tuple(rows), choose(rows), inputs.memory_budget, inputs.hardware.source)


def ranked(plan: Plan, inputs: PlanInputs, top: int = 0) -> list:
    """The table's rows: those that fit, fastest first, then those that do not, fastest first (the
    first ``top``; 0: all). Rows the search left untimed are timed here when the table reaches them."""
    fit = sorted((r for r in plan.rows if r.feasible), key=lambda r: r.time.total_s)
    if top and len(fit) >= top:
        return fit[:top]
    rest = [r if r.time is not None else evaluate(r.candidate, inputs) for r in plan.rows if not r.feasible]
    out = fit + sorted(rest, key=lambda r: r.time.total_s)
    return out[:top] if top else out


# -- the named presets beside the choice ---------------------------------------------------------

# (label, configs/<file>.yml, overrides): the presets users compare a plan with (bench/presets.py's
# names), each as shipped and with the other precision: the 16-bit ones also with qwZ + qgZ (INT8
# weight gathers, INT4 gradient hops), the paper's zero_topo (shipped quantized) also in 16 bits.
QUANTIZED = ("zero_optimization.zero_quantized_weights=true", "zero_optimization.zero_quantized_gradients=true")
SIXTEEN_BIT = ("zero_optimization.zero_quantized_weights=false", "zero_optimization.zero_quantized_gradients=false")
PRESET_CONFIGS = (
    ("zero3", "zero3", ()), ("zero3 int8/int4", "zero3", QUANTIZED),
    ("zeropp", "zeropp", ()), ("zeropp int8/int4", "zeropp", QUANTIZED),
    ("hsdp", "hsdp", ()), ("hsdp int8/int4", "hsdp", QUANTIZED),
    ("zero_topo", "zero_topo", ()), ("zero_topo int8/int4", "zero_topo", QUANTIZED),
    ("zero_topo_paper 16-bit", "zero_topo_paper", SIXTEEN_BIT), ("zero_topo_paper", "zero_topo_paper", ()),
)


def preset_candidate(cfg, checkpointed: bool) -> Candidate:
    """The candidate a loaded config runs as (its layout, quantization and cross hop)."""
    return Candidate(ShardLayout.from_config(cfg), "config", QuantSpec.from_config(cfg.zero), checkpointed,
                     cfg.zero.cross_node_reduction)


def preset_rows(plan: Plan, candidates: dict, inputs: PlanInputs) -> dict:
    """{label: the row of each preset candidate}: the search's own row where it holds the same
    candidate (so a table can mark it), else one evaluated here; ``candidates`` values that are not
    candidates (a preset the layout refuses: its error's text) pass through."""
    searched = {r.candidate.key: r for r in plan.rows}
    out = {}
    for label, cand in candidates.items():
        if not isinstance(cand, Candidate):
            out[label] = cand
            continue
        row = searched.get(cand.key)
        out[label] = row if row is not None and row.time is not None else evaluate(cand, inputs)
    return out


def why_not(row: PlanRow, budget: float) -> str:
    """Why a row does not fit, in one phrase: the phase over budget and its largest terms."""
    terms = sorted(((b, t) for t, b in row.peak_terms.items() if t != "phase" and b), reverse=True)[:3]
    return (f"{row.peak_terms.get('phase', 'peak')} {row.peak_bytes / GB:.1f} GB > {budget / GB:.3g} GB: "
            + ", ".join(f"{t} {b / GB:.1f}" for b, t in terms))


# -- zero_optimization.plan: auto ------------------------------------------------------------------

def inputs_from_config(cfg, padded_vocab: int, hardware: Hardware, memory_budget: Optional[float] = None) -> PlanInputs:
    """The plan's inputs for the configured model, batch and precision (budget default: the
    ``plan_memory_per_device_gb`` key, else the device's memory)."""
    from megatron.model.sizes import unit_parameter_counts
    from megatron.analytic.model_inputs import (activations_from_config, autocast_copies_from_config, compute_bytes_of,
                                                step_work_from_config)
    compute_bytes = compute_bytes_of(cfg)
    acts = {ckpt: activations_from_config(cfg, padded_vocab, checkpoint_activations=ckpt) for ckpt in (False, True)}
    copies = {ckpt: autocast_copies_from_config(cfg, padded_vocab, checkpoint_activations=ckpt) for ckpt in (False, True)}
    if memory_budget is None:
        gb = cfg.zero.plan_memory_per_device_gb
        memory_budget = gb * GB if gb else hardware.device.memory_bytes
    return PlanInputs(tuple(unit_parameter_counts(cfg.model, padded_vocab)), step_work_from_config(cfg, padded_vocab),
                      cfg.training.gradient_accumulation_steps or 1, compute_bytes, bool(cfg.precision.fp32_allreduce),
                      acts, hardware, float(memory_budget),
                      int(cfg.zero.reduce_buckets_in_flight) if cfg.zero.overlap_comm else 0,
                      int(cfg.zero.reduce_bucket_size), int(cfg.zero.quantization_block_size), copies)


def plan_for_config(cfg, padded_vocab: int, world_size: Optional[int] = None) -> Plan:
    """The search ``plan: auto`` runs: the config's layout tiers, figures (``hardware_from_config``:
    the probe file when given) and activation checkpointing; its quantization, or with
    ``plan_quantize`` that and every choice of QUANT_CHOICES."""
    from megatron.config.errors import ConfigError
    from megatron.topology.layout import SINGLE_PROCESS
    from megatron.analytic.model_inputs import hardware_from_config
    hardware = hardware_from_config(cfg, world_size)
    inputs = inputs_from_config(cfg, padded_vocab, hardware)
    quants = {"config": QuantSpec.from_config(cfg.zero)}
    if cfg.zero.plan_quantize:
        quants.update({name: quant_spec(name, inputs.quant_block) for name in QUANT_CHOICES})
    plan = search(cfg.topology.layout or SINGLE_PROCESS, inputs, quants=quants,
                  checkpointing=(bool(cfg.model.checkpoint_activations),))
    if plan.best is None:
        raise ConfigError(f"zero_optimization.plan auto: {plan.reason()}; raise plan_memory_per_device_gb, "
                          "turn on checkpoint_activations or lower the micro batch")
    return plan


def apply_plan(cfg, row: PlanRow):
    """``cfg`` with the plan's layout written in (explicit factors, or preset zeropp) and, when the
    plan chose them, its quantization bits; the derived resolved_* follow."""
    c = row.candidate
    zero = cfg.zero
    if c.layout.hpz:
        zero = dataclasses.replace(zero, preset=ZEROPP, shard_factors=None)
    else:
        zero = dataclasses.replace(zero, shard_factors=list(row.factors))
    if c.quant_name != "config":
        zero = dataclasses.replace(zero, **c.quant.phase_bits)
    zero = dataclasses.replace(zero, resolved_factors=list(row.factors), resolved_preset=c.layout.preset)
    return dataclasses.replace(cfg, zero=zero)


def planned_config(cfg, world_size: Optional[int] = None):
    """(cfg, None) unless ``zero_optimization.plan`` is auto; then (cfg with the plan applied, plan).
    Pure arithmetic on the config (and the probe file it names): every rank gets the same plan."""
    if cfg.zero.plan != "auto":
        return cfg, None
    from megatron.config.errors import ConfigError
    from megatron.analytic.model_inputs import padded_vocab_of
    vocab = padded_vocab_of(cfg)
    if vocab is None:
        raise ConfigError("zero_optimization.plan auto needs the vocabulary to size the units: set vocab_size "
                          "or make the tokenizer file readable")
    plan = plan_for_config(cfg, vocab, world_size)
    return apply_plan(cfg, plan.best), plan
