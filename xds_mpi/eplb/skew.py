"""A skewed expert routing like xDeepServe Figure 11a, drifting over time slices, and what it
loads each routed die with under a placement. Pure functions: the projection prices them
(xds_mpi/projection/eplb_pod.py, xds_mpi/projection/imbalance.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xds_mpi.eplb.drift import DRIFT_SAME_REQUESTS
from xds_mpi.eplb.placement import Placement


@dataclass(frozen=True, kw_only=True)
class Skew:
    """Figure 11a's shape: the hottest expert `hottest_over_mean` x the mean, a share
    `share_above_mean` of experts above the mean. Across `num_slices` time slices (plus one to
    evaluate on) each expert's log load moves by `drift_sigma` x a normal draw per slice and the
    experts take Figure 11a's loads again in their new order, so every slice keeps the published
    shape; the default is the drift measured on the trained checkpoint for a fixed set of requests
    (xds_mpi/eplb/drift.py DRIFT_SAME_REQUESTS). `seed` fixes the
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
