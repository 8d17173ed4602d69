"""The figures the step-time model reads (docs/time_model.md, "The figures"): per-tier links,
per-algorithm links a probe measured, per-(algorithm, group shape) latency-bandwidth curves, and
the device. From a ``Topology``'s tiers and the device table (the ``nominal`` figure set), or a
published figure set (``megatron.analytic.figure_sets``: ``frontier-measured``, ``frontier-eager``), overridden by a
link probe file (tools/probe_links.py, format ``PROBE_FORMAT``).

Two ways a collective's time is read, in this order (``Hardware.curve``):
- a curve for its (algorithm, shape): the bandwidth of the busiest domain of the slowest tier the
  group spans, as a function of the bytes one algorithm step moves (B / k), as measured with every
  group of the kind running at once; the shape says what decides the rate: ``pair`` (one GPU's
  GCDs), ``node`` (one node), ``cross`` (one rank on each of several nodes, as ZeRO-topo's cross
  groups and qgZ's rail groups: the node's ranks side by side share its NICs) and ``world`` (several
  ranks on each of several nodes: one ring through every node);
- else the tier figures (``links``, ``algorithm_links``): steps x latency + bytes / bandwidth.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from megatron.logging.throughput import H100_SXM, MI250X_GCD
from megatron.topology.algorithms import ALGORITHMS, BACKENDS, FALLBACK
from megatron.analytic.comm_model import CommModelError
from megatron.analytic.figure_sets import FIGURE_SETS
from megatron.analytic.link_curve import LinkCurve

PROBE_FORMAT = "neox-topo-link-probe/1"
SHAPES = ("pair", "node", "cross", "world")


@dataclass(frozen=True)
class TierLink:
    """One tier's links as one *domain* sees them (a node for inter_node, a rank otherwise)."""
    bandwidth: float
    """Bytes per second into (or out of) one domain through this tier."""
    latency_s: float
    """Seconds per algorithm step over this tier."""


def group_shape(ranks, layout: tuple) -> str:
    """Which of SHAPES a group of ranks is on a layout (slowest tier first)."""
    per_node = math.prod(layout[1:])
    nodes = {r // per_node for r in ranks}
    if len(nodes) > 1:
        return "cross" if len(nodes) == len(ranks) else "world"
    if len(layout) == 3 and len({r // layout[-1] for r in ranks}) == 1:
        return "pair"
    return "node"


@dataclass(frozen=True)
class Device:
    """What one rank's device achieves (not its peak): the compute side of the model."""
    name: str
    achieved_flops: float
    """Model FLOP/s one rank sustains in its forward and backward (all ranks computing at once)."""
    optimizer_elements_per_s: float
    """fp32 elements of the AdamW update per second (memory-bound)."""
    quantize_elements_per_s: float
    """Elements per second through one quantize + one dequantize (the quantized collectives' kernels)."""
    overlap_efficiency: float
    """Share of min(compute, communication) hidden when the engine overlaps them (0..1)."""
    memory_bytes: float
    """Memory of one device (the planner's default budget)."""
    overlap_by_tier: Mapping = field(default_factory=dict)
    """{tier: efficiency} where a tier's transfers hide differently (a probe: on a CPU, a slow
    NIC's transfer waits in the kernel and hides, a loopback copy takes the same cores and does not)."""
    copy_bytes_per_s: float = 0.0
    """Bytes per second a local copy moves (read + write: HBM bandwidth / 2); 0 = copies not counted."""

    def overlap(self, tier: Optional[str]) -> float:
        return self.overlap_by_tier.get(tier, self.overlap_efficiency)


# Public peak figures; the achieved shares and per-element costs measured on an H200 where they can
# be (bench/results/h200_device_probe.json: tools/probe_links.py --layout 1 1 --dtype bf16 --model 4
# 6144 64 2048 50432 2, 2026-12-04): forward + backward of four 20B-shaped blocks at 494 TFLOP/s =
# 50% of the 989 dense bf16 peak; adamw_update at 5.25e10 elements/s = 4.8 TB/s / 91 B per element
# (several torch passes, not one fused kernel); a Triton INT8 quantize + dequantize at 1.60e11
# elements/s = 4.8 TB/s / 30 B. The per-element bytes are the code's, so they carry to other HBM; a
# probe on the machine replaces all of it.
ADAMW_HBM_BYTES_PER_ELEMENT, QUANTIZE_HBM_BYTES_PER_ELEMENT = 91.0, 30.0
DEVICES = {
    # MI250X GCD: 191.5 TFLOP/s bf16 dense, 64 GB HBM2E at 1.6 TB/s (OLCF Frontier user guide).
    # Achieved compute: 35% of peak assumed for a 10-20B GPT in bf16 (not measured: no MI250X here);
    # RCCL kernels share the CUs with compute: 0.9 of the overlap assumed.
    # A local copy reads and writes each byte: half the HBM bandwidth.
    "mi250x_gcd": Device("mi250x_gcd", 0.35 * MI250X_GCD["bfloat16"], 1.6e12 / ADAMW_HBM_BYTES_PER_ELEMENT,
                         1.6e12 / QUANTIZE_HBM_BYTES_PER_ELEMENT, 0.9, 64e9, copy_bytes_per_s=1.6e12 / 2),
    # H100 SXM: 989 TFLOP/s bf16 dense (the H200's compute), 80 GB HBM3 at 3.35 TB/s; 50% achieved
    # as measured on the H200.
    "h100": Device("h100", 0.50 * H100_SXM["bfloat16"], 3.35e12 / ADAMW_HBM_BYTES_PER_ELEMENT,
                   3.35e12 / QUANTIZE_HBM_BYTES_PER_ELEMENT, 0.9, 80e9, copy_bytes_per_s=3.35e12 / 2),
}
DEVICE_OF_TOPOLOGY = {"dgx": "h100"}  # every other topology (frontier, sim..., slurm...) has Frontier's figures


@dataclass(frozen=True)
class Hardware:
    links: Mapping
    """{tier: TierLink}: the default figures of every tier of the layouts it is used with."""
    device: Device
    backend: str = "nccl"
    """Which library runs the collectives ("nccl" = NCCL/RCCL, "gloo"): decides the reduce-scatter."""
    algorithm_links: Mapping = field(default_factory=dict)
    """{(algorithm, tier): TierLink} measured per algorithm (a probe); else FALLBACK, else ``links``."""
    source: str = "preset"
    """Where the figures come from, for the logs: "<figure set> (...)" or "probe <path>"."""
    curves: Mapping = field(default_factory=dict)
    """{(algorithm, shape): LinkCurve}: read before the tier figures (module docstring)."""
    figure_set: str = "nominal"
    """The figure set these figures start from (FIGURE_SETS); a probe keeps the name it overrides."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise CommModelError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        for algorithm, shape in self.curves:
            if algorithm not in ALGORITHMS or shape not in SHAPES:
                raise CommModelError(f"a link curve must be keyed by one of {', '.join(ALGORITHMS)} and one of "
                                     f"{', '.join(SHAPES)}; got {(algorithm, shape)!r}")

    def link(self, algorithm: str, tier: str) -> TierLink:
        """The figures an algorithm sees on a tier: its own, its fallback's, else the tier's."""
        for name in (algorithm, FALLBACK.get(algorithm)):
            if (name, tier) in self.algorithm_links:
                return self.algorithm_links[(name, tier)]
        if tier not in self.links:
            raise CommModelError(f"hardware ({self.source}) has no figures for tier {tier}")
        return self.links[tier]

    def curve(self, algorithm: str, shape: str) -> Optional[LinkCurve]:
        """The curve of (algorithm, shape), else of (its fallback, shape), else None (tier figures)."""
        for name in (algorithm, FALLBACK.get(algorithm)):
            if (name, shape) in self.curves:
                return self.curves[(name, shape)]
        return None

    @classmethod
    def from_topology(cls, topology, device: Optional[str] = None, backend: str = "nccl",
                      figures: str = "nominal") -> "Hardware":
        """Figures for a ``Topology``: ``nominal`` = its tiers (bandwidth x links per domain) and the
        device by name (default: the topology's, DEVICE_OF_TOPOLOGY); any other name in FIGURE_SETS
        starts from those and replaces what that set measured (curves, device rates)."""
        links = {t.name: TierLink(t.bandwidth_gbs * 1e9 * t.links, t.latency_us * 1e-6) for t in topology.tiers}
        name = device or DEVICE_OF_TOPOLOGY.get(topology.name, "mi250x_gcd")
        if name not in DEVICES:
            raise CommModelError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}")
        hw = cls(links, DEVICES[name], backend, source=f"nominal (preset {topology.name}/{name})")
        return hw if figures == "nominal" else hw.with_figure_set(figures)

    def with_figure_set(self, name: str) -> "Hardware":
        """These figures with a published set's curves and device rates in place (FIGURE_SETS)."""
        if name not in FIGURE_SETS:
            raise CommModelError(f"unknown figure set {name!r}; choose one of nominal, {', '.join(FIGURE_SETS)}")
        published = FIGURE_SETS[name]
        device = dataclasses.replace(self.device, name=f"{self.device.name}+{name}", **published.device_rates)
        return dataclasses.replace(self, device=device, curves={**self.curves, **published.curves},
                                   source=f"{name} ({published.summary})", figure_set=name)

    def with_probe(self, probe, path: str = "probe") -> "Hardware":
        """These figures overridden by a probe (a dict in PROBE_FORMAT, or a path to one): per tier,
        per (algorithm, tier), per (algorithm, shape) curve, the device's rates and the backend; what
        the probe lacks stays."""
        data = read_probe(probe) if isinstance(probe, (str, Path)) else probe
        if data.get("format") != PROBE_FORMAT:
            raise CommModelError(f"{path}: not a link probe (format {data.get('format')!r}, expected {PROBE_FORMAT})")
        links = dict(self.links)
        links.update({tier: tier_link(v, path) for tier, v in data.get("tiers", {}).items()})
        measured = dict(self.algorithm_links)
        for algorithm, per_tier in data.get("algorithms", {}).items():
            _check_algorithm(algorithm, path)
            measured.update({(algorithm, tier): tier_link(v, path) for tier, v in per_tier.items()})
        curves = dict(self.curves)
        for algorithm, per_shape in data.get("curves", {}).items():
            _check_algorithm(algorithm, path)
            for shape, entry in per_shape.items():
                curves[(algorithm, shape)] = probe_curve(entry, shape, path)
        device = self.device
        given = data.get("device", {})
        rates = {k: float(v) for k, v in given.items() if k in _DEVICE_RATES}
        if "overlap_by_tier" in given:
            rates["overlap_by_tier"] = {tier: _fraction(v, path) for tier, v in given["overlap_by_tier"].items()}
        if rates:
            device = dataclasses.replace(device, name=f"{device.name}+probe", **rates)
        return Hardware(links, device, data.get("backend", self.backend), measured,
                        source=f"probe {path} on {self.figure_set}", curves=curves, figure_set=self.figure_set)


def _check_algorithm(algorithm: str, path: str) -> None:
    if algorithm not in ALGORITHMS:
        raise CommModelError(f"{path}: unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")


def probe_curve(entry: Mapping, shape: str, path: str) -> LinkCurve:
    """{points: [[step bytes, GB/s], ...], latency_us} as the probe writes it."""
    if shape not in SHAPES:
        raise CommModelError(f"{path}: unknown group shape {shape!r}; expected one of {', '.join(SHAPES)}")
    try:
        points = tuple((float(c), float(gbs) * 1e9) for c, gbs in entry["points"])
        latency = float(entry.get("latency_us", 0.0)) * 1e-6
    except (KeyError, TypeError, ValueError):
        raise CommModelError(f"{path}: a curve needs points [[step bytes, GB/s], ...]; got {entry!r}") from None
    return LinkCurve(points, latency, source=f"probe {path}")


_DEVICE_RATES = ("achieved_flops", "optimizer_elements_per_s", "quantize_elements_per_s",
                 "overlap_efficiency", "memory_bytes", "copy_bytes_per_s")


def _fraction(value, path: str) -> float:
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise CommModelError(f"{path}: an overlap efficiency must be a number in [0, 1]; got {value!r}")
    return share


def tier_link(entry: Mapping, path: str) -> TierLink:
    """{bandwidth_gbs, latency_us} (GB/s per domain, us per step) as written by the probe or by hand."""
    try:
        bandwidth, latency = float(entry["bandwidth_gbs"]) * 1e9, float(entry["latency_us"]) * 1e-6
    except (KeyError, TypeError, ValueError):
        raise CommModelError(f"{path}: a tier entry needs numbers bandwidth_gbs and latency_us; got {entry!r}") from None
    if bandwidth <= 0 or latency < 0:
        raise CommModelError(f"{path}: bandwidth_gbs must be > 0 and latency_us >= 0; got {entry!r}")
    return TierLink(bandwidth, latency)


def read_probe(path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise CommModelError(f"cannot read the link probe {path}: {err}") from None
