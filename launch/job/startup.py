"""The launcher's view of a start-up: how many ranks have loaded their code.

Before the TE-shell can log anything every rank imports numpy, mpi4py and the project (about
0.8 CPU-s each). With more ranks than cores that is the longest silence of a large run: 289
ranks of ep288 on 2 cores import for about 2.4 minutes before the TE-shell's first line. So each
rank, once its imports are done and before it joins a collective, drops an empty file named by
its rank into $XDS_STARTUP_DIR (a directory the launcher made on its own node; a rank on another
node finds no such directory and drops nothing), and the launcher counts them: a line every
EVERY_S seconds until all have loaded, then one line with the total. A start-up faster than
EVERY_S prints nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

STARTUP_ENV = "XDS_STARTUP_DIR"
RANK_STATS_ENV = "XDS_RANK_STATS"  # `xds-mpi bench serve`: each rank writes its MPI time there
EVERY_S = 5.0


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
        import tempfile  # here: a measured start-up cost of every rank (mark_loaded's importer)

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
        import shutil  # here: a measured start-up cost of every rank (mark_loaded's importer)

        shutil.rmtree(self.dir, ignore_errors=True)
