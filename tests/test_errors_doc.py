"""docs/errors.md cannot rot: every row names an exit code and at least one test, and every test it
names exists (the file, the function, and the parametrize id when one is given)."""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "errors.md"
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[([^\]`]+)\])?`")
EXIT_CODE = re.compile(r"^\d+\b")


def table_rows(text: str) -> list[list[str]]:
    """The error table's data rows, split on unescaped pipes (a message may hold `\\|`); section
    rows (a bold first cell, the rest empty) are left out."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("| ") or set(line) <= set("|- "):
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if cells[0] == "input / failure" or (cells[0].startswith("**") and not any(cells[1:])):
            continue
        rows.append(cells)
    return rows


@lru_cache(maxsize=None)
def defined_tests(path: str) -> frozenset[str]:
    tree = ast.parse((REPO / path).read_text())
    return frozenset(node.name for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"))


def test_every_row_has_a_message_an_exit_code_and_tests():
    rows = table_rows(DOC.read_text())
    assert len(rows) >= 40, f"only {len(rows)} rows parsed from {DOC}"
    for cells in rows:
        assert len(cells) == 4, cells
        what, message, code, tests = cells
        assert message.startswith("`"), f"{what}: the message is not quoted"
        assert EXIT_CODE.match(code), f"{what}: exit code {code!r}"
        assert TEST_REF.findall(tests), f"{what}: no test named"


def test_every_named_test_exists():
    missing = []
    for what, _, _, tests in table_rows(DOC.read_text()):
        for path, name, param_id in TEST_REF.findall(tests):
            if not (REPO / path).is_file():
                missing.append(f"{what}: {path} does not exist")
            elif name not in defined_tests(path):
                missing.append(f"{what}: {path} defines no {name}")
            elif param_id and not re.search(rf"""["']{re.escape(param_id)}["']""", (REPO / path).read_text()):
                missing.append(f"{what}: {path} has no parametrize id {param_id!r}")
    assert not missing, "\n".join(missing)


def test_the_checker_sees_a_missing_test():
    row = "| x | `m` | 2 | `tests/test_errors_doc.py::test_no_such_thing` |"
    ((path, name, _),) = TEST_REF.findall(table_rows(row)[0][3])
    assert name not in defined_tests(path)
    assert table_rows("| a | `w \\| g` | 2 | t |")[0][1] == "`w \\| g`"
