"""requirements/*.txt is the one source of truth of the install sets: pyproject.toml must read every
file there and nothing else, and the installed metadata must match the files (else: run make venv)."""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
# packaging is a dependency of pytest itself, so it is there wherever these tests run
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10 (requires-python allows it)
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
REQ_DIR = REPO / "requirements"
STALE = "installed metadata of neox-topo differs from requirements/: run `make venv` to reinstall"


def dynamic_table() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    assert set(pyproject["project"].get("dynamic", [])) >= {"dependencies", "optional-dependencies"}
    assert "dependencies" not in pyproject["project"], "dependencies belong in requirements/"
    assert "optional-dependencies" not in pyproject["project"], "extras belong in requirements/"
    return pyproject["tool"]["setuptools"]["dynamic"]


def files_by_group() -> dict[str, list[str]]:
    """'' (runtime) and each extra -> the requirement files pyproject.toml reads for it."""
    dynamic = dynamic_table()
    groups = {"": dynamic["dependencies"]["file"]}
    for extra, directive in dynamic["optional-dependencies"].items():
        groups[extra] = directive["file"]
    return {name: [files] if isinstance(files, str) else list(files) for name, files in groups.items()}


def requirement_lines(path: Path) -> list[str]:
    """The lines setuptools keeps: blank lines and full-line comments dropped, nothing else."""
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def key(req: Requirement) -> tuple:
    return (canonicalize_name(req.name), str(req.specifier), tuple(sorted(req.extras)), req.url)


def expected_sets() -> dict[str, set[tuple]]:
    out = {}
    for group, files in files_by_group().items():
        out[group] = {key(Requirement(line)) for f in files for line in requirement_lines(REPO / f)}
    return out


def test_every_named_file_exists_and_every_file_is_named():
    named = {f for files in files_by_group().values() for f in files}
    for f in sorted(named):
        assert (REPO / f).is_file(), f"pyproject.toml names {f}, which does not exist"
    on_disk = {p.relative_to(REPO).as_posix() for p in REQ_DIR.glob("*.txt")}
    assert on_disk - named == set(), f"requirement files pyproject.toml does not read: {on_disk - named}"


def test_requirement_lines_parse():
    # setuptools passes each kept line to the requirement parser as it is: no `-r`/`-c`/`--index-url`
    # options and no trailing comments, which would only fail at install time otherwise
    for path in sorted(REQ_DIR.glob("*.txt")):
        for line in requirement_lines(path):
            assert not line.startswith("-"), f"{path.name}: pip option {line!r} (setuptools rejects it)"
            Requirement(line)  # raises InvalidRequirement on e.g. 'foo  # comment'


def test_no_apex_requirement():
    # PyPI's `apex` is an unrelated project; NVIDIA apex is documented as a comment only
    for path in sorted(REQ_DIR.glob("*.txt")):
        for line in requirement_lines(path):
            assert canonicalize_name(Requirement(line).name) != "apex", f"{path.name}: {line!r}"
            assert not re.search(r"\bapex\b", line, re.I), f"{path.name} names apex: {line!r}"


def test_rocm_and_test_sets_have_no_triton():
    # a ROCm torch ships its own triton; PyPI's one installed over it breaks it (requirements-rocm.txt)
    sets = expected_sets()
    for group in ("rocm", "test"):
        assert "triton" not in {name for name, *_ in sets[group]}, f"{group!r} pulls PyPI's triton"
    assert "triton" in {name for name, *_ in sets["gpu"]}


def test_installed_metadata_matches_files():
    try:
        dist = importlib.metadata.distribution("neox-topo")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("neox-topo is not installed: run `make venv`")
    installed: dict[str, set[tuple]] = {extra: set() for extra in dist.metadata.get_all("Provides-Extra") or []}
    installed[""] = set()
    for line in dist.requires or []:
        req = Requirement(line)
        found = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", str(req.marker or ""))
        group = found.group(1) if found else ""
        installed.setdefault(group, set()).add(key(req))
    expected = {canonicalize_name(g) if g else g: reqs for g, reqs in expected_sets().items()}
    installed = {canonicalize_name(g) if g else g: reqs for g, reqs in installed.items()}
    assert set(installed) == set(expected), f"{STALE} (extras {sorted(installed)} vs {sorted(expected)})"
    for group, reqs in expected.items():
        assert installed[group] == reqs, (f"{STALE} ({group or 'runtime'}: installed "
                                          f"{sorted(installed[group])}, files {sorted(reqs)})")
