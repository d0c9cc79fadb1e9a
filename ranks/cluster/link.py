"""The link of a cluster's TE-shell (docs/cluster.md): the communicator it shares with the JE
(JE 0, the TE-shell of TE k at k + 1) and its TE's index. launch/job/rank.py sets it before the
role program runs (a TE-shell's RankContext is its TE's, as if the TE were the world); None
outside a cluster and on every other rank."""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI


@dataclass(frozen=True, kw_only=True)
class ClusterLink:
    comm: MPI.Comm  # JE 0, the TE-shell of TE k at k + 1
    te: int  # this TE's index (-1: the JE)


_link: ClusterLink | None = None


def set_link(link: ClusterLink | None) -> None:
    global _link
    _link = link


def cluster_link() -> ClusterLink | None:
    return _link
