"""Analytic projection of one decode iteration on the pod (what `xds-mpi project` prints).

An iteration is FlowServe's (xDeepServe §4.6, Figure 20): with MTP depth d, d MTP passes over
the batch, then the main model over batch x (1 + d) rows, sampling after each, plus the scheduling
bubble. Routing is taken as uniform (every expert gets rows x top-k / experts rows). Layers are
sequential; within a MoE layer the slowest die sets the pace (dispatch/combine are barriers).

Colocated (DP x EP, §7.1): layer = attention side + dispatch + max(routed-expert die, shared-
expert die) + combine. Disaggregated (§5.2, Figure 19): D domains x M microbatches take turns at
the expert dies, whose receive / compute / send stages overlap, so a layer costs
max(D x M x expert-side stage, M x attention side + A2E + E2A of one domain).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xds_mpi.config import Config, ModelConfig
from xds_mpi.cost import CostModel, Hardware
from xds_mpi.topology import Topology


@dataclass(frozen=True, kw_only=True)
class Projection:
    iteration_s: float
    tpot_s: float
    tokens_per_s_per_chip: float
    breakdown_s: dict = field(default_factory=dict)  # operation -> seconds per iteration
    primitives_s: dict = field(default_factory=dict)  # one call of each primitive (one layer)


def _counts(cfg: Config, topo: Topology) -> dict:
    hosts = [r for r in topo.ranks if r.expert_slots]
    routed = [r for r in hosts if any(s.kind == "routed" for s in r.expert_slots)]
    return {
        "dies": topo.num_dies,
        "routed_dies": len(routed),
        "shared_dies": len(hosts) - len(routed),
        "attention": topo.num_dp_domains * topo.dp_groups_per_domain,
    }


def project(
    cfg: Config,
    m: ModelConfig,
    hw: Hardware,
    *,
    batch_per_die: int,
    kv_len: int,
    mtp_depth: int = 0,
    accept_rate: float = 0.0,
) -> Projection:
    """batch_per_die: requests per DP group; kv_len: mean KV length; accept_rate: MTP."""
    topo = Topology.from_config(cfg)
    cost, n = CostModel(m, hw), _counts(cfg, topo)
    layer = _afd_layer if cfg.deployment.kind == "afd" else _colocated_layer
    spent = _passes_spent(
        cfg, cost, n, layer, batch_per_die=batch_per_die, kv_len=kv_len, mtp_depth=mtp_depth
    )
    spent["head + sampling"] = cost.head(batch_per_die * (1 + mtp_depth)) + cost.sampling(
        batch_per_die * (1 + mtp_depth)
    )
    spent["scheduling bubble"] = hw.bubble_s
    iteration = sum(spent.values())
    tokens_per_step = 1 + mtp_depth * accept_rate
    num_chips = n["dies"] / cfg.hardware.dies_per_chip
    tokens = batch_per_die * n["attention"] * tokens_per_step
    _, primitives = layer(
        cfg, cost, n, batch_per_die * (1 + mtp_depth), batch_per_die, kv_len, 1 + mtp_depth
    )
    return Projection(
        iteration_s=iteration,
        tpot_s=iteration / tokens_per_step,
        tokens_per_s_per_chip=tokens / iteration / num_chips,
        breakdown_s=spent,
        primitives_s=primitives,
    )


def _passes_spent(
    cfg: Config, cost: CostModel, n: dict, layer, *, batch_per_die: int, kv_len: int, mtp_depth: int
) -> dict[str, float]:
    """Seconds per iteration of each operation in the layers of the MTP passes (one row per
    sequence each) and of the main pass (1 + mtp_depth rows per sequence): MoE layers as the
    deployment's `layer` prices them, dense layers alike in every deployment."""
    m = cost.m
    spent: dict[str, float] = {}
    for kind, rows_per_seq, num_moe, num_dense in (
        ("mtp", 1, m.num_mtp_modules and mtp_depth, 0),
        ("main", 1 + mtp_depth, m.num_layers - m.num_dense_layers, m.num_dense_layers),
    ):
        rows = batch_per_die * rows_per_seq
        parts, _ = layer(cfg, cost, n, rows, batch_per_die, kv_len, rows_per_seq)
        for name, seconds in parts.items():
            spent[name] = spent.get(name, 0.0) + seconds * num_moe
        dense = (
            cost.mla_prolog(rows)
            + cost.attention([(kv_len, rows_per_seq)] * batch_per_die)
            + cost.dense_ffn(rows)
        )
        spent["dense layers"] = spent.get("dense layers", 0.0) + dense * num_dense
        if kind == "mtp" and num_moe:
            spent["MTP head"] = (cost.head(rows) + cost.sampling(rows)) * mtp_depth
    return spent


def _colocated_layer(cfg, cost: CostModel, n, rows, batch, kv_len, rows_per_seq) -> dict:
    m, dedicated = cost.m, cfg.deployment.shared_experts == "dedicated"
    routed_rows = rows * n["dies"] * m.top_k  # all dies' routed rows
    per_expert = routed_rows / m.num_routed_experts
    experts_per_die = m.num_routed_experts / n["routed_dies"]
    routed_die = cost.experts([per_expert] * round(experts_per_die))
    shared_die = cost.experts([rows * n["dies"] / n["shared_dies"]]) if dedicated else 0.0
    every_die_shared = 0.0 if dedicated else cost.experts([rows] * m.num_shared_experts)
    rows_in = routed_rows / n["routed_dies"]
    dispatch = cost.dispatch(rows_in, int8=cfg.xccl.use_int8)
    combine = cost.combine(rows * (m.top_k + (1 if dedicated else 0)))
    parts = {
        "MLAProlog": cost.mla_prolog(rows),
        "attention": cost.attention([(kv_len, rows_per_seq)] * batch),
        "gate": cost.gate(rows),
        "dispatch": dispatch,
        "experts": max(routed_die, shared_die) + every_die_shared,
        "combine": combine,
    }
    return parts, {"dispatch": dispatch, "combine": combine}


def _afd_layer(cfg, cost: CostModel, n, rows, batch, kv_len, rows_per_seq) -> dict:
    m, dep = cost.m, cfg.deployment
    domains, micro = dep.num_dp_domains, dep.num_microbatches
    mb_rows = rows / micro  # one attention die, one microbatch
    tokens = mb_rows * dep.dp_groups_per_domain  # one domain's microbatch
    routed_dies = n["routed_dies"]
    per_expert = tokens * m.top_k / m.num_routed_experts
    compute = max(
        cost.experts([per_expert] * round(m.num_routed_experts / routed_dies)),
        cost.experts([tokens / max(n["shared_dies"], 1)]) if n["shared_dies"] else 0.0,
    )
    a2e = cost.dispatch(mb_rows, int8=cfg.xccl.use_int8)  # attention die -> trampoline
    a2e2 = cost.dispatch(tokens * m.top_k / routed_dies, int8=cfg.xccl.use_int8)  # -> experts
    e2a2 = cost.combine(tokens * m.top_k / routed_dies)  # experts -> trampolines
    e2a = cost.combine(mb_rows)  # trampoline -> attention die
    attention_side = (
        cost.mla_prolog(mb_rows)
        + cost.gate(mb_rows)
        + cost.attention([(kv_len, rows_per_seq)] * round(batch / micro))
    )
    expert_side = domains * micro * max(a2e2, compute, e2a2)
    domain_side = micro * attention_side + a2e + e2a
    total = max(expert_side, domain_side)
    # Attribute the layer's time to its parts in proportion to what each would take alone.
    parts = {
        "MLAProlog+attention+gate": micro * attention_side,
        "A2E": a2e,
        "experts (A2E', compute, E2A')": expert_side,
        "E2A": e2a,
    }
    scale = total / sum(parts.values())
    return ({k: v * scale for k, v in parts.items()}, {"A2E": a2e + a2e2, "E2A": e2a2 + e2a})
