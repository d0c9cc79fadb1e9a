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
    baseline measured over the same slices). After vertical scaling (remove_die) the policies
    plan over the survivors' redundant slots only, and every expert whose routed slot was lost
    keeps a replica (cover)."""
    budget = min(budget, sum(placement.is_redundant))  # the lost dies' slots are gone
    if policy == "flowserve":
        return cover(flowserve.rebalance(placement, counts, budget))
    if policy == "deepseek":
        return cover(deepseek.rebalance(placement, counts, budget, dies_per_node=dies_per_node))
    if policy == "none":
        return placement
    raise ValueError(f"unknown EPLB policy {policy!r} (known: {', '.join(POLICIES)})")


def cover(placement: Placement) -> Placement:
    """The placement with every expert in some slot of every layer. Only a placement after
    vertical scaling can miss one (the policies keep the routed slots, and a lost die's routed
    experts live on in redundant slots only): each missing expert takes an empty redundant slot,
    else the redundant slot of the expert with the most replicas (it keeps another)."""
    for layer, row in enumerate(placement.phy2log):
        missing = [e for e, slots in enumerate(placement.log2phy(layer)) if not slots]
        if not missing:
            continue
        row = list(row)
        for expert in missing:
            row[_free_slot(placement, row)] = expert
        placement = placement.with_layer(layer, tuple(row))
    return placement


def _free_slot(placement: Placement, row: list[int]) -> int:
    redundant = [s for s, r in enumerate(placement.is_redundant) if r]
    empty = [s for s in redundant if row[s] < 0]
    if empty:
        return empty[0]
    replicas = {s: row.count(row[s]) for s in redundant}
    slot = max(redundant, key=lambda s: (replicas[s], -s), default=-1)
    if slot < 0 or replicas[slot] < 2:
        raise ValueError("no redundant slot left for an expert without a replica")
    return slot


def max_over_mean(loads: np.ndarray) -> float:
    """Straggler factor of one layer: the busiest die's load over the mean (1.0 = balanced;
    nan when no die has any load). loads: [num_dies]; a nan entry (a die lost to vertical
    scaling, in a measured slice) is left out."""
    loads = np.asarray(loads, np.float64)
    loads = loads[~np.isnan(loads)]
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
