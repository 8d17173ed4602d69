"""Which unit's weight gather the engine issues early (docs/engine.md, "Prefetch").

Forward: when unit u starts, the unit that followed u in the previous forward (before any forward:
the units' list order, which ``model.units()`` gives in forward order), unless it already ran in
this pass. Backward: when unit u's backward starts, the unit that preceded u in this pass's forward,
unless its gradient has already been reduced. So a gather is only ever moved earlier, never added:
the ledger's counts do not change. A wrong guess (a model whose order changes between passes)
costs memory, or for a unit the pass never uses one gather that the engine drains at the pass's end.
"""
from __future__ import annotations

from typing import Optional


class PassOrder:
    """The order units ran in: the previous forward's, and this pass's so far."""

    def __init__(self, num_units: int):
        self.previous: list[int] = list(range(num_units))
        self.visited: list[int] = []
        self.reduced: set[int] = set()

    def begin(self) -> None:
        """A new pass (forward, and backward if any) starts."""
        self.visited, self.reduced = [], set()

    def visit(self, index: int) -> None:
        """Unit ``index`` runs its forward (outside a recompute)."""
        if index not in self.visited:
            self.visited.append(index)

    def end_forward(self) -> None:
        """The forward of this pass is over: its order guides the next pass's forward prefetch."""
        if self.visited:
            self.previous = list(self.visited)

    def after(self, index: int) -> Optional[int]:
        """The unit to gather while ``index`` runs its forward, or None."""
        order = self.previous
        if index not in order:
            return None
        pos = order.index(index)
        if pos + 1 == len(order) or order[pos + 1] in self.visited:
            return None
        return order[pos + 1]

    def is_last(self, index: int) -> bool:
        """Whether ``index`` ended the previous forward (before any: the last of the list): its
        backward comes right after its forward, so the engine keeps it gathered in between."""
        return bool(self.previous) and self.previous[-1] == index

    def before(self, index: int) -> Optional[int]:
        """The unit to gather while ``index`` runs its backward, or None."""
        if index not in self.visited:
            return None
        pos = self.visited.index(index)
        if pos == 0 or self.visited[pos - 1] in self.reduced:
            return None
        return self.visited[pos - 1]
