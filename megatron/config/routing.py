"""Route the merged NeoX mapping to typed fields: classify each key, check its type and value.

The result is a flat ``{"group.field": value}`` plus the origin (file or --set) of each value and
the notices for ignored keys. Cross-field rules and derived values come later (validate.py).
"""
from __future__ import annotations

import difflib
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Optional

from megatron.config.errors import ConfigError, config_error
from megatron.config.registry import REGISTRY, KeyRule, Status
from megatron.config.schema import NeoXConfig
from megatron.config.yaml_io import SET_ORIGIN, MergedYaml

GROUPS = {f.name: f.default_factory for f in fields(NeoXConfig) if f.name not in ("config_files", "overrides")}

# The DeepSpeed precision blocks are kept as dicts; these are the entries they may hold.
BLOCK_KEYS = {
    "fp16": ("enabled", "type", "fp16", "auto_cast", "loss_scale", "loss_scale_window", "initial_scale_power",
             "hysteresis", "consecutive_hysteresis", "min_loss_scale"),
    "bf16": ("enabled", "immediate_grad_update", "check_grad_overflow"),
}


@dataclass
class Routed:
    """Typed values by target ("group.field"), the YAML key and origin that set each, and notices."""
    values: dict = field(default_factory=dict)
    keys: dict = field(default_factory=dict)
    origins: dict = field(default_factory=dict)
    notices: dict = field(default_factory=dict)  # reason -> [keys ignored for it]
    messages: list = field(default_factory=list)  # other one-line notices (defaults applied)

    def origin(self, target: str) -> str:
        return self.origins.get(target, "defaults")

    def notice_lines(self) -> list[str]:
        lines = [f"notice: ignoring {_compact(keys)}: {reason}" for reason, keys in self.notices.items()]
        return lines + [f"notice: {message}" for message in self.messages]


def _compact(keys: list[str]) -> str:
    """`a.x, a.y, b` -> `a.{x, y}, b` so a notice stays one readable line."""
    by_prefix: dict[str, list[str]] = {}
    for key in keys:
        prefix, _, last = key.rpartition(".")
        by_prefix.setdefault(prefix, []).append(last)
    parts = []
    for prefix, names in by_prefix.items():
        if not prefix:
            parts.extend(names)
        elif len(names) == 1:
            parts.append(f"{prefix}.{names[0]}")
        else:
            parts.append(f"{prefix}.{{{', '.join(names)}}}")
    return ", ".join(parts)


def schema_field(target: str):
    group, name = target.split(".")
    for f in fields(GROUPS[group]()):
        if f.name == name:
            return f
    raise KeyError(target)


def yaml_key_of(target: str) -> str:
    """The YAML spelling of a typed field (what error messages name)."""
    f = schema_field(target)
    return f.metadata.get("key", f.name)


def field_type(target: str):
    group, name = target.split(".")
    return typing.get_type_hints(GROUPS[group])[name]


def route(merged: MergedYaml) -> Routed:
    routed = Routed()
    leaves = dict(flatten(merged.values, merged))
    for key, value in leaves.items():
        rule = REGISTRY[key]
        origin = merged.origin_of(key)
        if rule.status is Status.NOOP:
            if value is not None and value is not False:
                routed.notices.setdefault(rule.reason, []).append(key)
        elif rule.status is Status.REFUSED:
            if not rule.neutral(value, leaves):
                raise config_error(key, f"{_show(value)} is not accepted (accepted: {rule.accepts})", origin, rule.reason)
        else:
            _store(routed, rule, key, value, origin)
    return routed


def flatten(values: dict, merged: MergedYaml, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every leaf; containers are opened, unknown keys refused."""
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        rule = REGISTRY.get(dotted)
        if rule is None:
            raise _unknown_key(dotted, merged.origin_of(dotted))
        if rule.container:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise config_error(dotted, f"expected a mapping of keys, got {_show(value)}", merged.origin_of(dotted))
            yield from flatten(value, merged, dotted + ".")
        else:
            yield dotted, value


def _unknown_key(key: str, origin: str) -> ConfigError:
    prefix, _, last = key.rpartition(".")
    if prefix:
        siblings = [k.rpartition(".")[2] for k in REGISTRY if k.rpartition(".")[0] == prefix]
        guess = difflib.get_close_matches(last, siblings, n=1, cutoff=0.6)
        guess = [f"{prefix}.{g}" for g in guess]
    else:
        guess = difflib.get_close_matches(key, [k for k in REGISTRY if "." not in k], n=1, cutoff=0.6)
    if key in GROUPS:
        fix = f"keys are NeoX's flat names (e.g. num_layers), not grouped under {key!r}; see docs/config.md"
    elif guess:
        fix = f"did you mean {guess[0]!r}?"
    else:
        fix = "see docs/config.md for the accepted keys"
    return config_error(key, "unknown key", origin, fix)


def _store(routed: Routed, rule: KeyRule, key: str, value: Any, origin: str) -> None:
    target = rule.target
    value = coerce(value, field_type(target), key, origin)
    value = check_value(value, schema_field(target).metadata, key, origin)
    name = schema_field(target).name
    if name in BLOCK_KEYS and value is not None:
        _check_block(key, value, BLOCK_KEYS[name], origin)
    if target in routed.values and routed.values[target] != value:
        before = routed.origins[target]
        if before == SET_ORIGIN and origin != SET_ORIGIN:
            return  # a --set override beats a file, whichever spelling either used
        if origin != SET_ORIGIN:
            raise ConfigError(f"{routed.keys[target]} ({before}) and {key} ({origin}) give different values "
                              f"({_show(routed.values[target])} vs {_show(value)}) for the same setting; keep one")
    routed.values[target] = value
    routed.keys[target] = key
    routed.origins[target] = origin


def _check_block(key: str, block: dict, allowed: tuple[str, ...], origin: str) -> None:
    for sub in block:
        if sub not in allowed:
            guess = difflib.get_close_matches(str(sub), allowed, n=1, cutoff=0.6)
            fix = f"did you mean {key}.{guess[0]}?" if guess else f"accepted entries: {', '.join(allowed)}"
            raise config_error(f"{key}.{sub}", "unknown key", origin, fix)
    if "enabled" in block and not isinstance(block["enabled"], bool):
        raise config_error(f"{key}.enabled", f"expected true or false, got {_show(block['enabled'])}", origin)


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list", dict: "a mapping"}


def coerce(value: Any, annotation, key: str, origin: str) -> Any:
    """Check `value` against a field annotation (int, float, str, bool, list, dict, Optional[...])."""
    optional = typing.get_origin(annotation) is typing.Union
    base = next(a for a in typing.get_args(annotation) if a is not type(None)) if optional else annotation
    if value is None:
        if optional:
            return None
        raise config_error(key, f"expected {_TYPE_WORDS[base]}, got an empty value", origin)
    bad = config_error(key, f"expected {_TYPE_WORDS[base]}, got {_show(value)}", origin)
    if base is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if isinstance(value, bool):
        raise bad
    if base is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if base is float:
        if isinstance(value, (int, float)):
            if not math.isfinite(value):
                raise config_error(key, f"must be a finite number, got {value}", origin)
            return float(value)
        raise bad
    if base is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)):
            return str(value)
        raise bad
    if base is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise bad
    if base is dict:
        if isinstance(value, dict):
            return value
        raise bad
    raise TypeError(f"unsupported schema annotation {annotation!r} for {key}")


def check_value(value: Any, meta: dict, key: str, origin: str) -> Any:
    """Enumerations (with case-insensitive and alias spellings) and numeric bounds from field metadata."""
    if value is None:
        return None
    choices: Optional[tuple] = meta.get("choices")
    if choices is not None and value not in choices:
        canonical = _spelling(value, choices, meta.get("aliases", {}))
        if canonical is None:
            allowed = ", ".join(str(c) for c in choices)
            raise config_error(key, f"{_show(value)} is not supported", origin, f"use {'one of ' if len(choices) > 1 else ''}{allowed}")
        value = canonical
    for bound, test, words in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                               ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        if bound in meta and isinstance(value, (int, float)) and not test(value, meta[bound]):
            raise config_error(key, f"must be {words} {meta[bound]}, got {value}", origin)
    return value


def _spelling(value: Any, choices: tuple, aliases: dict) -> Optional[Any]:
    if not isinstance(value, str):
        return None
    lowered = value.lower()
    for choice in choices:
        if isinstance(choice, str) and choice.lower() == lowered:
            return choice
    for alias, canonical in aliases.items():
        if alias.lower() == lowered:
            return canonical
    return None


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
