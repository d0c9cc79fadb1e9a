"""The README's and docs/ pages' examples cannot rot silently.

Every `xds-mpi validate ...` command in a fenced code block runs as written; every `xds-mpi run ...`
command's config and options pass `xds-mpi validate` (the same DeploymentPlan.build the run
would call before launch; run-only flags such as --check become what they set). Every relative
link points at an existing file, and at an existing heading when it names one.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from harness import REPO_ROOT

from launch.cli.main import main

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# `xds-mpi run` flags that `validate` does not take: dropped, or replaced by what they set.
RUN_ONLY = {"--check": ["--set", "run.check=true"], "--dry-run": []}
RUN_ONLY_WITH_VALUE = ("--mpiexec", "--hosts")


def doc_commands() -> list[tuple[str, list[str]]]:
    """(page: the command as written, its argv after `xds-mpi`) of every xds-mpi validate/run
    command in a code block; synopsis lines (`[CONFIG]`, `[--set ...]`) are not examples."""
    found = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                for part in line.split("&&"):
                    if not re.search(r"\bxds-mpi (validate|run)\b", part):
                        continue  # output shown in a block, other commands
                    part = re.sub(r"^\s*(\w+=(\$\([^)]*\)|\S+)\s+)+", "", part)  # VAR=value
                    argv = shlex.split(part, comments=True)
                    if argv[:1] != ["xds-mpi"] or argv[1:2] not in (["validate"], ["run"]):
                        continue
                    if any(arg.startswith("[") for arg in argv):
                        continue
                    found.append((f"{page.relative_to(REPO_ROOT)}: {part.strip()}", argv[1:]))
    return found


def as_validate(argv: list[str]) -> list[str]:
    """`run CONFIG ARGS` -> `validate CONFIG ARGS` with the run-only flags translated."""
    out, args = ["validate", "--brief"], iter(argv[1:])
    for arg in args:
        if arg in RUN_ONLY:
            out += RUN_ONLY[arg]
        elif arg in RUN_ONLY_WITH_VALUE:
            next(args)
        elif not arg.startswith(RUN_ONLY_WITH_VALUE):  # --hosts=H1,H2
            out.append(arg)
    return out


COMMANDS = doc_commands()


def test_the_pages_hold_examples_of_both_commands():
    kinds = [argv[0] for _, argv in COMMANDS]
    assert kinds.count("validate") >= 2 and kinds.count("run") >= 10, COMMANDS


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_every_documented_command_validates(where, argv, capsys, monkeypatch):
    if "../shared/" in where and not (REPO_ROOT.parent / "shared").is_dir():
        pytest.skip("names a data file in ../shared (docs/trace.md), absent here")
    monkeypatch.chdir(REPO_ROOT)  # the examples name configs and paths from the repository
    code = main(as_validate(argv))
    out = capsys.readouterr()
    assert code == 0, f"{where}\n{out.err}"
    assert "valid" in out.out


def github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())  # a `# comment` in a code block is no heading
    return {github_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_points_at_an_existing_file(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)
