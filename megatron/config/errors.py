"""The one user-facing error type of the config front end."""
from __future__ import annotations

from typing import Optional


class ConfigError(Exception):
    """A mistake in the user's configuration, explained in one line: what, where, what to do."""


def config_error(key: str, problem: str, origin: Optional[str] = None, fix: Optional[str] = None) -> ConfigError:
    """Build the standard message: `key: problem (in origin); fix`."""
    where = f" (in {origin})" if origin else ""
    advice = f"; {fix}" if fix else ""
    return ConfigError(f"{key}: {problem}{where}{advice}")
