"""The shared memory a job that did not end well leaves on its node, removed by the launcher.

The dies' windows on a node live in the MPI's shared-memory segments (MPICH:
/dev/shm/mpich_shm_*, one per window, as large as the node's windows together; Open MPI:
sm_segment.*). A job that ends normally frees them. One ended by a signal, a timeout, the memory
watch (launch/job/memory_guard.py) or a rank's crash leaves them behind, holding their pages until
someone removes them: ep288's windows are up to 10 GiB, which the next job then lacks. So after
such an end the launcher removes the segments that appeared while the job ran, belong to this
user and that no process has open or mapped, looking again for up to SETTLE_S at those still in
use (a rank mpiexec killed may still be exiting; a concurrent job's segments are mapped by its
ranks, so they stay).

A Slurm job (`xds-mpi submit`) has no launcher on its nodes: its script runs
`python -m launch.job.shm_leftovers --since START` on every node once the ranks are gone, however
they ended, and "appeared while the job ran" is then "changed at or after START".
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIXES = ("mpich_", "sm_segment.", "vader_segment.")  # MPICH's and Open MPI's segments
SETTLE_S = 2.0  # how long a new segment still in use is looked at again


class ShmLeftovers:
    """The MPI segments present when the job starts; `remove` takes away the new ones that no
    process uses any more."""

    def __init__(self, where: Path = SHM_DIR) -> None:
        self.where = where
        self.before = self._names()

    @classmethod
    def since(cls, started_s: float, where: Path = SHM_DIR) -> ShmLeftovers:
        """The leftovers of a job that started at `started_s` (seconds since the epoch) with no
        launcher there to list the segments before it: those changed earlier count as before."""
        leftovers = cls(where)
        leftovers.before = {n for n in leftovers.before if _changed_s(where / n) < started_s}
        return leftovers

    def _names(self) -> set[str]:
        try:
            return {p.name for p in self.where.iterdir() if p.name.startswith(PREFIXES)}
        except OSError:
            return set()

    def remove(self, settle_s: float = SETTLE_S) -> tuple[int, int]:
        """(segments removed, bytes they held). A new segment still in use is looked at again
        for up to `settle_s`: a rank that mpiexec has killed may still be exiting."""
        removed = held = 0
        deadline = time.monotonic() + settle_s
        while True:
            new = self._names() - self.before
            if not new:
                break
            in_use = paths_in_use(self.where)
            for name in sorted(new):
                path = self.where / name
                try:
                    stat = path.stat()
                    if stat.st_uid != os.getuid():
                        self.before.add(name)  # not ours: never ours to remove
                        continue
                    if str(path) in in_use:
                        continue
                    path.unlink()
                except OSError:
                    continue
                removed, held = removed + 1, held + stat.st_blocks * 512
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        return removed, held

    def remove_and_say(self, say=None) -> None:
        """remove(), and one line through `say` (default: stderr) when something was removed."""
        removed, held = self.remove()
        if removed:
            say = say or (lambda line: print(line, file=sys.stderr, flush=True))
            say(
                f"xds-mpi: removed {removed} shared-memory segment(s) the job left in "
                f"{self.where} ({held / (1 << 20):.1f} MiB)"
            )


def paths_in_use(where: Path, proc: Path = Path("/proc")) -> set[str]:
    """Files under `where` that a process (one /proc lets us read) has mapped or open."""
    prefix = f"{where}/"
    used: set[str] = set()
    for pid in proc.glob("[0-9]*"):
        try:
            for line in (pid / "maps").read_text().splitlines():
                at = line.find(prefix)
                if at >= 0:
                    used.add(line[at:].removesuffix(" (deleted)"))
            for fd in (pid / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target)
        except OSError:
            continue  # gone meanwhile, or not ours
    return used


def _changed_s(path: Path) -> float:
    try:
        return path.stat().st_ctime
    except OSError:
        return 0.0  # gone: never removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.job.shm_leftovers",
        description="Remove the MPI shared-memory segments in /dev/shm that a job which started "
        "at --since left on this node: ours, changed since then, and open or mapped by no "
        "process (a Slurm job script runs this on each of its nodes after its ranks).",
    )
    parser.add_argument(
        "--since",
        type=float,
        required=True,
        metavar="SECONDS",
        help="when the job started, in seconds since the epoch (`date +%%s`)",
    )
    parser.add_argument("--dir", type=Path, default=SHM_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    host = socket.gethostname()
    ShmLeftovers.since(args.since, args.dir).remove_and_say(
        lambda line: print(f"{line} on {host}", flush=True)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
