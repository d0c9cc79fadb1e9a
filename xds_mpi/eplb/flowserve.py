"""FlowServe's EPLB algorithm (xDeepServe §4.5 Step 2), one MoE layer at a time, pure numpy.

Selection works on time slices, so an expert that is hot only now and then still counts; placement
puts the heaviest replica first on the least-loaded die with a free redundant slot.
Ties break deterministically (lowest index), so every process computing it agrees.
"""

from __future__ import annotations

import numpy as np

from xds_mpi.eplb.placement import Placement


def total_load(counts: np.ndarray) -> float:
    """L = sum over slices t of count[h_t][t], h_t = the slice's hottest expert.

    counts: [num_slices, num_experts] tokens (after splitting over replicas)."""
    return float(counts.max(axis=1).sum())


def select_redundant(counts: np.ndarray, budget: int) -> list[int]:
    """The experts that get one more replica each, in the order chosen (repeats allowed).

    counts: [num_slices, num_experts] token counts of one layer; budget: R replicas."""
    counts = np.asarray(counts, np.float64)
    split = counts.copy()  # [T, E] tokens per replica
    num_replicas = np.ones(counts.shape[1], np.int64)  # [E]
    chosen: list[int] = []
    for _ in range(budget):
        # Step 2.1: the current total load L.
        # Step 2.2: candidates = experts hottest in some slice; simulate one more replica each.
        candidates = np.unique(split.argmax(axis=1))
        simulated = [
            (total_load(_with_replica(split, counts, num_replicas, c)), -counts[:, c].sum(), c)
            for c in candidates
        ]
        # Step 2.3: keep the candidate with the lowest simulated L (then the heaviest, then the
        # lowest index: equal loads never depend on iteration order).
        _, _, best = min(simulated)
        chosen.append(int(best))
        # Step 2.4: its counts now split evenly over its replicas.
        split = _with_replica(split, counts, num_replicas, best)
        num_replicas[best] += 1
    return chosen


def _with_replica(split, counts, num_replicas, expert) -> np.ndarray:
    out = split.copy()
    out[:, expert] = counts[:, expert] / (num_replicas[expert] + 1)
    return out


def place_redundant(
    placement: Placement, layer: int, counts: np.ndarray, chosen: list[int]
) -> tuple[int, ...]:
    """New phy2log row of `layer`: each chosen replica in a redundant slot.

    counts: [num_slices, num_experts]. The chosen replicas go heaviest first (total tokens over
    the slices, split over the expert's replicas) to the least-loaded die with a free redundant
    slot, preferring dies that do not hold the expert yet; each assignment adds to that die."""
    total = np.asarray(counts, np.float64).sum(axis=0)  # [E]
    row = [-1 if placement.is_redundant[s] else e for s, e in enumerate(placement.phy2log[layer])]
    num_replicas = np.bincount([e for e in row if e >= 0], minlength=placement.num_experts)
    num_replicas += np.bincount(chosen, minlength=placement.num_experts).astype(np.int64)
    per_replica = total / np.maximum(num_replicas, 1)  # [E] tokens each replica will take
    loads = np.zeros(placement.num_dies)  # [dies] starts with the routed slots' shares
    for slot, expert in enumerate(row):
        if expert >= 0:
            loads[placement.slot_die[slot]] += per_replica[expert]
    free = {d: list(placement.redundant_slots(d)) for d in range(placement.num_dies)}
    for expert in sorted(chosen, key=lambda e: (-per_replica[e], e)):
        die = _least_loaded(loads, free, row, placement.slot_die, expert)
        row[free[die].pop(0)] = expert
        loads[die] += per_replica[expert]
    return tuple(row)


def _least_loaded(loads, free, row, slot_die, expert) -> int:
    open_dies = [d for d, slots in free.items() if slots]
    if not open_dies:
        raise ValueError("more replicas chosen than free redundant slots")
    holders = {slot_die[s] for s, e in enumerate(row) if e == expert}
    fresh = [d for d in open_dies if d not in holders] or open_dies
    return min(fresh, key=lambda d: (loads[d], d))


def rebalance(placement: Placement, counts: np.ndarray, budget: int) -> Placement:
    """Step 2 for every layer. counts: [num_layers, num_slices, num_experts]."""
    for layer in range(len(placement.phy2log)):
        chosen = select_redundant(counts[layer], budget)
        placement = placement.with_layer(
            layer, place_redundant(placement, layer, counts[layer], chosen)
        )
    return placement
