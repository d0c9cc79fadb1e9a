"""The two EPLB policies behind one call, and the load figures both are judged by."""

from __future__ import annotations

import numpy as np

from xds_mpi.eplb import deepseek, flowserve
from xds_mpi.eplb.placement import Placement, die_loads

POLICIES = ("flowserve", "deepseek", "none")


def rebalance(
    policy: str, placement: Placement, counts: np.ndarray, budget: int, *, dies_per_node: int
) -> Placement:
    """New placement of every layer. counts: [num_layers, num_slices, num_experts]. Policy
    "none" keeps the placement: counts are collected and reported, nothing is swapped (a
    baseline measured over the same slices)."""
    if policy == "flowserve":
        return flowserve.rebalance(placement, counts, budget)
    if policy == "deepseek":
        return deepseek.rebalance(placement, counts, budget, dies_per_node=dies_per_node)
    if policy == "none":
        return placement
    raise ValueError(f"unknown EPLB policy {policy!r} (known: {', '.join(POLICIES)})")


def max_over_mean(loads: np.ndarray) -> float:
    """Straggler factor of one layer: the busiest die's load over the mean (1.0 = balanced;
    nan when no die has any load). loads: [num_dies]."""
    mean = float(np.mean(loads)) if len(loads) else 0.0
    return float(np.max(loads)) / mean if mean > 0 else float("nan")


def predicted_max_over_mean(placement: Placement, counts: np.ndarray) -> list[float]:
    """Per layer, max/mean die load if every expert's tokens split evenly over its replicas.
    counts: [num_layers, num_slices, num_experts]."""
    return [
        max_over_mean(die_loads(placement, layer, np.asarray(counts[layer]).sum(axis=0)))
        for layer in range(len(placement.phy2log))
    ]


def keep_improvements(old: Placement, new: Placement, counts: np.ndarray) -> Placement:
    """`new` in the layers where it lowers the predicted max/mean die load of `counts`, `old`
    elsewhere: a swap costs weight loads and a while with fewer replicas, so it must pay.
    counts: [num_layers, num_slices, num_experts]."""
    before, after = predicted_max_over_mean(old, counts), predicted_max_over_mean(new, counts)
    result = old
    for layer, (b, a) in enumerate(zip(before, after)):
        if a < b - 1e-9:
            result = result.with_layer(layer, new.phy2log[layer])
    return result
