"""The expert dies' measured load (xds_mpi/afd/load.py) on its way to the TE-shell: each
expert die sends its `ExpertLoad` once at the end, after its trace; the TE-shell takes them after
the traces and writes /afd_load in the run file (docs/afd_analysis.md reads it)."""

from __future__ import annotations

from mpi4py import MPI

from ranks.core.control import recv_from_each, send_to_each
from ranks.core.messages import SHELL
from ranks.core.tags import TAG_AFD_LOAD
from xds_mpi.afd.load import ExpertLoad


def send_load(comm: MPI.Comm, load: ExpertLoad, *, timeout_s: float) -> None:
    send_to_each(
        comm, {SHELL: load}, tag=TAG_AFD_LOAD, timeout_s=timeout_s, me=f"rank {comm.rank}",
        event="expert load",
    )  # fmt: skip


def gather_loads(
    comm: MPI.Comm, topo, *, timeout_s: float, skip: tuple[int, ...] = ()
) -> dict[int, ExpertLoad]:
    """Every expert die's load but those of `skip` (lost dies), by rank ({} without expert
    dies)."""
    return recv_from_each(
        comm,
        [r for r in topo.ranks_with_role("expert") if r not in skip],
        tag=TAG_AFD_LOAD,
        timeout_s=timeout_s,
        me="TE-shell",
        event="expert load",
    )
