"""How GPT-NeoX's config keys are treated here.

    python -m megatron.config.coverage [--list]
"""
from __future__ import annotations

import sys

from megatron.config.registry import REGISTRY, Status, neox_key_names


def coverage() -> dict:
    """{status value: [keys]} over neox_keys.txt, plus 'unclassified' (must stay empty)."""
    result: dict[str, list[str]] = {s.value: [] for s in Status}
    result["unclassified"] = []
    for key in neox_key_names():
        rule = REGISTRY.get(key)
        result[rule.status.value if rule else "unclassified"].append(key)
    return result


def main(argv: list[str]) -> int:
    result = coverage()
    total = sum(len(keys) for keys in result.values())
    print(f"GPT-NeoX config keys: {total} | " + " | ".join(f"{name} {len(keys)}" for name, keys in result.items()))
    if "--list" in argv:
        for name, keys in result.items():
            print(f"{name}: {' '.join(keys)}")
    return 1 if result["unclassified"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
