"""Per-rank counters of the bytes each collective sends, by (phase, tier), and their world sum.

The charging rule (docs/engine.md, "Bytes charged") lives in ``Communicator.charge`` and the world
sum in ``Communicator.world_sum`` (riding in the step vector); this module only keeps counters. Counters are Python ints (exact); the world sum travels as float64,
exact up to 2**53 bytes per entry.
"""
from __future__ import annotations

from collections import defaultdict
from megatron.topology.names import PHASES, TIERS



class LedgerError(ValueError):
    """A phase or tier the ledger does not know (a programming error in a caller)."""


Key = tuple[str, str]


class ByteLedger:
    """Bytes this rank sent, by (phase, tier), since the last ``reset()``."""

    def __init__(self) -> None:
        self._bytes: dict[Key, int] = defaultdict(int)

    def record(self, phase: str, tier: str, nbytes: int) -> None:
        if phase not in PHASES:
            raise LedgerError(f"unknown ledger phase {phase!r}; known: {', '.join(PHASES)}")
        if tier not in TIERS:
            raise LedgerError(f"unknown ledger tier {tier!r}; known: {', '.join(TIERS)}")
        self._bytes[(phase, tier)] += int(nbytes)

    def move(self, charges: dict[str, int], from_phase: str, to_phase: str) -> None:
        """Re-attribute bytes already recorded (``charges``: tier -> bytes) to another phase.

        Used once per checkpointed unit: its backward gather is recorded before the engine can see
        that autograd will recompute the unit, and is then relabelled ``recompute_gather``.
        """
        for tier, nbytes in charges.items():
            if self._bytes[(from_phase, tier)] < nbytes:
                raise LedgerError(f"cannot move {nbytes} bytes out of ({from_phase}, {tier}): not recorded")
            self._bytes[(from_phase, tier)] -= nbytes
            self.record(to_phase, tier, nbytes)

    def snapshot(self) -> dict[Key, int]:
        """This rank's counters, every (phase, tier) present (zeros included)."""
        return {(p, t): self._bytes.get((p, t), 0) for p in PHASES for t in TIERS}

    def reset(self) -> None:
        self._bytes.clear()

    @staticmethod
    def by_tier(totals: dict[Key, int]) -> dict[str, int]:
        out = {t: 0 for t in TIERS}
        for (_, tier), nbytes in totals.items():
            out[tier] += nbytes
        return out

    @staticmethod
    def by_phase(totals: dict[Key, int]) -> dict[str, int]:
        out = {p: 0 for p in PHASES}
        for (phase, _), nbytes in totals.items():
            out[phase] += nbytes
        return out

    @classmethod
    def metrics(cls, totals: dict[Key, int]) -> dict[str, int]:
        """``comm/bytes/<tier>`` and ``comm/bytes/phase/<phase>`` for a step's metrics line."""
        out = {f"comm/bytes/{t}": v for t, v in cls.by_tier(totals).items()}
        out.update({f"comm/bytes/phase/{p}": v for p, v in cls.by_phase(totals).items()})
        return out
