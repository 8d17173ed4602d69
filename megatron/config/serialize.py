"""The validated config as plain data: dict and JSON round trips (deepy writes it once, ranks read it).

Values are the validated ones, derived fields included, so ranks never re-parse YAML or re-derive.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from megatron.config.errors import ConfigError
from megatron.config.schema import NeoXConfig

_LIST_FIELDS = ("config_files", "overrides")


def config_to_dict(cfg: NeoXConfig) -> dict:
    """Nested plain dict: one entry per group, plus config_files and overrides."""
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict) -> NeoXConfig:
    """Inverse of config_to_dict; refuses unknown groups or fields (an older/newer config format)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a serialized config must be a mapping, got {type(data).__name__}")
    kwargs = {}
    for f in dataclasses.fields(NeoXConfig):
        if f.name not in data:
            continue
        value = data[f.name]
        if f.name in _LIST_FIELDS:
            kwargs[f.name] = list(value)
            continue
        group_cls = type(f.default_factory())
        if not isinstance(value, dict):
            raise ConfigError(f"serialized config: group {f.name!r} must be a mapping, got {type(value).__name__}")
        known = {g.name for g in dataclasses.fields(group_cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"serialized config: unknown field(s) {', '.join(unknown)} in group {f.name!r}; "
                              "was it written by another version? regenerate it with deepy.py")
        kwargs[f.name] = group_cls(**value)
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(NeoXConfig)})
    if unknown:
        raise ConfigError(f"serialized config: unknown group(s) {', '.join(unknown)}; regenerate it with deepy.py")
    return NeoXConfig(**kwargs)


def save_config_json(cfg: NeoXConfig, path: str | Path) -> Path:
    """Write atomically (temp file + rename) so a rank never reads half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config_to_dict(cfg), indent=2, allow_nan=False)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_config_json(path: str | Path) -> NeoXConfig:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config JSON not found: {path}; start ranks with `python deepy.py train.py CONFIG.yml`") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read config JSON {path}: {err}") from None
    return config_from_dict(data)
