"""The launcher's side of the dataclass cache (xds_mpi/config/dataclass_cache.py, which a rank
turns on): written once for every rank, in a child process that imports what the ranks import,
and rewritten when a project source is newer than it.
"""

from __future__ import annotations

import dataclasses
import importlib
import marshal
import os
import sys
from pathlib import Path

import mpi4py

from xds_mpi.config.dataclass_cache import CACHE, CachedExec

ROOT = Path(__file__).resolve().parents[2]
RANK_PACKAGES = ("launch", "ranks", "xccl", "xds_mpi")  # what a rank imports from the project


def stale(path: Path = CACHE, packages: tuple[str, ...] = ()) -> bool:
    """Is `path` missing or older than a source file of `packages` (default: a rank's)?"""
    try:
        written = path.stat().st_mtime
    except OSError:
        return True
    for package in packages or RANK_PACKAGES:
        for dirpath, _, files in os.walk(ROOT / package):
            for name in files:
                if name.endswith(".py") and os.stat(os.path.join(dirpath, name)).st_mtime > written:
                    return True
    return False


def rank_modules() -> list[str]:
    """What the ranks import: the rank entry, every role's program (ranks/__init__.py) and every
    module of xccl/, most of which a die imports while it builds its buffers."""
    # here, in the child alone: ranks/ starts MPI and defines the dataclasses it records
    from ranks import ROLE_PROGRAMS

    names = ["launch.job.rank"]
    names += [program.split(":")[0] for programs in ROLE_PROGRAMS.values() for program in programs]
    for file in sorted((ROOT / "xccl").rglob("*.py")):
        parts = file.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def write_cache(path: Path = CACHE) -> None:
    """In a child process (`python -m launch.job.dataclass_cache [PATH]`): import what the ranks
    import (`rank_modules`), recording each dataclass method compiled, and write them
    to `path` (through a temporary file, so that a rank never reads half of one)."""
    mpi4py.rc.initialize = False  # only the imports: no MPI job here
    recording = CachedExec({}, record=True)
    dataclasses.exec = recording
    for name in rank_modules():
        importlib.import_module(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_bytes(marshal.dumps(recording.codes))
    os.replace(partial, path)


if __name__ == "__main__":
    write_cache(Path(sys.argv[1]) if len(sys.argv) > 1 else CACHE)
