"""What the slowest die carries beyond the mean: the expert load of the hottest routed die and
the batch and KV length of the slowest DP group. A layer runs at the slowest die's pace
(dispatch and combine are barriers), so the projection prices those dies
(xds_mpi/projection/project.py).

Expert loads come from a run file's measured routing (`from_run_file`), or from a Figure-11a
skew rebalanced by FlowServe's EPLB (`from_skew`, on xds_mpi/eplb/skew.py's skew model). The DP
imbalance comes from the spread of the requests' KV lengths (`kv_straggler`) and from the
batches the DP groups ran, measured in a run (`batch_from_run_file`) or given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from xds_mpi.projection.cost import expected_max_z


@dataclass(frozen=True, kw_only=True)
class Imbalance:
    """moe: slowest routed die's rows / mean; kv: slowest DP group's mean KV length / the
    mean; batch: its batch / the mean; source says where the numbers came from. noise: moe is
    an expected load's (a skew model, even routing), so one iteration's routing noise comes on
    top; a load measured in a run (`from_run_file`) holds its noise already."""

    moe: float = 1.0
    kv: float = 1.0
    batch: float = 1.0
    noise: bool = True
    source: str = "uniform"


def kv_straggler(*, batch: int, spread: float, groups: int) -> float:
    """Slowest of `groups` DP groups' mean KV length over the mean, when each group's `batch`
    requests have KV lengths uniform in mean x (1 +- spread): the group mean has relative
    spread / sqrt(3 batch), and the slowest is E[max] standard deviations above."""
    if spread <= 0 or batch < 1:
        return 1.0
    return 1.0 + expected_max_z(groups) * spread / math.sqrt(3.0 * batch)


def from_skew(cfg, m, *, hottest: float, share: float, drift_sigma: float, seed: int = 0) -> float:
    """Max / mean routed-die load of a Figure-11a skew after FlowServe's EPLB, the placement
    computed from earlier slices and priced on the next, the loads drifting by `drift_sigma`
    per slice (as xds_mpi/projection/eplb_pod.py compares)."""
    # start-up: EPLB's policies stay out of the dies that price layers (docs/design.md, Layers)
    from xds_mpi.eplb.placement import from_topology
    from xds_mpi.eplb.policy import max_over_mean, rebalance
    from xds_mpi.eplb.skew import Skew, die_loads, skew_slices
    from xds_mpi.plan.eplb import budget
    from xds_mpi.plan.topology import Topology

    topo = Topology.from_config(cfg)
    static = from_topology(topo, 1)
    skew = Skew(
        hottest_over_mean=hottest, share_above_mean=share, drift_sigma=drift_sigma, seed=seed
    )
    slices = skew_slices(m.num_routed_experts, skew)
    routed = len({d for d, e in zip(static.slot_die, static.phy2log[0]) if e >= 0})
    placement = rebalance(
        "flowserve",
        static,
        slices[None, :-1],
        budget(cfg, routed),
        dies_per_node=cfg.hardware.dies_per_server,
    )
    return max_over_mean(np.array(die_loads(placement, slices[-1], m.num_routed_experts)))


def from_run_file(path) -> float:
    """Max / mean die load of a MoE layer measured in a run (its `eplb/slice_die_rows`, the rows
    each die received per time slice), averaged over the layers and the decode-only slices (all
    slices if none is): with one iteration per slice, the straggler of an average iteration."""
    import h5py  # start-up: h5py only where a run file is read (docs/design.md, Layers)

    from xds_mpi.eplb.policy import max_over_mean  # start-up, as in from_skew

    with h5py.File(path, "r") as f:
        g = f["eplb"]
        rows = g["slice_die_rows"][:]  # [slices, layers, dies]
        if "slice_num_prefill" in g and (g["slice_num_prefill"][:] == 0).any():
            rows = rows[g["slice_num_prefill"][:] == 0]
    return float(np.mean([max_over_mean(r) for layers in rows for r in layers if r.sum() > 0]))


def batch_from_run_file(path) -> float:
    """Largest DP group's batch / the mean over the groups in a run's decode-only iterations
    (every die's rows are its sampled entries and drafts), averaged over those iterations:
    what `Imbalance.batch` prices at the slowest DP group. Dies that never sample (expert dies)
    are no DP group."""
    import h5py  # start-up: h5py only where a run file is read (docs/design.md, Layers)

    with h5py.File(path, "r") as f:
        dies = [f["dies"][d] for d in f["dies"] if f["dies"][d]["num_sampled"][:].sum() > 0]
        sampled = np.array([d["num_sampled"][:] for d in dies], np.float64)  # [dies, iters]
        rows = np.array([d["num_rows"][:] for d in dies])
        drafted = np.array([d["num_drafted"][:] for d in dies])
    decode = (rows == sampled + drafted).all(axis=0) & (sampled.sum(axis=0) > 0)
    if not decode.any():
        raise ValueError(f"{path}: no decode-only iteration to measure DP batches on")
    per_iteration = sampled[:, decode]
    return float(np.mean(per_iteration.max(axis=0) / per_iteration.mean(axis=0)))
