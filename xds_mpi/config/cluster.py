"""The `cluster` section: many task executors (TEs) behind one job executor (JE) in one MPI job
(docs/cluster.md).

Part of the config schema (`xds_mpi.config.schema` re-exports it). `num_tes` 1 (the default) is
one TE, as every run was before; with N > 1 the job is one JE rank plus N copies of the TE the
rest of the config describes (its TE-shell and its dies), and the JE routes each request to a TE
by `policy` (a module of xds_mpi/cluster/policies/; what else the config must hold for a cluster
is `xds_mpi.plan.cluster`'s).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xds_mpi.config.loader import build_record, positive, require

# Sections a TE group may not override: the JE's (the requests, the run) and the model every TE
# serves (the reference checks every request against one model).
JE_SECTIONS = (
    "model",
    "workload",
    "trace",
    "run",
    "serve",
    "cluster",
    "hardware",
    "emulator",
    "autoscaler",
)


@dataclass(frozen=True, kw_only=True)
class TeGroup:
    """count TEs alike: the rest of the config with these `section.key=value` overrides (a PD
    pair: `pd.enabled=true`, its prefill and decode dies, two host ranks, ...); name: how the
    group is named in logs and the run file ('' -> its kind); standby: its TEs start as
    pre-warmed standby TEs that serve only once the autoscaler scales out to them; pool (a
    standby group only): its TEs' TE-shells are launched (pre-warmed pods) but their dies are
    taken from `cluster.pool` at each scale-out and given back at the drain."""

    count: int = 1
    set: list = field(default_factory=list)
    name: str = ""
    standby: bool = False
    pool: bool = False


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
    unfinished tokens are within this share of the least loaded one's.
    groups: TEs of different kinds and shapes, rows {count, set, name} (`TeGroup`); num_tes is
    then their total count (1 or that total may be given). Empty: num_tes copies of the rest of
    the config.
    te_losses: rows {te, at_s} (`TeLoss`): TE `te` is lost whole at virtual time at_s (every die
    of it at once, e.g. its server); the JE finds it health.timeout_s + health.dp_interval_s
    later and routes its unfinished requests to the other TEs.
    num_jes: how many JEs route the requests (DeepServe's JEs each run their scheduling
    independently): the frontend deals the requests to them in arrival order, JE j the j-th of
    every num_jes; each routes its share to any TE by `policy` from its own view (its own
    requests' loads and prompt tree).
    pool: world ranks after the TEs that belong to no TE at launch: the dies of the `pool`
    groups' TEs, taken at a scale-out and given back at the drain (docs/cluster.md "A pool of
    ranks")."""

    num_tes: int = 1
    num_jes: int = 1
    policy: str = "round_robin"
    heatmap: str = ""
    predictor: str = "oracle"
    predictor_accuracy: float = 1.0
    balance_tolerance: float = 0.25
    groups: list = field(default_factory=list)
    te_losses: list = field(default_factory=list)
    pool: int = 0

    def __post_init__(self) -> None:
        groups = [_group(i, row) for i, row in enumerate(self.groups)]
        object.__setattr__(self, "groups", groups)
        if groups:
            total = sum(g.count for g in groups)
            require(
                self.num_tes in (1, total),
                f"cluster.num_tes({self.num_tes}) is not the groups' total count ({total})",
            )
            object.__setattr__(self, "num_tes", total)
        positive("cluster", num_tes=self.num_tes, num_jes=self.num_jes)
        require(self.pool >= 0, f"cluster.pool must be >= 0, got {self.pool}")
        losses = [_loss(i, row, self.num_tes) for i, row in enumerate(self.te_losses)]
        object.__setattr__(self, "te_losses", sorted(losses, key=lambda loss: loss.at_s))
        lost = {loss.te for loss in losses}
        require(
            len(lost) == len(losses),
            "cluster.te_losses: a TE is lost twice (one row per TE)",
        )
        require(
            not losses or len(lost) < self.num_tes,
            f"cluster.te_losses: every TE of {self.num_tes} is lost: none is left to serve "
            "their requests",
        )
        require(bool(self.policy), "cluster.policy must name a routing policy, got ''")
        require(
            0.0 <= self.predictor_accuracy <= 1.0,
            f"cluster.predictor_accuracy must be in [0, 1], got {self.predictor_accuracy}",
        )
        require(
            self.balance_tolerance >= 0.0,
            f"cluster.balance_tolerance must be >= 0, got {self.balance_tolerance}",
        )


@dataclass(frozen=True, kw_only=True)
class TeLoss:
    """TE `te` lost whole at virtual time `at_s` (docs/cluster.md "A lost TE")."""

    te: int
    at_s: float


def _loss(index: int, row, num_tes: int) -> TeLoss:
    where = f"cluster.te_losses[{index}]"
    loss = row if isinstance(row, TeLoss) else build_record(TeLoss, row, where)
    require(
        0 <= loss.te < num_tes and loss.at_s >= 0,
        f"{where}: te must be a TE (0..{num_tes - 1}) and at_s >= 0, got te={loss.te}, "
        f"at_s={loss.at_s}",
    )
    return loss


def _group(index: int, row) -> TeGroup:
    where = f"cluster.groups[{index}]"
    group = row if isinstance(row, TeGroup) else build_record(TeGroup, row, where)
    positive(where, count=group.count)
    require(
        group.standby or not group.pool,
        f"{where}: pool: true needs standby: true (a pool TE's dies come from cluster.pool at "
        "its scale-out; a TE serving from the start has its own)",
    )
    for text in group.set:
        require(
            isinstance(text, str) and "=" in text and "." in text.partition("=")[0],
            f"{where}.set: {text!r} is not section.key=value",
        )
        section = text.partition(".")[0].strip()
        require(
            section not in JE_SECTIONS,
            f"{where}.set: {text!r} sets {section}, which every TE shares (the JE's requests and "
            f"run, the one model): set it outside the groups",
        )
    return group
