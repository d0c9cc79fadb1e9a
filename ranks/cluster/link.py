"""The link of a cluster's TE-shell (docs/cluster.md): the communicator it shares with the JEs
(JE j at j, the TE-shell of TE k at J + k: `ClusterPlan.shell`) and its TE's index.
launch/job/rank.py sets it before the role program runs (a TE-shell's RankContext is its TE's,
as if the TE were the world); None outside a cluster and on every other rank."""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI


@dataclass(frozen=True, kw_only=True)
class ClusterLink:
    comm: MPI.Comm  # JE j at j, the TE-shell of TE k at num_jes + k
    te: int  # this TE's index (-1: a JE)
    num_jes: int = 1  # the JEs: link ranks 0..num_jes-1
    # a pool TE's TE-shell while its TE is formed (ranks/cluster/pool_shell.py PoolShell): the
    # JE-side state its TePacer takes on and hands back at the drain
    pool: object = None

    @property
    def jes(self) -> range:
        return range(self.num_jes)

    @property
    def rank(self) -> int:
        """This rank on the link: a JE's index, or num_jes + its TE."""
        return self.comm.rank


_link: ClusterLink | None = None


def set_link(link: ClusterLink | None) -> None:
    global _link
    _link = link


def cluster_link() -> ClusterLink | None:
    return _link
