"""The launcher's view of a start-up: how many ranks have loaded their code.

Before the TE-shell can log anything every rank imports numpy, mpi4py and the project (about
0.8 CPU-s each). With more ranks than cores that is the longest silence of a large run: 289
ranks of ep288 on 2 cores import for about 2.4 minutes before the TE-shell's first line. So each
rank, once its imports are done and before it joins a collective, drops an empty file named by
its rank into $XDS_STARTUP_DIR (a directory the launcher made on its own node; a rank on another
node finds no such directory and drops nothing), and the launcher counts them: a line every
EVERY_S seconds until all have loaded, then one line with the total. A start-up faster than
EVERY_S prints nothing.

Before launching, the launcher compiles the project's modules to bytecode once
(`compile_rank_code`): otherwise, wherever Python does not write bytecode itself
(PYTHONDONTWRITEBYTECODE set, as in many containers), every rank compiles the same ~150 modules
from source, about 0.15 CPU-s per rank. A read-only tree stays as it was: the ranks compile.
It also writes the compiled methods of the project's dataclasses (launch/job/dataclass_cache.py),
which no bytecode holds: ~0.1 CPU-s of every rank's imports.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STARTUP_ENV = "XDS_STARTUP_DIR"
RANK_STATS_ENV = "XDS_RANK_STATS"  # `xds-mpi bench serve`: each rank writes its MPI time there
EVERY_S = 5.0
CACHE_TIMEOUT_S = 120.0  # the dataclass cache's child: imports only, ~1 s
RANK_PACKAGES = ("launch", "ranks", "xccl", "xds_mpi")  # what a rank imports from the project


def compile_rank_code() -> None:
    """Write the bytecode of every project module a rank may import, where it is missing or
    stale, and the compiled methods of their dataclasses (launch/job/dataclass_cache.py), once for
    all ranks. Quiet; what cannot be written (a read-only tree) is left to the ranks, as before."""
    import compileall  # the launcher's alone: a rank imports this module for mark_loaded

    root = Path(__file__).resolve().parents[2]
    for package in RANK_PACKAGES:
        compileall.compile_dir(root / package, quiet=2)
    from launch.job import dataclass_cache

    if dataclass_cache.stale():  # a child imports what the ranks import, and writes their methods
        import subprocess

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
    from xds_mpi.model.checkpoint import weights_path
    from xds_mpi.model.unpacked import unpack
    from xds_mpi.model.weights import unpack_random

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
    """The config and its --set values resolved for the ranks (xds_mpi/config/resolved.py),
    written once per content under run.output_dir (relative to `workdir`, default: here); None
    where that cannot be written or holds a value JSON cannot (a line says which): the ranks
    then parse the YAML."""
    from xds_mpi.config.resolved import write_resolved

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


def mark_loaded(rank: int) -> None:
    """A rank's imports are done (called by launch/job/rank.py)."""
    where = os.environ.get(STARTUP_ENV)
    if where and os.path.isdir(where):
        Path(where, str(rank)).touch()


class StartupWatch:
    """Counts the ranks that have loaded their code and prints the count while some have not."""

    def __init__(self, world_size: int, *, every_s: float | None = None, out=print) -> None:
        self.world_size, self.out = world_size, out
        self.every_s = EVERY_S if every_s is None else every_s
        import tempfile  # the launcher's alone: a rank imports this module for mark_loaded

        self.dir = Path(tempfile.mkdtemp(prefix="xds-startup-"))
        self.started = time.monotonic()
        self.next_at = self.started + self.every_s
        self.has_spoken = self.is_done = False

    @property
    def env(self) -> dict[str, str]:
        return {STARTUP_ENV: str(self.dir)}

    def loaded(self) -> int:
        return sum(1 for _ in self.dir.iterdir()) if self.dir.is_dir() else 0

    def poll(self) -> None:
        """Print the count when due (call every second or so while the job runs)."""
        if self.is_done:
            return
        now = time.monotonic()
        num = self.loaded()
        if num >= self.world_size:
            self.is_done = True
            if self.has_spoken:
                self.out(
                    f"xds-mpi: start-up: all {self.world_size} ranks loaded their code in "
                    f"{now - self.started:.0f} s",
                    flush=True,
                )
        elif now >= self.next_at:
            self.has_spoken, self.next_at = True, now + self.every_s
            self.out(
                f"xds-mpi: start-up: {num} of {self.world_size} ranks have loaded their code "
                f"({now - self.started:.0f} s)",
                flush=True,
            )

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
