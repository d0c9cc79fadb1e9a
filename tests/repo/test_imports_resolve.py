"""Every import of the project's own modules resolves, function-level ones included: a module
moved or a name renamed fails here, not in the first run that reaches the function."""

from __future__ import annotations

import ast
import dataclasses
import importlib

from harness import REPO_ROOT

PACKAGES = ("xds_mpi", "xccl", "ranks", "launch")


def _imports():
    """(file:line, module, name or None) of every absolute import of a project module."""
    for path in sorted(REPO_ROOT.glob("**/*.py")):
        rel = path.relative_to(REPO_ROOT)
        if rel.parts[0] not in (*PACKAGES, "tests") or "__pycache__" in rel.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] in PACKAGES:
                    for alias in node.names:
                        yield f"{rel}:{node.lineno}", node.module, alias.name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PACKAGES:
                        yield f"{rel}:{node.lineno}", alias.name, None


def _resolves(module: str, name: str | None) -> bool:
    try:
        imported = importlib.import_module(module)
    except ImportError:
        return False
    if name is None or hasattr(imported, name):
        return True
    try:
        importlib.import_module(f"{module}.{name}")  # a submodule not yet imported
    except ImportError:
        return False
    return True


def test_every_project_import_resolves():
    """(Importing the rank entry turns on the dataclass cache for the whole process: put back.)"""
    had_exec = "exec" in vars(dataclasses)
    try:
        _every_import_resolves()
    finally:
        if not had_exec and "exec" in vars(dataclasses):
            del dataclasses.exec


def _every_import_resolves():
    found = list(_imports())
    assert len(found) > 500  # the walk saw the project
    broken = [f"{where}: {module} {name or ''}" for where, module, name in found]
    broken = [b for b, (_, m, n) in zip(broken, found) if not _resolves(m, n)]
    assert not broken, "\n".join(broken)


def test_a_moved_module_is_reported():
    assert not _resolves("xds_mpi.engine.scheduler", "DieScheduler")  # moved to scheduling/
    assert not _resolves("xds_mpi.plan.failures", "release_bound_s")  # in failures/loss.py
    assert _resolves("xds_mpi.plan.failures", "loss")
