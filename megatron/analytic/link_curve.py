"""A collective algorithm's measured rate against the bytes of one of its steps (docs/time_model.md).

Its own module so that the published figure sets (figure_sets.py) and the figures the time model
reads (hardware.py) both build on it without importing each other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.analytic.comm_model import CommModelError


@dataclass(frozen=True)
class LinkCurve:
    """An algorithm's rate in one group shape against the bytes one of its steps moves.

    ``points`` are (step bytes, bytes per second through the busiest domain of the slowest tier the
    group spans: a node when the shape spans nodes, else a rank), ascending; between two points the
    rate is interpolated on log-log axes; above the last point it stays at the last rate, and a step
    smaller than the first point's takes as long as that step did (a latency floor). A rate
    measured end to end (a benchmark's bus bandwidth) already holds the per-step latency, so
    ``latency_s`` is 0 for such curves; a curve built from a link's bandwidth adds its latency per step.
    """
    points: tuple
    latency_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        pts = tuple((float(c), float(r)) for c, r in self.points)
        if not pts or any(c <= 0 or r <= 0 for c, r in pts) or any(a[0] >= b[0] for a, b in zip(pts, pts[1:])):
            raise CommModelError(f"a link curve needs positive (step bytes, bytes/s) points in ascending "
                                 f"step bytes; got {self.points!r}")
        if self.latency_s < 0:
            raise CommModelError(f"a link curve's latency must be >= 0; got {self.latency_s}")
        object.__setattr__(self, "points", pts)

    def bandwidth(self, step_bytes: float) -> float:
        pts = self.points
        if step_bytes <= pts[0][0]:  # no faster per step than the smallest step measured
            return pts[0][1] * step_bytes / pts[0][0]
        for (c0, r0), (c1, r1) in zip(pts, pts[1:]):
            if step_bytes <= c1:
                t = math.log(step_bytes / c0) / math.log(c1 / c0)
                return math.exp(math.log(r0) + t * math.log(r1 / r0))
        return pts[-1][1]

    def scaled(self, factor: float) -> "LinkCurve":
        """Every rate multiplied by ``factor`` (sensitivity runs)."""
        return LinkCurve(tuple((c, r * factor) for c, r in self.points), self.latency_s,
                         self.source + f" (x {factor:g})")
