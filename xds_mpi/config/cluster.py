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
    policy: how the JE routes a request to a TE (a module of xds_mpi/cluster/policies/).
    heatmap: the file of a heatmap study (`xds-mpi heatmap`, xds_mpi/cluster/heatmap.py) that
    `pd_heatmap` and `combined` read ('' none).
    predictor: how the JE predicts a request's output length at its arrival
    (xds_mpi/cluster/predict.py): "oracle" (the true length, right with probability
    predictor_accuracy, else a neighbouring 128-token bucket) or the file of a trained model.
    balance_tolerance: `combined` deems the TEs' loads balanced when the most loaded one's
    unfinished tokens are within this share of the least loaded one's."""

    num_tes: int = 1
    policy: str = "round_robin"
    heatmap: str = ""
    predictor: str = "oracle"
    predictor_accuracy: float = 1.0
    balance_tolerance: float = 0.25

    def __post_init__(self) -> None:
        positive("cluster", num_tes=self.num_tes)
        require(bool(self.policy), "cluster.policy must name a routing policy, got ''")
        require(
            0.0 <= self.predictor_accuracy <= 1.0,
            f"cluster.predictor_accuracy must be in [0, 1], got {self.predictor_accuracy}",
        )
        require(
            self.balance_tolerance >= 0.0,
            f"cluster.balance_tolerance must be >= 0, got {self.balance_tolerance}",
        )
