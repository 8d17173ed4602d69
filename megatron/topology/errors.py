"""The topology package's one error (its own module, so every part of the package can raise it)."""
from __future__ import annotations


class TopologyError(ValueError):
    """A layout, preset or environment that cannot describe the ranks; one line says which."""
