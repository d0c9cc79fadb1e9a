"""Analytic projection of one decode iteration on the pod (what `xds-mpi project` prints).

An iteration is FlowServe's (xDeepServe §4.6, Figure 20): with MTP depth d, d MTP passes over
the batch, then the main model over batch x (1 + d) rows, sampling after each, plus the scheduling
bubble where the execution has one (xDeepServe §7.1: "the scheduling bubble between iterations
adds around 2 ms"; CloudMatrix-Infer §4.2.4 runs its graphs back to back and states none) and
one graph launch per pass unless the graphs are pipelined (CloudMatrix-Infer §4.2.4).
Layers are sequential; within a layer the slowest die sets the pace (dispatch and combine are
barriers): `imbalance` (xds_mpi/projection/imbalance.py) says how far the slowest attention and
expert dies are above the mean. The layers themselves are priced in xds_mpi/projection/layers.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xds_mpi.config.schema import Config, ModelConfig
from xds_mpi.plan.topology import Topology
from xds_mpi.projection.cost import CostModel, Hardware
from xds_mpi.projection.imbalance import Imbalance
from xds_mpi.projection.layers import LayerInputs, afd_layer, colocated_layer, counts
from xds_mpi.projection.waits import launch_mean_wait_s, launch_s


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
    int8_attention: float = 0.0,
) -> Projection:
    """batch_per_die: mean requests per DP group; kv_len: mean KV length; accept_rate: MTP;
    redundant_dies: as xds_mpi/projection/layers.py `counts` takes them; int8_attention: the
    share of the layers whose attention core runs in INT8 (CostModel; the KV cache's non-RoPE
    part is INT8 where cfg.scheduler.kv_int8 says so)."""
    topo = Topology.from_config(cfg)
    cost = CostModel(m, hw, kv_int8=cfg.scheduler.kv_int8, int8_attention=int8_attention)
    n = counts(cfg, topo, redundant_dies=redundant_dies)
    layer = afd_layer if cfg.deployment.kind == "afd" else colocated_layer
    inputs = dict(
        cfg=cfg, cost=cost, n=n, batch=batch_per_die, kv_len=kv_len, imbalance=imbalance,
        microbatches=execution.microbatches, stream0_aic=execution.stream0_aic,
    )  # fmt: skip
    batch = slowest_batch(batch_per_die, imbalance)
    mtp = _mtp_pass(cost, layer, inputs, batch=batch, mtp_depth=mtp_depth, accept=accept_rate)
    main = _pass_spent(
        cost, layer, inputs, rows_per_seq=1 + mtp_depth,
        num_moe=m.num_layers - m.num_dense_layers, num_dense=m.num_dense_layers,
    )  # fmt: skip
    rows = batch * (1 + mtp_depth)
    main["head + sampling"] = cost.head(rows) + cost.sampling(rows)
    num_mtp = mtp_depth if m.num_mtp_modules else 0
    num_moe = m.num_layers - m.num_dense_layers
    # form 2's launch straggler (waits.py): each pass's first dispatch waits for the latest graph
    launch = launch_s(hw.jitter_s, hw.tail, n["dies"]) if num_moe else 0.0
    if launch:
        main["launch stragglers"] = launch
        if num_mtp:
            mtp["MTP launch stragglers"] = launch * num_mtp
    spent = _merged(mtp, main)
    if not execution.pipelined_graphs:  # each pass is its own graph (CloudMatrix-Infer §4.2.4)
        spent["graph launch"] = hw.graph_launch_s * (1 + num_mtp)
        if num_mtp:
            mtp["graph launch"] = hw.graph_launch_s * num_mtp
    if execution.scheduling_bubble:
        spent["scheduling bubble"] = hw.bubble_s
    iteration = sum(spent.values())
    tokens_per_step = 1 + mtp_depth * accept_rate
    # the profile's chip, not the emulated pod's layout (cfg.hardware): an H800 is one die a chip
    num_chips = n["dies"] / hw.dies_per_chip
    tokens = batch_per_die * n["attention"] * tokens_per_step
    _, primitives, parts = layer(LayerInputs(**inputs, rows_per_seq=1 + mtp_depth))
    if launch:  # a call's mean wait: the first dispatch's extra spread over the iteration's calls
        primitives["launch stragglers"] = launch
        passes, calls = 1 + num_mtp, num_moe + num_mtp
        extra = launch_mean_wait_s(hw.jitter_s, hw.tail, n["dies"]) * passes / calls
        if "dispatch wait" in primitives:  # colocated; afd's A2E rows pay the body per call
            primitives["dispatch wait"] = primitives["dispatch wait"] + extra
    if num_mtp:  # one module's pass, all it pays
        primitives["MTP pass"] = sum(mtp.values()) / num_mtp
        parts["MTP pass"] = {k: v / num_mtp for k, v in mtp.items()}
    return Projection(
        iteration_s=iteration,
        tpot_s=iteration / tokens_per_step,
        tokens_per_s_per_chip=tokens / iteration / num_chips,
        breakdown_s=spent,
        primitives_s=primitives,
        parts_s=parts,
    )


def _pass_spent(
    cost: CostModel, layer, inputs: dict, *, rows_per_seq: float, num_moe: int, num_dense: int
) -> dict[str, float]:
    """Seconds of each operation in one pass over `rows_per_seq` rows per sequence: its MoE
    layers as the deployment's `layer` prices them (and, where it has one, the last
    microbatch's tail once), its dense layers alike in every deployment, at the slowest DP
    group's batch and KV length (the next MoE layer's dispatch waits for it)."""
    imb = inputs["imbalance"]
    batch, kv = slowest_batch(inputs["batch"], imb), inputs["kv_len"] * imb.kv
    parts, primitives, _ = layer(LayerInputs(**inputs, rows_per_seq=rows_per_seq))
    spent = {name: seconds * num_moe for name, seconds in parts.items()}
    if num_moe and "tail" in primitives:  # once per pass: the last microbatch's way back
        spent["last microbatch's tail"] = primitives["tail"]
    if num_dense:
        rows = batch * rows_per_seq
        dense = (
            cost.mla_prolog(rows)
            + cost.attention([(kv, rows_per_seq)] * batch)
            + cost.dense_ffn(rows)
        )
        spent["dense layers"] = dense * num_dense
    return spent


def _mtp_pass(cost: CostModel, layer, inputs: dict, *, batch: int, mtp_depth: int,
              accept: float) -> dict[str, float]:  # fmt: skip
    """Seconds of each operation of the MTP passes (xDeepServe §4.6 steps 1-2, Figure 13): each
    module runs its block over the tokens the previous step's verification committed, 1 +
    the accepted drafts per sequence (CloudMatrix-Infer §4.2.4: an MTP module "requires the
    sequence length determined after the previous LLM validation"; our engine's MTP does the
    same, xds_mpi/execution/executor.py `_draft`), after its eh_proj over those rows; then it
    drafts one token per sequence through the shared head and samples it."""
    num_mtp = mtp_depth if cost.m.num_mtp_modules else 0
    if not num_mtp:
        return {}
    rows_per_seq = 1 + mtp_depth * accept
    spent = {
        f"MTP {name}": seconds * num_mtp
        for name, seconds in _pass_spent(
            cost, layer, inputs, rows_per_seq=rows_per_seq, num_moe=1, num_dense=0
        ).items()
    }
    spent["MTP eh_proj"] = cost.mtp_projection(batch * rows_per_seq) * num_mtp
    spent["MTP head"] = (cost.head(batch) + cost.sampling(batch)) * num_mtp
    return spent


def _merged(*spent: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in spent:
        for name, seconds in d.items():
            out[name] = out.get(name, 0.0) + seconds
    return out


def slowest_batch(batch: float, imbalance: Imbalance) -> int:
    """The slowest DP group's requests: the mean batch x its max over mean, whole."""
    return max(1, round(batch * imbalance.batch))
