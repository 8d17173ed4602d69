"""The Engine protocol is complete: the training loop calls nothing on its engine that the protocol
does not declare, and both engines implement every method it declares."""
from __future__ import annotations

import ast
import inspect

from conftest import REPO
from megatron.engine import Engine, SingleProcessEngine, ZeroTopoEngine

DECLARED = {name for name, member in vars(Engine).items() if callable(member) and not name.startswith("_")}


def test_the_loop_calls_only_what_the_protocol_declares():
    tree = ast.parse((REPO / "megatron" / "training.py").read_text())
    called = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
              and isinstance(node.value, ast.Attribute) and node.value.attr == "engine"}
    assert called and called <= DECLARED, sorted(called - DECLARED)


def test_both_engines_implement_every_declared_method_with_its_parameters():
    for engine in (SingleProcessEngine, ZeroTopoEngine):
        for name in DECLARED:
            assert callable(getattr(engine, name, None)), f"{engine.__name__} lacks {name}"
            declared = list(inspect.signature(getattr(Engine, name)).parameters)
            assert list(inspect.signature(getattr(engine, name)).parameters) == declared, (engine.__name__, name)
