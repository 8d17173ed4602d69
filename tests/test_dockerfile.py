"""The Dockerfile, checked without a Docker engine: what it copies exists and is in the build context,
it installs with exactly the README's install command, builds the C++ kernels, and runs as non-root."""
from __future__ import annotations

import glob
import json
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined."""
    out, pending = [], ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments may also sit between continuation lines: Docker drops them too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return out


def dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """(is_exception, regex) per .dockerignore line, Docker's syntax: paths relative to the context
    root, `*` and `?` within one path segment, `**` across segments, `!` re-includes."""
    patterns = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:].strip() if negate else line
        pattern = pattern.strip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        patterns.append((negate, re.compile(regex + r"\Z")))
    return patterns


def excluded(path: str, patterns) -> bool:
    """Whether Docker leaves `path` (relative, '/'-separated) out of the context: the last pattern
    matching it or one of its parent folders decides."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for negate, regex in patterns:
        if any(regex.match(p) for p in prefixes):
            result = not negate
    return result


def files_under(folder: Path) -> list[str] | None:
    """The repository's files in `folder`: git's list (tracked and not ignored) where there is one,
    else all but caches; None for the whole checkout without git, where build leftovers such as
    *.egg-info cannot be told from project files."""
    if (REPO / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                                 "--", str(folder.relative_to(REPO))], cwd=REPO, capture_output=True,
                                text=True)
        if listed.returncode == 0:
            return [f for f in listed.stdout.split("\0") if f and (REPO / f).exists()]
    if folder.resolve() == REPO:
        return None
    return [p.relative_to(REPO).as_posix() for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts]


def copy_sources() -> list[str]:
    sources = []
    for word, args in instructions():
        if word not in ("COPY", "ADD"):
            continue
        if args.startswith("["):
            words = json.loads(args)
        else:
            words = args.split()
        if any(w.startswith("--from") for w in words):
            continue  # from another stage or image, not the build context
        words = [w for w in words if not w.startswith("--")]
        assert len(words) >= 2, f"{word} {args}: needs a source and a destination"
        sources += words[:-1]
    return sources


def readme_install_command() -> str:
    """The first command in the fenced block right under README's `## Install` heading."""
    text = (REPO / "README.md").read_text()
    section = re.search(r"^## Install\s*\n\s*```[\w-]*\n(.*?)^```", text, re.M | re.S)
    assert section, "README.md needs a fenced block right under a `## Install` heading"
    lines = [ln.strip() for ln in section.group(1).splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    assert lines, "the README's Install block has no command"
    return lines[0]


def test_dockerignore_matcher_follows_docker_rules():
    patterns = [(False, re.compile(r"data\Z")), (False, re.compile(r"(?:.*/)?__pycache__\Z"))]
    assert excluded("data/demo/x.bin", patterns)
    assert not excluded("megatron/data/indexed.py", patterns)  # a bare name matches at the root only
    assert excluded("megatron/__pycache__/x.pyc", patterns)


def test_copied_paths_exist_and_are_in_the_build_context():
    patterns = dockerignore_patterns()
    sources = copy_sources()
    assert sources, "the Dockerfile copies nothing"
    for source in sources:
        assert not source.startswith(("/", "..")), f"COPY {source}: outside the build context"
        matches = glob.glob(str(REPO / source)) if glob.has_magic(source) else [str(REPO / source)]
        assert matches and all(Path(m).exists() for m in matches), f"COPY {source}: not in the repo"
        for match in map(Path, matches):
            rel = match.resolve().relative_to(REPO).as_posix()
            if rel != ".":
                assert not excluded(rel, patterns), f"COPY {source}: excluded by .dockerignore"
            if match.is_dir():  # a pattern may also drop files the image needs from inside it
                dropped = [f for f in files_under(match) or [] if excluded(f, patterns)]
                assert not dropped, f"COPY {source}: .dockerignore drops {dropped[:5]}"
    for must_stay_out in (".git", ".venv", "data", "checkpoints", "logs"):
        assert excluded(must_stay_out, patterns), f".dockerignore should exclude {must_stay_out}"


def test_installs_with_the_readme_command_only():
    command = readme_install_command()
    runs = [args for word, args in instructions() if word == "RUN"]
    assert any(command in run for run in runs), f"no RUN uses the README's install command {command!r}"
    for run in runs:
        assert not re.search(r"\bpip3?\s+install\b", run), f"a second install recipe: RUN {run}"
        assert "requirements" not in run, f"a second install recipe: RUN {run}"


def test_builds_cpp_kernels_into_a_fixed_cache():
    steps = instructions()
    build = [i for i, (word, args) in enumerate(steps)
             if word == "RUN" and "megatron.ops.quant build" in args]
    assert build, "no RUN builds the C++ kernels (python -m megatron.ops.quant build)"
    env_before = " ".join(args for word, args in steps[:build[0]] if word == "ENV")
    assert "TORCH_EXTENSIONS_DIR" in env_before, "set TORCH_EXTENSIONS_DIR before building the kernels"


def test_runs_as_non_root_with_a_default_command():
    steps = instructions()
    final = [i for i, (word, _) in enumerate(steps) if word in ("CMD", "ENTRYPOINT")]
    assert final, "no CMD/ENTRYPOINT"
    users = [args.split(":")[0] for word, args in steps[:final[0]] if word == "USER"]
    assert users and users[-1] not in ("root", "0"), f"the last USER before CMD is {users[-1:]}"
    cmd = " ".join(args for word, args in steps if word in ("CMD", "ENTRYPOINT"))
    assert "train.py" not in cmd, "the default command should not start a training run"


def test_base_image_is_a_rocm_default_and_overridable():
    steps = instructions()
    args = dict(a.split("=", 1) for word, a in steps if word == "ARG" and "=" in a)
    assert "rocm" in args.get("BASE_IMAGE", ""), "BASE_IMAGE's default should be a ROCm PyTorch image"
    froms = [a for word, a in steps if word == "FROM"]
    assert froms and re.match(r"\$\{?BASE_IMAGE\}?(\s|$)", froms[0]), f"FROM {froms[:1]} ignores BASE_IMAGE"
    first_from = next(i for i, (word, _) in enumerate(steps) if word == "FROM")
    assert any(w == "ARG" and a.startswith("BASE_IMAGE=") for w, a in steps[:first_from]), \
        "ARG BASE_IMAGE must come before FROM to be usable there"
