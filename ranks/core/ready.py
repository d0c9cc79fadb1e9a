"""Start-up progress: every rank but 0 tells rank 0 once its role is built (windows, model,
buffers), with what its start-up cost it; rank 0 waits for all of them, saying how many are
ready while it waits, so that a large run is never silent between the handshake and its first
iteration."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from mpi4py import MPI

from ranks.core.control import recv_from_each
from ranks.core.tags import TAG_READY
from xds_mpi.config.dataclass_cache import release as release_dataclass_cache


@dataclass(frozen=True, kw_only=True)
class Ready:
    """One rank's start-up: cpu_s, CPU seconds this process spent from its start (imports
    included) until its role was built; pss_mib, its proportional set size then (shared pages
    counted once across the processes that share them; None where /proc cannot tell)."""

    cpu_s: float
    pss_mib: float | None


def pss_mib() -> float | None:
    """This process's PSS in MiB, from /proc/self/smaps_rollup (None off Linux)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def report_ready(comm: MPI.Comm) -> None:
    """Any rank but 0, once built: tell rank 0 (a small message: the send returns at once).
    Start-up is over, so the dataclass cache goes (xds_mpi/config/dataclass_cache.py)."""
    release_dataclass_cache()
    times = os.times()
    comm.send(Ready(cpu_s=times.user + times.system, pss_mib=pss_mib()), dest=0, tag=TAG_READY)


def await_ready(comm: MPI.Comm, log: logging.Logger, *, started: float, timeout_s: float) -> dict:
    """Rank 0: every other rank's Ready, a progress line every few seconds while some are still
    building, then one line with the start-up numbers. `started`: time.perf_counter() when this
    rank began (the line's seconds count from it)."""
    ready = recv_from_each(
        comm,
        range(1, comm.size),
        tag=TAG_READY,
        timeout_s=timeout_s,
        me="TE-shell",
        event="start-up: ranks ready",
        log=log,
    )
    log.info(describe(ready, time.perf_counter() - started))
    release_dataclass_cache()  # the TE-shell's start-up is over too
    return ready


def describe(ready: dict, elapsed_s: float) -> str:
    """The start-up line: ranks, seconds, CPU seconds and PSS per rank (median, max), in all."""
    import statistics  # the TE-shell's alone: a start-up cost of every die otherwise

    cpu = [r.cpu_s for r in ready.values()]
    line = f"start-up: all {len(ready)} ranks ready in {elapsed_s:.1f} s"
    if cpu:
        line += f"; CPU per rank median {statistics.median(cpu):.2f} s, max {max(cpu):.2f} s"
    pss = [r.pss_mib for r in ready.values() if r.pss_mib is not None]
    if pss:
        line += (
            f"; PSS per rank median {statistics.median(pss):.0f} MiB, max {max(pss):.0f} MiB, "
            f"{sum(pss) / 1024:.2f} GiB in all"
        )
    return line
