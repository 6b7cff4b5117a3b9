"""The docs name what exists: every `python -m gpt_tp.X` / `benchmarks.X` module, every repository path, every test a
row cites; docs/structure.md lists every file of the package, benchmarks, tests, scripts and configs; the package
imports only downward (base -> model -> sizing -> parallel -> data -> train -> eval) and never benchmarks/, which
may import the package."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the rooms, lowest first, as docs/structure.md's first block draws them: "base (gpt_tp/*.py) -> model -> ..."
FLOORS = [r.split()[0] for r in re.search(r"```\n(.*?)```", (ROOT / "docs" / "structure.md").read_text(), re.S)[1].split("->")]
TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest -q -n 2"


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def named_modules(doc: str) -> set[str]:
    return set(re.findall(r"-m ((?:gpt_tp|benchmarks)(?:\.\w+)+)", doc))


def named_paths(doc: str) -> set[str]:
    """Repository paths a page names: under gpt_tp/, tests/, scripts/, configs/, docs/, data/sample/, .ci/, and cli.py;
    a test id's `::name[param]` is cut off; patterns (`*`, `<`, `{`, `N`) are left out."""
    found = set()
    for m in re.finditer(r"(?<![\w./-])((?:gpt_tp|benchmarks|tests|scripts|configs|docs|data/sample|\.ci)/[\w./-]*|cli\.py)", doc):
        path = m.group(1).rstrip(".")
        if re.search(r"[*<{]", doc[m.end() : m.end() + 1]) or path.endswith(("_", "-")):
            continue
        found.add(path)
    return found


def cited_tests(doc: str) -> set[tuple[str, str]]:
    return set(re.findall(r"(tests/test_\w+\.py)::(\w+)", doc))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_modules_paths_and_tests_exist(doc):
    body = text(doc)
    for module in named_modules(body):
        parts = module.split(".")
        assert (ROOT.joinpath(*parts).with_suffix(".py")).is_file(), f"{doc.name}: python -m {module}: no such module"
    for path in named_paths(body):
        assert (ROOT / path).exists(), f"{doc.name}: {path}: no such file or folder"
    for path, name in cited_tests(body):
        assert re.search(rf"^def {name}\(", text(ROOT / path), re.M), f"{doc.name}: {path}::{name}: no such test"


def test_readme_quick_start_and_length():
    readme = text(ROOT / "README.md")
    assert "bash scripts/setup.sh && .venv/bin/python cli.py fit --config configs/cpu.yaml" in readme
    assert TEST_COMMAND in readme and TEST_COMMAND in text(ROOT / ".ci" / "run")  # the CI runs the README's line
    assert len(readme.splitlines()) <= 180


def structure_files() -> set[str]:
    """The files docs/structure.md's trees list: two spaces of indent a level; a name ending in / opens a folder."""
    files, blocks = set(), re.findall(r"```\n(.*?)```", text(ROOT / "docs" / "structure.md"), re.S)
    for block in blocks[1:]:  # the first block draws the floors
        stack = []  # (indent, folder)
        for line in block.splitlines():
            if not line.strip():
                continue
            indent, name = len(line) - len(line.lstrip()), line.split()[0]
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = "".join(folder for _, folder in stack) + name
            if name.endswith("/"):
                stack.append((indent, name))
            else:
                files.add(path)
    return files


def repository_files() -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files", "gpt_tp", "benchmarks", "tests", "scripts", "configs"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return set(out.split())


def test_structure_lists_every_file():
    listed, tracked = structure_files(), repository_files()
    assert sorted(p for p in listed if not (ROOT / p).exists()) == [], "docs/structure.md lists files that do not exist"
    assert sorted(tracked - listed) == [], "files missing from docs/structure.md"


def floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else 0


def imports(path: Path) -> list[str]:
    """The modules a file imports, at any depth (function-level imports too)."""
    names = []
    for node in ast.walk(ast.parse(text(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def test_imports_go_only_downward():
    wrong = []
    rooms = {p.name for p in (ROOT / "gpt_tp").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(FLOORS[1:]), "a room of gpt_tp/ missing from FLOORS, or a floor without its room"
    for path in sorted((ROOT / "gpt_tp").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        here = floor(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
        for name in imports(path):
            if name.startswith("gpt_tp") and floor(name) > here:
                wrong.append(f"{rel}.py imports {name} ({FLOORS[here]} -> {FLOORS[floor(name)]})")
            if name.split(".")[0] in ("benchmarks", "tests"):
                wrong.append(f"{rel}.py imports {name}: the package never imports what stands beside it")
    assert wrong == []


def test_files_and_rooms_stay_small():
    """No file of the package over 350 lines, no room over 30% of it (docs/structure.md): a room that grows past
    that holds two jobs."""
    lines = {p: len(text(p).splitlines()) for p in (ROOT / "gpt_tp").rglob("*.py")}
    assert {str(p.relative_to(ROOT)): n for p, n in lines.items() if n > 350} == {}
    total = sum(lines.values())
    rooms = {r: sum(n for p, n in lines.items() if p.parent.name == r) for r in FLOORS[1:]}
    assert {r: f"{n / total:.0%}" for r, n in rooms.items() if n > 0.30 * total} == {}


def test_benchmarks_stand_beside_the_package():
    """benchmarks/ uses the package (and its own modules); the package is importable without it."""
    used = {name.split(".")[0] for path in (ROOT / "benchmarks").glob("*.py") for name in imports(path)}
    assert "gpt_tp" in used and "tests" not in used


def test_scale_md_states_modelparallels_process_group_timeout():
    """docs/scale.md's "bound" row: the timeout gpt_tp.checkpoint.ModelParallel passes to gloo and to NCCL alike."""
    import inspect
    from datetime import timedelta

    from gpt_tp.checkpoint import ModelParallel

    assert inspect.signature(ModelParallel.__init__).parameters["timeout"].default == timedelta(minutes=30)
    row = next(line for line in text(ROOT / "docs" / "scale.md").splitlines() if line.startswith("| bound |"))
    assert row.count("(default 30 min)") == 2 and "10 min" not in row


def test_files_sharing_a_session_run_are_one_work_unit():
    """`-n 2`'s work units (conftest.work_units): a session run's files go to one worker, linked through the runs their
    tests take (test_ac.py takes lightning_runs only, test_muon.py parity_runs only, test_tp_parity.py both); any other
    file, this one too (it names them only in text), is a unit of its own."""
    from conftest import work_units

    units = work_units()
    assert units["tests/test_ac.py"] == units["tests/test_muon.py"] == units["tests/test_tp_parity.py"] == units["tests/test_ddp.py"]
    assert units["tests/test_multinode.py"] == units["tests/test_slurm.py"] != units["tests/test_ac.py"]
    assert units["tests/test_docs.py"] == "tests/test_docs.py" and units["tests/test_model.py"] == "tests/test_model.py"
