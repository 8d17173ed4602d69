"""GPT-NeoX configuration front end: YAML files -> one validated, derived, typed NeoXConfig.

    cfg = load_config(["configs/tiny-cpu.yml", "configs/sim-2x2x2.yml"], ["train_iters=10"])

Everything downstream reads typed fields (cfg.model.hidden_size, cfg.zero.resolved_factors, ...);
ranks receive the config as JSON (save_config_json / load_config_json), never YAML.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterable, Mapping, Optional

from megatron.config.errors import ConfigError
from megatron.config.routing import route
from megatron.config.schema import NeoXConfig
from megatron.config.serialize import config_from_dict, config_to_dict, load_config_json, save_config_json
from megatron.config.validate import build_config, launch_environment_error, pad_vocab_size, world_size_of
from megatron.config.yaml_io import apply_overrides, merge_files

__all__ = [
    "ConfigError", "NeoXConfig", "load_config", "config_to_dict", "config_from_dict", "save_config_json",
    "load_config_json", "world_size_of", "pad_vocab_size", "launch_environment_error",
]


def load_config(paths: Iterable[str | Path], overrides: Iterable[str] = (), *,
                env: Optional[Mapping[str, str]] = None, notices: Optional[list] = None) -> NeoXConfig:
    """Merge YAML files in order, apply `--set` overrides, validate and derive.

    Notices about ignored NeoX keys go to `notices` when a list is given, else to stderr (once each).
    `env` (default os.environ) only supplies Slurm's node count for topology presets.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    merged = apply_overrides(merge_files(paths), overrides)
    routed = route(merged)
    cfg = build_config(routed, os.environ if env is None else env)
    cfg.config_files = merged.files
    cfg.overrides = merged.overrides
    lines = routed.notice_lines()
    if notices is not None:
        notices.extend(lines)
    else:
        for line in lines:
            print(line, file=sys.stderr)
    return cfg
