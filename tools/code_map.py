"""The shape of the code, measured from the code: modules, lines, the import graph, its circles.

    .venv/bin/python tools/code_map.py                        # print the numbers
    .venv/bin/python tools/code_map.py --write docs/engine.md # refresh the marked section and the picture

Every ``import`` and ``from ... import`` of a ``megatron`` module counts as an arrow, wherever it
stands (inside functions, under ``if TYPE_CHECKING:``): an arrow is a dependency a reader must
follow. Packages are the folders under megatron/ (a loose module is its own package). Floors: a
package with no arrows to other packages is on floor 0, any other one floor above the highest it
imports; an arrow inside a package circle cannot be given a floor and "runs back up". Circles are
groups of modules (or packages) that import each other, directly or round about.
"""
from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron.benchmarking.doc_sections import MissingSection, replace_section

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- code-map:begin -->", "<!-- code-map:end -->"
FIGURE = "figures/imports.png"


@dataclass
class CodeMap:
    lines: dict = field(default_factory=dict)     # module -> lines
    arrows: dict = field(default_factory=dict)    # module -> set of modules it imports

    @property
    def packages(self) -> dict:
        out: dict = {}
        for module in self.lines:
            out.setdefault(package_of(module), []).append(module)
        return out

    def package_arrows(self) -> dict:
        out: dict = {p: set() for p in self.packages}
        for a, targets in self.arrows.items():
            for b in targets:
                if package_of(a) != package_of(b):
                    out[package_of(a)].add(package_of(b))
        return out


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def read(root: Path = REPO) -> CodeMap:
    files = {module_name(p, root): p for p in sorted((root / "megatron").rglob("*.py"))}
    files.pop("megatron", None)  # the root package's empty __init__: no code, no arrows
    code = CodeMap()
    for module, path in files.items():
        text = path.read_text()
        code.lines[module] = len(text.splitlines())
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found |= {n for n in names if n in files and n != module}
        code.arrows[module] = found
    return code


def circles(arrows: dict) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(arrows):
        if start in index:
            continue
        work = [(start, iter(sorted(arrows.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(arrows.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return sorted(out)


def floors(arrows: dict) -> tuple[dict, int]:
    """Each node's floor (0 = imports no other) and how many arrows run back up (inside circles)."""
    in_circle = {n: i for i, group in enumerate(circles(arrows)) for n in group}
    floor: dict = {}

    def level(node, seen=()) -> int:
        if node in floor:
            return floor[node]
        below = [t for t in arrows.get(node, ()) if not (node in in_circle and in_circle.get(t) == in_circle[node])]
        floor[node] = 1 + max((level(t, seen + (node,)) for t in below), default=-1)
        return floor[node]

    for node in sorted(arrows):
        level(node)
    back = sum(1 for a, ts in arrows.items() for b in ts if a in in_circle and in_circle.get(b) == in_circle[a])
    return floor, back


def report(code: CodeMap) -> dict:
    packages = code.package_arrows()
    floor, back = floors(packages)
    return {"modules": len(code.lines), "lines": sum(code.lines.values()), "packages": len(packages),
            "package_arrows": sum(len(v) for v in packages.values()),
            "module_arrows": sum(len(v) for v in code.arrows.values()),
            "floors": 1 + max(floor.values(), default=0), "arrows_back_up": back,
            "module_circles": circles(code.arrows), "package_circles": circles(packages), "floor_of": floor}


def markdown(code: CodeMap) -> str:
    r = report(code)
    engine = sorted((m, n) for m, n in code.lines.items() if m.startswith("megatron.engine"))
    rows = [f"| `{p}` | {len(ms)} | {sum(code.lines[m] for m in ms)} | {r['floor_of'][p]} |"
            for p, ms in sorted(code.packages.items(), key=lambda kv: (-r["floor_of"][kv[0]], kv[0]))]
    out = [BEGIN, "", "Written by `tools/code_map.py --write docs/engine.md` from the code; do not edit by hand.", "",
           f"{r['modules']} modules, {r['lines']} lines in {r['packages']} packages on {r['floors']} floors; "
           f"{r['module_arrows']} import arrows between modules, {r['package_arrows']} between packages; "
           f"{r['arrows_back_up']} arrows run back up; import circles: "
           f"{len(r['module_circles'])} of modules, {len(r['package_circles'])} of packages"
           + "".join(f"; {', '.join(c)}" for c in r["module_circles"] + r["package_circles"]) + ".", "",
           f"![The import graph between packages, highest floor at the top]({FIGURE})", "",
           "| package | modules | lines | floor |", "|---|---|---|---|", *rows, "",
           "The engine's files:", "", "| module | lines |", "|---|---|",
           *[f"| `{m}` | {n} |" for m, n in engine], "", END]
    return "\n".join(out)


def draw(code: CodeMap, path: Path) -> None:
    """The package graph: one row per floor (highest at the top), an arrow per import."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    packages = code.package_arrows()
    floor, _ = floors(packages)
    rows: dict = {}
    for p in sorted(packages):
        rows.setdefault(floor[p], []).append(p)
    pos = {p: ((i + 1) / (len(ps) + 1), f) for f, ps in rows.items() for i, p in enumerate(ps)}
    fig, ax = plt.subplots(figsize=(14, 1.3 * (max(rows) + 1) + 1))
    for a, targets in packages.items():
        for b in targets:
            ax.annotate("", xy=pos[b], xytext=pos[a],
                        arrowprops=dict(arrowstyle="->", color="#999999", lw=0.7, shrinkA=14, shrinkB=14))
    for p, (x, y) in pos.items():
        ax.text(x, y, p.replace("megatron.", ""), ha="center", va="center", fontsize=9,
                bbox=dict(boxstyle="round", fc="#e8f0fe", ec="#4a6fa5"))
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.6, max(rows) + 0.6)
    ax.axis("off")
    ax.set_title("megatron/: imports between packages (floor 0 at the bottom)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write(doc: Path, code: CodeMap) -> None:
    text = doc.read_text()
    section = markdown(code)
    try:
        text = replace_section(text, BEGIN, END, section.removeprefix(BEGIN).removesuffix(END))
    except MissingSection:
        text = text.rstrip() + "\n\n## The code's shape\n\n" + section + "\n"
    doc.write_text(text)
    draw(code, doc.parent / FIGURE)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="DOC", help="refresh the marked section of this markdown file and its figure")
    args = parser.parse_args(argv)
    code = read()
    if args.write:
        write(Path(args.write), code)
    r = report(code)
    print(f"{r['modules']} modules, {r['lines']} lines, {r['packages']} packages on {r['floors']} floors, "
          f"{r['module_arrows']} module arrows, {r['package_arrows']} package arrows, "
          f"{r['arrows_back_up']} running back up")
    for group in r["module_circles"] + r["package_circles"]:
        print("import circle: " + ", ".join(group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
