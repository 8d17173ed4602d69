"""tools/code_map.py: the circle and floor arithmetic on a graph drawn by hand, and the repository's
own import graph: no module imports itself round about, no package sits in a circle (that no
analytic model imports the runtime engine is tests/test_layout.py's)."""
from __future__ import annotations

import importlib.util
import sys

from conftest import REPO

_spec = importlib.util.spec_from_file_location("code_map", REPO / "tools" / "code_map.py")
code_map = importlib.util.module_from_spec(_spec)
sys.modules["code_map"] = code_map  # its dataclasses look their module up there
_spec.loader.exec_module(code_map)


def test_circles_and_floors_of_a_graph_drawn_by_hand():
    # a -> b -> c -> a is a circle; d imports a; e imports nothing; f imports e and d
    arrows = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set(), "f": {"e", "d"}}
    assert code_map.circles(arrows) == [["a", "b", "c"]]
    floor, back = code_map.floors(arrows)
    assert back == 3  # every arrow inside the circle runs back up
    assert (floor["e"], floor["d"], floor["f"]) == (0, 1, 2)
    assert code_map.circles({"x": {"y"}, "y": set()}) == []


def test_the_code_has_no_import_circles():
    report = code_map.report(code_map.read(REPO))
    assert report["module_circles"] == [], report["module_circles"]
    assert report["package_circles"] == [] and report["arrows_back_up"] == 0, report["package_circles"]
