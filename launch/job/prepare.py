"""What the launcher prepares once for all the ranks of a job, before it launches them.

Before launching, the launcher compiles the project's modules to bytecode once
(`compile_rank_code`): otherwise, wherever Python does not write bytecode itself
(PYTHONDONTWRITEBYTECODE set, as in many containers), every rank compiles the same ~150 modules
from source, about 0.15 CPU-s per rank. A read-only tree stays as it was: the ranks compile.
It also writes the compiled methods of the project's dataclasses (launch/job/dataclass_cache.py),
which no bytecode holds: ~0.1 CPU-s of every rank's imports.
"""

from __future__ import annotations

import compileall
import subprocess
import sys
from pathlib import Path

from launch.job import dataclass_cache
from xds_mpi.model.checkpoint import weights_path
from xds_mpi.model.unpacked import unpack
from xds_mpi.model.weights import unpack_random
from xds_mpi.plan.resolved import write_resolved

CACHE_TIMEOUT_S = 120.0  # the dataclass cache's child: imports only, far below (docs/scale.md)


def compile_rank_code() -> None:
    """Write the bytecode of every project module a rank may import, where it is missing or
    stale, and the compiled methods of their dataclasses (launch/job/dataclass_cache.py), once for
    all ranks. Quiet; what cannot be written (a read-only tree) is left to the ranks, as before."""
    root = dataclass_cache.ROOT
    for package in dataclass_cache.RANK_PACKAGES:
        compileall.compile_dir(root / package, quiet=2)
    if dataclass_cache.stale():  # a child imports what the ranks import, and writes their methods
        command = [sys.executable, "-m", "launch.job.dataclass_cache"]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        try:
            subprocess.run(command, cwd=root, timeout=CACHE_TIMEOUT_S, check=False, **quiet)
        except (OSError, subprocess.TimeoutExpired):
            pass  # the ranks compile them, as before


def unpack_weights(model, output_dir: str) -> None:
    """The tensors of `model` (its ModelConfig) as one flat file under `output_dir` for the dies
    to map (xds_mpi/model/unpacked.py), written once per version: a checkpoint's, which the
    dies then read without h5py, or random weights drawn once here instead of in every die.
    Where that cannot be written the dies read the HDF5 file or draw the weights, as before: a
    line says so."""
    is_random = model.weights == "random"
    try:
        if is_random:
            unpack_random(model, output_dir)
        else:
            unpack(output_dir, weights_path(model.weights))
    except OSError as exc:
        how = "draw the random weights" if is_random else f"read {model.weights} through h5py"
        print(f"xds-mpi: the dies {how} (no unpacked copy: {exc})")


def resolve_for_ranks(
    path: Path, overrides: list[str], cfg, workdir: Path | None = None
) -> Path | None:
    """The config and its --set values resolved for the ranks (xds_mpi/plan/resolved.py),
    written once per content under run.output_dir (relative to `workdir`, default: here); None
    where that cannot be written or holds a value JSON cannot (a line says which): the ranks
    then parse the YAML."""
    output_dir = Path(workdir or ".", cfg.run.output_dir)
    try:
        resolved = write_resolved(output_dir, path, overrides, cfg)
    except OSError as exc:
        resolved, why = None, str(exc)
    else:
        why = "a value JSON cannot hold"
    if resolved is None:
        print(f"xds-mpi: the ranks read {path} with PyYAML (no resolved copy: {why})")
    return resolved
