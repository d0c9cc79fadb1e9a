"""Every repository path the project's text names exists: in docs/ and the README (code spans,
links and prose), and in the comments and strings of the code. A moved or renamed file leaves
no reference behind, and no text cites a file outside the repository."""

from __future__ import annotations

import ast
import glob
import io
import re
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOP = ("xds_mpi", "xccl", "ranks", "launch", "tests", "configs", "hpc", "docs", ".ci")
# a path from the repository's root: a top-level folder, then path characters (globs and brace
# alternatives included: `tests/mpi/body_faults_{ep,afd}.py`, `configs/hardware/*.yaml`)
ROOTED = re.compile(r"(?<![\w./-])((?:" + "|".join(map(re.escape, TOP)) + r")/[\w./*{},-]*[\w*}])")
# a file named without its folder: `scale_down.py`, `MPI_NOTES.md`
BARE = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.(?:py|md|yaml|sh))\b")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # markdown links: [text](path#anchor)
# Names that are not this repository's files: generated per run, or named only as examples.
NOT_OURS = re.compile(r"<|FILE|\.\.\.|runs/|\.h5$|/$|\{\w+\}")


def _text_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _code_files() -> list[Path]:
    return [
        p
        for top in ("xds_mpi", "xccl", "ranks", "launch", "tests", "hpc")
        for p in sorted((REPO / top).rglob("*"))
        if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts and p.name != SELF
    ]


SELF = Path(__file__).name  # its own docstrings name files that do not exist, on purpose


def _prose(path: Path) -> str:
    """The words of a file that may name other files: all of a text, a script's lines, a
    Python file's comments and docstrings (its code names modules, which imports check, and
    the files its tests write)."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    comments = [t.string for t in tokens if t.type == tokenize.COMMENT]
    nodes = [n for n in ast.walk(ast.parse(text)) if isinstance(n, DOCUMENTED)]
    docstrings = [doc for n in nodes if (doc := ast.get_docstring(n, clean=False))]
    return "\n".join(comments + docstrings)


DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _expand(name: str) -> list[str]:
    """`a_{x,y}.py` -> [a_x.py, a_y.py]."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", name)
    if not match:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    return [e for alt in match.group(1).split(",") for e in _expand(head + alt + tail)]


def _exists(name: str, base: Path) -> bool:
    name = name.rstrip(".,")
    for candidate in _expand(name):
        for root in (REPO, base):
            if glob.glob(str(root / candidate)) or (root / candidate.rstrip("/")).exists():
                return True
        # a module path with its suffix left off, or an object in it after a dot
        # (`ranks/core/decode_die`, `ranks/core/decode_die.DecodeDieLoop.step`)
        parts = candidate.split(".")
        if any((REPO / f"{'.'.join(parts[:i])}.py").exists() for i in range(1, len(parts) + 1)):
            return True
    return False


def _basenames() -> set[str]:
    return {
        p.name
        for p in REPO.rglob("*")
        if ".git" not in p.parts and "__pycache__" not in p.parts and ".venv" not in p.parts
    }


def dangling_references() -> list[str]:
    """'file: name' for each name of a repository file that does not exist."""
    names, out = _basenames(), []
    for path in _text_files() + _code_files():
        prose, rel = _prose(path), path.relative_to(REPO)
        found = set(ROOTED.findall(prose))
        if path.suffix == ".md":
            found |= {
                link
                for link in LINK.findall(prose)
                if "://" not in link and not link.startswith("mailto:")
            }
        for name in sorted(found):
            if not NOT_OURS.search(name) and not _exists(name, path.parent):
                out.append(f"{rel}: {name}")
        for name in sorted(set(BARE.findall(prose)) - found):
            if name not in names and not NOT_OURS.search(name):
                out.append(f"{rel}: {name}")
    return out


def test_every_repository_path_named_in_text_exists():
    dangling = dangling_references()
    assert not dangling, f"{len(dangling)} dangling references:\n" + "\n".join(dangling)


def test_no_text_cites_a_file_outside_the_repository():
    """The project's own words stand alone: no text points at the design notes and sources kept
    beside a checkout. (The public trace a replay reads is data, named where a command needs it.)"""
    outside = re.compile(
        r"\b(?:DESIGN|STYLE|MPI_NOTES|SLURM_NOTES|LOADGEN_NOTES)\.md|\.\./shared/(?!traces/)"
    )
    cited = [
        f"{path.relative_to(REPO)}: {m.group(0)}"
        for path in _text_files() + _code_files()
        for m in outside.finditer(_prose(path))
    ]
    assert not cited, "\n".join(cited)


def test_the_scan_finds_a_dangling_name(tmp_path, monkeypatch):
    """The scan can fail: a doc naming a file that does not exist is reported."""
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text("See `ranks/core/no_such_file.py`, [gone](gone.md) and `nowhere_module.py`.")
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "_text_files", lambda: [doc])
    monkeypatch.setattr(this, "_code_files", lambda: [])
    monkeypatch.setattr(this, "REPO", tmp_path)
    assert dangling_references() == [
        "docs/x.md: gone.md",
        "docs/x.md: ranks/core/no_such_file.py",
        "docs/x.md: nowhere_module.py",
    ]
