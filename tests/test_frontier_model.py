"""docs/frontier-model.md's tables are bench/frontier_model.py's output: rerun on a small grid (20B,
frontier-measured, micro-batch 4, accumulation 1, every node count, the sensitivity), every row it
prints must stand on the page as printed. A change to the model, the figures or the configs that
moves a number fails here until the page is regenerated (the command is at the top of the page)."""
from __future__ import annotations

import importlib.util
import re

from conftest import REPO

_spec = importlib.util.spec_from_file_location("frontier_model", REPO / "bench" / "frontier_model.py")
frontier_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(frontier_model)

DOC = REPO / "docs" / "frontier-model.md"


def _rows(text: str) -> list:
    """Table body rows: '| ... |' lines that are neither a header (followed by '|---') nor a rule."""
    lines = text.splitlines()
    return [line for i, line in enumerate(lines) if line.startswith("| ") and not line.startswith("|---")
            and not (i + 1 < len(lines) and lines[i + 1].startswith("|---"))]


def test_the_page_holds_the_tools_output_for_a_small_grid(capsys):
    code = frontier_model.main(["--models", "20B", "--micro-batches", "4", "--accumulation", "1",
                                "--figures", "frontier-measured", "--png-dir", ""])
    assert code == 0
    printed = capsys.readouterr().out
    sections = dict(re.findall(r"<!-- frontier_model:(\w+) -->\n(.*?)(?=\n\n<!-- frontier_model:|\Z)", printed, re.S))
    # the readings of the CSV's rows need ../shared's data; every other section is always printed
    expected = set(frontier_model.MARKERS) - (set() if frontier_model.pccl_frontier.DATA.exists() else {"readings"})
    assert set(sections) == expected
    page = DOC.read_text()
    for name, body in sections.items():
        marked = re.search(rf"<!-- frontier_model:{name} -->\n(.*?)\n<!-- /frontier_model:{name} -->", page, re.S)
        assert marked, f"docs/frontier-model.md has no {name} section"
        missing = [row for row in _rows(body) if row not in marked.group(1).splitlines()]
        assert not missing, f"{name}: rows not on the page (rerun the command at its top):\n" + "\n".join(missing[:5])

