"""The node's memory against the job (`xds-mpi run`, `xds-mpi serve`): refuse before launch a
job whose ranks cannot fit on this node, stop a running job before the node runs out, and say
so when the kernel's OOM killer ended a process during the job. A Slurm job's script runs the
check before launch on each of its nodes (`python -m launch.job.memory_guard`, `main` below).

Hundreds of ranks on one node fail badly when memory runs out: the OOM killer ends one process
(a rank, mpiexec, or anything else on the node), and what the user sees is a rank "KILLED BY
SIGNAL: 9" and peers that wait out their timeouts. So:
- before launch, the job's least memory (every rank's process, RANK_FLOOR_MIB: a die measured
  38-44 MiB PSS, docs/scale.md) against what the node has available is refused with both
  numbers, before anything starts; its most (every window page touched too) only warned of;
- while the job runs (every second, beside the start-up count), available memory under the
  floor (the larger of FLOOR_MIB and FLOOR_SHARE of the node's) stops the job, with the
  numbers, before the OOM killer picks a process;
- after a failed job, a rise in the kernel's count of OOM kills (/proc/vmstat) is named.

"Available" is the kernel's MemAvailable, lowered to what the process's cgroups leave (limit
minus usage, less the inactive file cache they can drop): under Slurm a job's memory is its
allocation, not the node's. Only this node is seen: with --hosts the ranks are elsewhere, so
the launch check is skipped there and the watch guards the launcher's node alone.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from xds_mpi.config.schema import ConfigError

MIB = 1 << 20
RANK_FLOOR_MIB = 32  # below any rank measured (docs/scale.md)
FLOOR_MIB = 256  # a running job is stopped when less than this is left ...
FLOOR_SHARE = 0.02  # ... or less than this share of the node's memory, whichever is larger
_UNLIMITED = 1 << 60  # a cgroup limit at least this large is no limit
EXIT_OUT_OF_MEMORY = 3  # `xds-mpi run` / `serve`: the watch stopped the job


class NodeOutOfMemory(Exception):
    """The watch stopped the job: the node was about to run out of memory."""


@dataclass(frozen=True)
class NodeMemory:
    available_mib: float
    total_mib: float
    source: str  # "MemAvailable" or the cgroup whose limit binds

    def describe(self) -> str:
        return f"{gib(self.available_mib)} available of {gib(self.total_mib)} ({self.source})"


def gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"


def read_node_memory(proc: Path = Path("/proc"), cgroup_fs: Path = Path("/sys/fs/cgroup")):
    """This node's NodeMemory, or None where /proc/meminfo is missing (not Linux)."""
    try:
        info = _fields((proc / "meminfo").read_text())
    except OSError:
        return None
    if "MemAvailable" not in info or "MemTotal" not in info:
        return None
    best = NodeMemory(info["MemAvailable"] / 1024, info["MemTotal"] / 1024, "MemAvailable")
    for where, limit, used in _cgroup_limits(proc, cgroup_fs):
        left = max(0.0, (limit - used) / MIB)
        if left < best.available_mib:
            best = NodeMemory(left, min(limit / MIB, best.total_mib), f"cgroup {where}")
    return best


def _fields(text: str) -> dict[str, int]:
    """'Name: value [kB]' or 'name value' lines -> {name: value}."""
    out = {}
    for line in text.splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _cgroup_limits(proc: Path, cgroup_fs: Path):
    """(cgroup, limit bytes, usage bytes less droppable file cache) for this process's cgroup
    and each ancestor with a memory limit (v2 "0::/path", or v1's memory controller)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files = (cgroup_fs, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            files = (cgroup_fs / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                     "total_inactive_file")  # fmt: skip
        else:
            continue
        root, limit_file, usage_file, cache_key = files
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            where = root.joinpath(*parts[:depth])
            try:
                raw = (where / limit_file).read_text().strip()
                used = int((where / usage_file).read_text())
            except (OSError, ValueError):
                continue
            if raw == "max" or not raw.isdigit() or int(raw) >= _UNLIMITED:
                continue
            try:
                cache = _fields((where / "memory.stat").read_text()).get(cache_key, 0)
            except OSError:
                cache = 0
            yield "/" + "/".join(parts[:depth]), int(raw), used - cache


def oom_kills(proc: Path = Path("/proc")) -> int | None:
    """The kernel's count of processes its OOM killer ended since boot (None: not known)."""
    try:
        return _fields((proc / "vmstat").read_text()).get("oom_kill")
    except OSError:
        return None


LAUNCH_ADVICE = (
    "Run fewer ranks, spread them (--hosts, or Slurm: xds-mpi submit), or launch anyway with "
    "--no-memory-check"
)
SLURM_ADVICE = (
    "Spread the ranks over more nodes (xds-mpi submit --nodes N) or ask for more memory per "
    "node (xds-mpi submit --mem SIZE)"
)
LAUNCH_IF_LOW = "the job is stopped if the node runs low"  # the launcher's watch
SLURM_IF_LOW = "the job's cgroup ends a rank if they are"  # a Slurm job has no watch


def check_fits(
    num_ranks: int,
    window_bytes: int,
    memory: NodeMemory | None,
    *,
    node: str = "this node",
    advice: str = LAUNCH_ADVICE,
    if_low: str = LAUNCH_IF_LOW,
) -> str | None:
    """Before launch: ConfigError when `num_ranks` processes alone exceed what the node has;
    a warning (returned) when they would with every window page touched too; else None."""
    if memory is None:
        return None
    least = num_ranks * RANK_FLOOR_MIB
    most = least + window_bytes / MIB
    if least > memory.available_mib:
        raise ConfigError(
            f"{num_ranks} ranks need at least {gib(least)} on {node} ({RANK_FLOOR_MIB} MiB "
            f"a rank; a die measured 38-44 MiB) and it has {memory.describe()}: nothing was "
            f"launched. {advice}"
        )
    if most > memory.available_mib:
        return (
            f"xds-mpi: warning: {num_ranks} ranks need {gib(least)} to {gib(most)} on {node} "
            f"(up to {gib(window_bytes / MIB)} if every window page is touched) and it has "
            f"{memory.describe()}; {if_low}"
        )
    return None


def check_node(num_ranks: int, window_bytes: int) -> None:
    """check_fits against this node's memory now; its warning, if any, to stderr."""
    warning = check_fits(num_ranks, window_bytes, read_node_memory())
    if warning:
        print(warning, file=sys.stderr)


class MemoryWatch:
    """While the job runs: `poll` (about every second) raises NodeOutOfMemory when the node is
    about to run out; `after` names OOM kills that happened during the job."""

    def __init__(self, *, stops: bool = True, read=None, kills=None) -> None:
        """read, kills: read_node_memory and oom_kills unless given."""
        self.stops = stops
        self.read = read if read is not None else read_node_memory
        self.kills = kills if kills is not None else oom_kills
        self.kills_before = self.kills()
        self.lowest: NodeMemory | None = None

    def poll(self) -> None:
        memory = self.read()
        if memory is None:
            return
        if self.lowest is None or memory.available_mib < self.lowest.available_mib:
            self.lowest = memory
        floor = max(FLOOR_MIB, FLOOR_SHARE * memory.total_mib)
        if self.stops and memory.available_mib < floor:
            raise NodeOutOfMemory(
                f"the node is running out of memory ({memory.describe()}, under the "
                f"{floor:.0f} MiB floor): the job was stopped before the kernel's OOM killer "
                "picked a process. Run fewer ranks per node (--hosts, or Slurm: xds-mpi submit)"
            )

    def after(self) -> str | None:
        """After a failed job: the OOM kills during it, if the count rose."""
        now = self.kills()
        if now is None or self.kills_before is None or now <= self.kills_before:
            return None
        low = f"; the least available seen: {self.lowest.describe()}" if self.lowest else ""
        return (
            f"xds-mpi: error: the kernel's OOM killer ended {now - self.kills_before} "
            f"process(es) on this node during the job: the node ran out of memory{low}"
        )


def main(argv: list[str] | None = None) -> int:
    """A Slurm job's check before launch (hpc/xds-mpi.sbatch.in), one task on each node."""
    parser = argparse.ArgumentParser(
        prog="python -m launch.job.memory_guard",
        description="Before a Slurm job launches its ranks, on each node of its allocation (one "
        "task per node; SLURM_NODEID picks the node's entry): the ranks the node will run "
        "against what it and the job's cgroup leave. Exit 2 with both numbers when they cannot "
        "fit; a warning when they fit only while their windows are not touched to the last page.",
    )
    parser.add_argument(
        "--ranks-per-node", required=True, metavar='"N ..."', help="ranks on each node, in order"
    )
    parser.add_argument(
        "--window-mib-per-node",
        required=True,
        metavar='"MIB ..."',
        help="the windows of those ranks, in MiB, in the same order",
    )
    args = parser.parse_args(argv)
    host = socket.gethostname()
    try:
        ranks = [int(v) for v in args.ranks_per_node.split()]
        windows = [float(v) for v in args.window_mib_per_node.split()]
        index = int(os.environ.get("SLURM_NODEID", "0"))
    except ValueError as exc:
        parser.error(str(exc))
    if len(ranks) != len(windows) or not 0 <= index < len(ranks):
        parser.error(
            f"node {index} of {len(ranks)} ranks and {len(windows)} window entries: the lists "
            "need one entry per node of the allocation"
        )
    node = f"node {host}"
    try:
        warning = check_fits(
            ranks[index], int(windows[index] * MIB), read_node_memory(), node=node,
            advice=SLURM_ADVICE, if_low=SLURM_IF_LOW,
        )  # fmt: skip
    except ConfigError as exc:
        print(f"xds-mpi job: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if warning:
        print(warning.replace("xds-mpi:", "xds-mpi job:", 1), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
