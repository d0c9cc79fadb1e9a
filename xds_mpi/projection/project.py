"""Analytic projection of one decode iteration on the pod (what `xds-mpi project` prints).

An iteration is FlowServe's (xDeepServe §4.6, Figure 20): with MTP depth d, d MTP passes over
the batch, then the main model over batch x (1 + d) rows, sampling after each, plus the scheduling
bubble where the execution has one (xDeepServe §7.1: "the scheduling bubble between iterations
adds around 2 ms"; CloudMatrix-Infer §4.2.4 runs its graphs back to back and states none) and
one graph launch per pass unless the graphs are pipelined (CloudMatrix-Infer §4.2.4).
Layers are sequential; within a layer the slowest die sets the pace (dispatch and combine are
barriers): `imbalance` (xds_mpi/projection/imbalance.py) says how far the slowest attention and
expert dies
are above the mean. The layers themselves are priced in xds_mpi/projection/layers.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xds_mpi.config.schema import Config, ModelConfig
from xds_mpi.plan.topology import Topology
from xds_mpi.projection.cost import CostModel, Hardware
from xds_mpi.projection.imbalance import Imbalance
from xds_mpi.projection.layers import LayerInputs, afd_layer, colocated_layer, counts


@dataclass(frozen=True, kw_only=True)
class Projection:
    iteration_s: float
    tpot_s: float
    tokens_per_s_per_chip: float
    breakdown_s: dict = field(default_factory=dict)  # operation -> seconds per iteration
    primitives_s: dict = field(default_factory=dict)  # one call of each primitive (one layer)
    parts_s: dict = field(default_factory=dict)  # primitive -> {its parts: seconds} (one layer)


@dataclass(frozen=True, kw_only=True)
class Execution:
    """How the dies run a layer: microbatches = 2 is the colocated two-stream overlap
    (CloudMatrix-Infer §4.2.3; afd deployments take their own microbatches); pipelined_graphs:
    graph launches hidden behind the previous graph (CloudMatrix-Infer §4.2.4); stream0_aic: the
    AIC of the attention stream where the paper states the split (§4.2.3: 16 of 24 at 4K, batch
    96, MTP), None: the split that balances the two streams (§4.2.3: "adjusted adaptively");
    scheduling_bubble: the host's gap between iterations is paid (the profile's
    serving.scheduler_bubble_ms, xDeepServe §7.1); False where a source says the graphs run
    back to back."""

    microbatches: int = 1
    pipelined_graphs: bool = False
    stream0_aic: int | None = None
    scheduling_bubble: bool = True


UNIFORM = Imbalance()
SEQUENTIAL = Execution()


def project(
    cfg: Config,
    m: ModelConfig,
    hw: Hardware,
    *,
    batch_per_die: float,
    kv_len: float,
    mtp_depth: int = 0,
    accept_rate: float = 0.0,
    imbalance: Imbalance = UNIFORM,
    execution: Execution = SEQUENTIAL,
    redundant_dies: int = 0,
) -> Projection:
    """batch_per_die: mean requests per DP group; kv_len: mean KV length; accept_rate: MTP;
    redundant_dies: as xds_mpi/projection/layers.py `counts` takes them."""
    topo = Topology.from_config(cfg)
    cost, n = CostModel(m, hw), counts(cfg, topo, redundant_dies=redundant_dies)
    layer = afd_layer if cfg.deployment.kind == "afd" else colocated_layer
    inputs = dict(
        cfg=cfg, cost=cost, n=n, batch=batch_per_die, kv_len=kv_len, imbalance=imbalance,
        microbatches=execution.microbatches, stream0_aic=execution.stream0_aic,
    )  # fmt: skip
    spent = _passes_spent(cost, layer, inputs, mtp_depth=mtp_depth)
    rows = slowest_batch(batch_per_die, imbalance) * (1 + mtp_depth)
    spent["head + sampling"] = cost.head(rows) + cost.sampling(rows)
    if not execution.pipelined_graphs:
        spent["graph launch"] = hw.graph_launch_s * (1 + (mtp_depth if m.num_mtp_modules else 0))
    if execution.scheduling_bubble:
        spent["scheduling bubble"] = hw.bubble_s
    iteration = sum(spent.values())
    tokens_per_step = 1 + mtp_depth * accept_rate
    num_chips = n["dies"] / cfg.hardware.dies_per_chip
    tokens = batch_per_die * n["attention"] * tokens_per_step
    _, primitives, parts = layer(LayerInputs(**inputs, rows_per_seq=1 + mtp_depth))
    return Projection(
        iteration_s=iteration,
        tpot_s=iteration / tokens_per_step,
        tokens_per_s_per_chip=tokens / iteration / num_chips,
        breakdown_s=spent,
        primitives_s=primitives,
        parts_s=parts,
    )


def _passes_spent(cost: CostModel, layer, inputs: dict, *, mtp_depth: int) -> dict[str, float]:
    """Seconds per iteration of each operation in the layers of the MTP passes (one row per
    sequence each) and of the main pass (1 + mtp_depth rows per sequence): MoE layers as the
    deployment's `layer` prices them, dense layers alike in every deployment, at the slowest DP
    group's batch and KV length (the next MoE layer's dispatch waits for it)."""
    m, imb = cost.m, inputs["imbalance"]
    batch, kv = slowest_batch(inputs["batch"], imb), inputs["kv_len"] * imb.kv
    spent: dict[str, float] = {}
    for kind, rows_per_seq, num_moe, num_dense in (
        ("mtp", 1, m.num_mtp_modules and mtp_depth, 0),
        ("main", 1 + mtp_depth, m.num_layers - m.num_dense_layers, m.num_dense_layers),
    ):
        rows = batch * rows_per_seq
        parts, primitives, _ = layer(LayerInputs(**inputs, rows_per_seq=rows_per_seq))
        for name, seconds in parts.items():
            spent[name] = spent.get(name, 0.0) + seconds * num_moe
        if num_moe and "tail" in primitives:  # once per pass: the last microbatch's way back
            spent["last microbatch's tail"] = spent.get("last microbatch's tail", 0.0) + (
                primitives["tail"] * (mtp_depth if kind == "mtp" else 1)
            )
        dense = (
            cost.mla_prolog(rows)
            + cost.attention([(kv, rows_per_seq)] * batch)
            + cost.dense_ffn(rows)
        )
        spent["dense layers"] = spent.get("dense layers", 0.0) + dense * num_dense
        if kind == "mtp" and num_moe:
            spent["MTP head"] = (cost.head(rows) + cost.sampling(rows)) * mtp_depth
    return spent


def slowest_batch(batch: float, imbalance: Imbalance) -> int:
    """The slowest DP group's requests: the mean batch x its max over mean, whole."""
    return max(1, round(batch * imbalance.batch))
