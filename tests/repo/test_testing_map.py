"""docs/testing.md's map stays current: its table of folders names every test module where it is
(a test file moved, added or removed without the map fails here), the modules and test files its
module -> tests map names exist, no folder holds more than 15 test modules and no two test
modules share a basename (pytest's default import mode needs it).

`python tests/repo/test_testing_map.py` prints both tables from the files as they are (the module
map from each test file's imports), to paste into docs/testing.md after a move."""

from __future__ import annotations

import ast
import collections
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
DOC = REPO / "docs" / "testing.md"
PACKAGES = ("launch", "ranks", "xds_mpi", "xccl")
MAX_PER_FOLDER = 15
# A module more test files import than this is listed with its count and the tests of its own
# folder only (xds_mpi/config/schema.py: nearly every test builds a Config).
MAX_LISTED = 10
# | `tests/unit/xccl/` | what | `test_layout.py`, `test_records.py` |
FOLDER_ROW = re.compile(r"^\| `tests/([\w/]+)/` \|[^|]*\| (.*) \|$", re.M)
# | `xccl/errors.py` | ... `unit/xccl/test_records.py`, `mpi/body_ep.py` |
MODULE_ROW = re.compile(r"^\| `((?:" + "|".join(PACKAGES) + r")/[\w/]+\.py)` \| (.*) \|$", re.M)


def _test_modules() -> list[Path]:
    """Every test module pytest collects under tests/, and the MPI bodies of tests/mpi/."""
    return sorted(
        p
        for p in TESTS.rglob("*.py")
        if p.name.startswith("test_") or (p.parent.name == "mpi" and p.name.startswith("body_"))
    )


def _folders() -> dict[str, list[str]]:
    out = collections.defaultdict(list)
    for p in _test_modules():
        out[str(p.parent.relative_to(TESTS))].append(p.name)
    return dict(out)


def _as_file(module: str) -> str | None:
    path = REPO.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return f"{path.relative_to(REPO)}/__init__.py"
    if path.with_suffix(".py").is_file():
        return f"{path.relative_to(REPO)}.py"
    return None


def _imported_files(path: Path) -> set[str]:
    """The project's files a test file imports (`from xccl import gmem` names xccl/gmem.py)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in PACKAGES:
                for alias in node.names:
                    out.add(_as_file(f"{node.module}.{alias.name}") or _as_file(node.module))
        elif isinstance(node, ast.Import):
            out |= {_as_file(a.name) for a in node.names if a.name.split(".")[0] in PACKAGES}
    return out - {None}


def module_map() -> dict[str, list[str]]:
    """Each module of the house that a test imports -> those tests (paths under tests/)."""
    out = collections.defaultdict(list)
    for test in _test_modules():
        for module in _imported_files(test):
            out[module].append(str(test.relative_to(TESTS)))
    return {m: sorted(out[m]) for m in sorted(out)}


def _own_folders(module: str) -> tuple[str, ...]:
    """The folders a module's own tests live in: xds_mpi/model/mla.py -> unit/xds_mpi/model/;
    xccl's protocols also in the MPI bodies (mpi/)."""
    parts = module.split("/")
    unit = "unit/" + "/".join(parts[:2] if parts[0] == "xds_mpi" else parts[:1]) + "/"
    return (unit, "mpi/") if parts[0] == "xccl" else (unit,)


def render_modules() -> str:
    rows = ["| module | test files (under tests/) that import it |", "|---|---|"]
    for module, tests in module_map().items():
        if len(tests) > MAX_LISTED:
            own = [t for t in tests if t.startswith(_own_folders(module))]
            cell = f"{len(tests)} test files" + (
                "; its own: " + ", ".join(f"`{t}`" for t in own) if own else ""
            )
        else:
            cell = ", ".join(f"`{t}`" for t in tests)
        rows.append(f"| `{module}` | {cell} |")
    return "\n".join(rows)


def render_folders() -> str:
    rows = ["| folder | what | test modules |", "|---|---|---|"]
    for folder, names in sorted(_folders().items()):
        rows.append(f"| `tests/{folder}/` | | {', '.join(f'`{n}`' for n in sorted(names))} |")
    return "\n".join(rows)


def _doc_folders() -> dict[str, list[str]]:
    return {
        folder: sorted(re.findall(r"`([\w.]+\.py)`", cell))
        for folder, cell in FOLDER_ROW.findall(DOC.read_text())
    }


def test_the_folder_table_names_every_test_module_where_it_is():
    actual = {f: sorted(n) for f, n in _folders().items()}
    documented = _doc_folders()
    missing = [
        f"tests/{f}/{n}" for f in actual for n in actual[f] if n not in documented.get(f, [])
    ]
    gone = [
        f"tests/{f}/{n}" for f in documented for n in documented[f] if n not in actual.get(f, [])
    ]
    assert not missing, "test modules docs/testing.md's folder table does not name:\n" + "\n".join(
        missing
    )
    assert not gone, "docs/testing.md names test modules that are not there:\n" + "\n".join(gone)


def test_the_module_map_names_files_that_exist():
    rows = MODULE_ROW.findall(DOC.read_text())
    assert len(rows) > 100, "docs/testing.md's module -> tests map is missing"
    dangling = [m for m, _ in rows if not (REPO / m).is_file()]
    for _, cell in rows:
        dangling += [t for t in re.findall(r"`([\w/]+\.py)`", cell) if not (TESTS / t).is_file()]
    assert not dangling, "\n".join(dangling)


def test_folders_stay_small_and_basenames_unique():
    big = {f: len(n) for f, n in _folders().items() if len(n) > MAX_PER_FOLDER}
    assert not big, f"folders over {MAX_PER_FOLDER} test modules: {big}"
    names = collections.Counter(p.name for p in _test_modules())
    assert not [n for n, c in names.items() if c > 1], names.most_common(3)


if __name__ == "__main__":
    sys.stdout.write(render_folders() + "\n\n" + render_modules() + "\n")
