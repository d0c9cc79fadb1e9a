"""EPLB at pod scale, analytically: a skewed routing like xDeepServe Figure 11a priced on the
projection of xds_mpi/projection/project.py (which assumes uniform routing), without EPLB, with each
policy, and uniform (Figure 11b's MoE-Native, MoE-Balanced, MoE-Avg-Routing).

A separate addition to the projection: the uniform projection is computed as usual, then each MoE
layer's dispatch and routed-expert time is replaced by the slowest routed die's under the skew and
the placement (every layer is given the same skew). Combine pulls a die's own tokens back and
does not depend on where experts sit; the shared-expert dies are as in the uniform projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xds_mpi.config.eplb import budget
from xds_mpi.config.schema import Config, ModelConfig
from xds_mpi.eplb.placement import Placement, from_topology
from xds_mpi.eplb.policy import max_over_mean, rebalance
from xds_mpi.plan.topology import Topology
from xds_mpi.projection.cost import CostModel, Hardware
from xds_mpi.projection.paper_data import DRIFT_SAME_REQUESTS
from xds_mpi.projection.project import project


@dataclass(frozen=True, kw_only=True)
class Skew:
    """Figure 11a's shape: the hottest expert `hottest_over_mean` x the mean, a share
    `share_above_mean` of experts above the mean. Across `num_slices` time slices (plus one to
    evaluate on) each expert's log load moves by `drift_sigma` x a normal draw per slice and the
    experts take Figure 11a's loads again in their new order, so every slice keeps the published
    shape; the default is the drift measured on the trained checkpoint for a fixed set of requests
    (xds_mpi/projection/paper_data.py DRIFT_SAME_REQUESTS, xds_mpi/eplb/drift.py). `seed` fixes the
    draw."""

    hottest_over_mean: float = 30.0
    share_above_mean: float = 0.2
    num_slices: int = 4
    drift_sigma: float = DRIFT_SAME_REQUESTS
    seed: int = 0


def skew_loads(num_experts: int, skew: Skew) -> np.ndarray:
    """[num_experts] loads, mean 1, in descending order: the hot experts fall off as a power
    law from the hottest to just above the mean; the others share what is left equally."""
    num_hot = round(skew.share_above_mean * num_experts)
    if skew.hottest_over_mean < 1 or not 1 <= num_hot < num_experts:
        raise ValueError(
            f"skew needs hottest_over_mean >= 1 and 1 <= share_above_mean x experts < experts; "
            f"got {skew.hottest_over_mean}, {skew.share_above_mean} x {num_experts} = {num_hot}"
        )
    alpha = np.log(skew.hottest_over_mean) / np.log(num_hot + 1)
    hot = skew.hottest_over_mean * np.arange(1, num_hot + 1, dtype=np.float64) ** -alpha
    cold = (num_experts - hot.sum()) / (num_experts - num_hot)
    if not 0 <= cold < 1:
        raise ValueError(
            f"no routing has {num_hot} of {num_experts} experts above the mean with the hottest "
            f"at {skew.hottest_over_mean}x: the hot experts alone take {hot.sum():.0f} of "
            f"{num_experts} mean loads"
        )
    return np.concatenate([hot, np.full(num_experts - num_hot, cold)])


def skew_slices(num_experts: int, skew: Skew) -> np.ndarray:
    """[num_slices + 1, num_experts] loads (mean 1 in each slice, each slice Figure 11a's loads
    in some order); the experts change ranks from one slice to the next by `drift_sigma`."""
    rng = np.random.default_rng(skew.seed)
    loads = skew_loads(num_experts, skew)  # descending
    row = np.empty(num_experts)
    row[rng.permutation(num_experts)] = loads
    slices = [row]
    for _ in range(skew.num_slices):
        key = np.log(slices[-1]) + skew.drift_sigma * rng.standard_normal(num_experts)
        row = np.empty(num_experts)
        row[np.argsort(-key, kind="stable")] = loads  # the largest key takes the hottest load
        slices.append(row)
    return np.stack(slices)


@dataclass(frozen=True, kw_only=True)
class PodResult:
    """One line of the comparison: forward_s per iteration; max_over_mean of the routed dies'
    load in the evaluated slice; experts_s: one main-pass MoE layer's slowest routed die."""

    name: str
    forward_s: float
    max_over_mean: float
    experts_s: float


def compare(cfg: Config, m: ModelConfig, hw: Hardware, skew: Skew, **workload) -> list[PodResult]:
    """Uniform, no EPLB, FlowServe's and the DeepSeek-style policy on the same skew.

    The policies see slices 0..num_slices-1; every placement is priced on the next slice (a
    placement is always used on traffic after the one it was computed from). workload:
    batch_per_die, kv_len, mtp_depth, accept_rate as `project` takes them."""
    topo = Topology.from_config(cfg)
    uniform = project(cfg, m, hw, **workload)
    cost = CostModel(m, hw)
    static = from_topology(topo, 1)
    slices = skew_slices(m.num_routed_experts, skew)
    seen, future = slices[None, :-1], slices[-1]  # [1, S, E], [E]
    num_routed_dies = len({d for d, e in zip(static.slot_die, static.phy2log[0]) if e >= 0})
    replicas = budget(cfg, num_routed_dies)
    dies_per_node = cfg.hardware.dies_per_server
    placements = {
        "MoE-Native (no EPLB)": static,
        "MoE-Balanced, flowserve": rebalance(
            "flowserve", static, seen, replicas, dies_per_node=dies_per_node
        ),
        "MoE-Balanced, deepseek": rebalance(
            "deepseek", static, seen, replicas, dies_per_node=dies_per_node
        ),
    }
    flat = np.ones(m.num_routed_experts)
    results = [
        _price(cfg, cost, uniform, topo, "MoE-Avg-Routing (uniform)", static, flat, workload)
    ]
    for name, placement in placements.items():
        results.append(_price(cfg, cost, uniform, topo, name, placement, future, workload))
    return results


def _price(cfg, cost, uniform, topo, name, placement: Placement, loads, workload) -> PodResult:
    """The uniform projection with every MoE layer's dispatch and routed experts re-priced."""
    m = cost.m
    mtp = workload.get("mtp_depth", 0)
    batch = workload["batch_per_die"]
    forward_s = uniform.iteration_s
    passes = [(batch * (1 + mtp), m.num_layers - m.num_dense_layers)]
    if m.num_mtp_modules and mtp:
        passes.append((batch, mtp))
    for rows, num_layers in passes:
        skewed = _layer(cfg, cost, topo, placement, loads, rows)
        even = _layer(cfg, cost, topo, placement, np.ones_like(loads), rows, is_static=True)
        forward_s += num_layers * (skewed["total"] - even["total"])
    main = _layer(cfg, cost, topo, placement, loads, passes[0][0])
    return PodResult(
        name=name,
        forward_s=forward_s,
        max_over_mean=main["max_over_mean"],
        experts_s=main["experts"],
    )


def die_experts(placement: Placement, loads, num_experts: int, *, is_static=False) -> list:
    """Each routed die's expert loads under `placement`: a replicated expert's load splits
    evenly over its replicas; `is_static` ignores the redundant slots (the topology's own
    placement, what the uniform projection assumes)."""
    row = placement.phy2log[0]
    if is_static:
        row = tuple(-1 if placement.is_redundant[s] else e for s, e in enumerate(row))
    log2phy = [[s for s, e in enumerate(row) if e == x] for x in range(num_experts)]
    per_slot: dict[int, list[float]] = {}
    for expert, slots in enumerate(log2phy):
        for slot in slots:
            per_slot.setdefault(placement.slot_die[slot], []).append(loads[expert] / len(slots))
    return list(per_slot.values())


def die_loads(placement: Placement, loads, num_experts: int) -> list[float]:
    """Each routed die's total load under `placement` (xds_mpi/projection/imbalance.py prices the
    max)."""
    return [sum(v) for v in die_experts(placement, loads, num_experts)]


def _layer(cfg, cost, topo, placement, loads, rows, *, is_static=False) -> dict:
    """One MoE layer: the slowest routed die's received rows and expert time; `is_static`
    prices the topology's own placement (what the uniform projection assumes)."""
    m = cost.m
    num_attention = topo.num_dp_domains * topo.dp_groups_per_domain
    tokens = loads / loads.sum() * rows * num_attention * m.top_k  # [E] routed rows
    per_die = die_experts(placement, tokens, m.num_routed_experts, is_static=is_static)
    rows_in = np.array([sum(v) for v in per_die])
    experts = max(max(cost.experts(v) for v in per_die), _shared_die(cfg, cost, topo, rows))
    dispatch = cost.dispatch(rows_in.max(), peers=topo.num_dies, int8=cfg.xccl.use_int8)
    return {
        "experts": experts,
        "total": experts + dispatch,
        "max_over_mean": max_over_mean(rows_in),
    }


def _shared_die(cfg, cost, topo, rows) -> float:
    """A dedicated shared-expert die's time, as the uniform projection prices it (0 without)."""
    num_shared_dies = sum(
        1 for r in topo.ranks if r.expert_slots and all(s.kind == "shared" for s in r.expert_slots)
    )
    if cfg.deployment.shared_experts != "dedicated" or not num_shared_dies:
        return 0.0
    return cost.experts([rows * topo.num_dies / num_shared_dies])
