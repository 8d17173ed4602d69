"""Reading NeoX YAML: files merged in order (a key in two files is an error), then `--set` overrides.

NeoX configs are JSON-like YAML (braces, `#` comments, trailing commas, `True`), which PyYAML reads
as is. Two gaps are closed here: PyYAML's YAML 1.1 float pattern needs a dot and a signed exponent,
so `1e-8` and `1.0e8` would be strings (our loader reads them as floats), and a key repeated inside
one file silently keeps the last value (our loader refuses it). Keys accept `-` or `_`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from megatron.config.errors import ConfigError

SET_ORIGIN = "--set"

# Exponent floats without a dot or without an exponent sign: 1e-8, 5E3, 1.0e8, .5e3.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class NeoXYamlLoader(yaml.SafeLoader):
    """SafeLoader + exponent floats + duplicate-key refusal."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                name = normalize_key(key) if isinstance(key, str) else key
                line = key_node.start_mark.line + 1
                if name in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice (lines {seen[name]} and {line})", key_node.start_mark)
                seen[name] = line
        return super().construct_mapping(node, deep=deep)


NeoXYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))


def normalize_key(key: str) -> str:
    """NeoX accepts `train-iters` for `train_iters`."""
    return key.replace("-", "_")


def normalize_keys(value: Any) -> Any:
    """Recursively normalise the string keys of every mapping."""
    if isinstance(value, dict):
        return {normalize_key(k) if isinstance(k, str) else k: normalize_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize_keys(v) for v in value]
    return value


def parse_yaml_text(text: str, origin: str) -> Any:
    try:
        return yaml.load(text, Loader=NeoXYamlLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark else origin
        raise ConfigError(f"{where}: invalid YAML: {err.problem or err.context}; fix the file's syntax") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{origin}: invalid YAML: {err}; fix the file's syntax") from None


@dataclass
class MergedYaml:
    """The merged top-level mapping and where each value came from.

    ``origins`` maps a top-level key, or a dotted path set by --set, to its file (or ``--set``);
    ``origin_of`` finds the most specific one.
    """
    values: dict = field(default_factory=dict)
    origins: dict = field(default_factory=dict)
    files: list = field(default_factory=list)      # [{"path", "text"}] in merge order
    overrides: list = field(default_factory=list)  # the --set strings in order

    def origin_of(self, dotted: str) -> str:
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            found = self.origins.get(".".join(parts[:end]))
            if found:
                return found
        # A block never given whole but with keys set inside it (--set fp16.hysteresis=0).
        inside = sorted({origin for key, origin in self.origins.items() if key.startswith(dotted + ".")})
        return ", ".join(inside) if inside else "defaults"


def read_config_file(path: str | Path) -> tuple[dict, str]:
    """(normalised mapping, text) of one YAML file; an empty file is an empty mapping."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {path}; check the path (relative paths start at the current directory)")
    if not p.is_file():
        raise ConfigError(f"config path is not a file: {path}; pass YAML files")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from None
    data = parse_yaml_text(text, str(path))
    if data is None:
        return {}, text
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, not a {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{path}: key {key!r} is not a name; config keys are strings")
    return normalize_keys(data), text


def merge_files(paths: Iterable[str | Path]) -> MergedYaml:
    """Merge files in order; NeoX's rule: a key given in two files is an error, not an override."""
    merged = MergedYaml()
    for path in paths:
        data, text = read_config_file(path)
        merged.files.append({"path": str(path), "text": text})
        for key, value in data.items():
            if key in merged.values:
                first = merged.origins[key]
                raise ConfigError(f"{key}: set in both {first} and {path}; a key may appear in one config file "
                                  f"only — keep one, or override on the command line with --set {key}=VALUE")
            merged.values[key] = value
            merged.origins[key] = str(path)
    return merged


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value parsed as a YAML scalar or flow collection)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set train_iters=100 or --set zero_optimization.stage=3")
    parts = [normalize_key(p.strip()) for p in key.split(".")]
    if any(not p for p in parts):
        raise ConfigError(f"--set {text!r}: empty name in dotted key {key!r}")
    value = parse_yaml_text(raw, f"--set {key}") if raw.strip() else None
    return parts, normalize_keys(value)


def apply_overrides(merged: MergedYaml, overrides: Iterable[str]) -> MergedYaml:
    """Apply `--set` after merging; a dotted key creates the dicts it walks through when missing."""
    for text in overrides:
        parts, value = parse_override(text)
        node = merged.values
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                path = ".".join(parts[:depth + 1])
                raise ConfigError(f"--set {text!r}: {path} is {child!r}, not a mapping, so it has no key {parts[depth + 1]!r}")
            node = child
        node[parts[-1]] = value
        merged.origins[".".join(parts)] = SET_ORIGIN
        merged.overrides.append(text)
    return merged
