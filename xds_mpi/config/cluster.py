"""The `cluster` section: many task executors (TEs) behind one job executor (JE) in one MPI job
(docs/cluster.md).

Part of the config schema (`xds_mpi.config.schema` re-exports it). `num_tes` 1 (the default) is
one TE, as every run was before; with N > 1 the job is one JE rank plus N copies of the TE the
rest of the config describes (its TE-shell and its dies), and the JE routes each request to a TE
by `policy` (a module of xds_mpi/cluster/policies/; what else the config must hold for a cluster
is `xds_mpi.plan.cluster`'s).
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.loader import positive, require


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """num_tes: how many TEs (1: no JE, the TE-shell serves the workload itself).
    policy: how the JE routes a request to a TE (xds_mpi/cluster/policies/: round_robin,
    least_load)."""

    num_tes: int = 1
    policy: str = "round_robin"

    def __post_init__(self) -> None:
        positive("cluster", num_tes=self.num_tes)
        require(bool(self.policy), "cluster.policy must name a routing policy, got ''")
