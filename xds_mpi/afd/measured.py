"""Seed 003's quantities measured on an emulated afd run (its run file's /afd_load, written from
the expert dies' calls: xds_mpi/afd/load.py), beside what the budget method says at the
same deployment and budget.

Measured, per expert die and call of a main-model MoE layer, at the cost shape:
- t_B: per die and iteration, the virtual span from its first call's expert work to its last
  call's end over the number of calls (the stage period the pipeline gave the die), per
  cost-shape layer; the median over dies and iterations (prefill iterations are the outliers);
- tokens per expert: the call's routed rows x topk_scale (each tiny row stands for that many
  token-expert pairs) over the die's cost-shape experts; the hottest slot's share gives EP
  balancedness sigma = mean / max (§3.3);
- t_G: the call's priced expert time (the cost model's roofline with the profile's efficiencies
  and only the experts some row reaches, xds_mpi/projection/cost.py `routed`);
- OFU, S_t and HFU from those (Eq. 6-8), routed FLOPs = 6 H M per token-expert pair.
Analytic, at the run's deployment (its expert dies as N_F ranks of one) and hardware profile:
- t_B by Eq. 1 from the run's projected iteration: (iteration - t_g) / (MoE layers x N_BO) with
  t_g the parts outside the MoE layers' stages (dense FFN, head + sampling, graph launch,
  scheduling bubble) and N_BO the calls a layer makes (DP domains x microbatches);
- Steps 2-4 of xds_mpi/projection/afd_analysis/budget.py at the measured t_B: the tokens the
  link could bring, and the roofline t_G, OFU, S_t, HFU at the measured tokens per expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import h5py
import numpy as np

from xds_mpi.afd.load import MeasuredLoad, read_loads
from xds_mpi.projection.afd_analysis.budget import (
    FLOPS_PER_TOKEN_PER_HM,
    MoeShape,
    Platform,
    gemm_seconds,
    stage_point,
)

# The parts of an iteration outside the MoE layers' stages (Eq. 1's t_g), as the run's summary
# names them (projected_ms_<op>).
GAP_OPS = ("dense FFN", "head + sampling", "graph launch", "scheduling bubble")


@dataclass(frozen=True, kw_only=True)
class LayerLoad:
    """One tiny MoE layer's calls, averaged over the expert dies that host routed slots."""

    layer: int
    num_calls: int
    tokens_per_expert: float
    hottest_over_mean: float
    gemm_s: float


@dataclass(frozen=True, kw_only=True)
class Measured:
    """Means over the expert dies' main-layer calls (per cost-shape layer)."""

    num_calls: int
    calls_per_layer: float  # N_BO as run: calls per (iteration, layer)
    budget_s: float  # stage period: median over (die, iteration) of its calls' span / calls
    tokens_per_expert: float
    hottest_over_mean: float  # the hottest routed slot's rows / the die's mean slot
    gemm_s: float
    ofu: float
    temporal_sparsity: float
    hfu: float
    layers: tuple[LayerLoad, ...] = ()


def measure(loads: list[MeasuredLoad], model: MoeShape, hw: Platform, num_tiny_layers: int):
    """The `Measured` means of the expert dies' calls of main-model layers (MTP blocks, layer >=
    num_tiny_layers, left out: their price is one layer's, not a share of 58)."""
    hm = model.hidden * model.moe_intermediate
    calls, periods, per_layer = [], [], []
    for load in loads:
        if not load.is_routed.any():  # a dedicated shared-expert die: no routed experts
            continue
        c = load.columns
        main = c["layer"] < num_tiny_layers
        calls += _calls(load, main)
        for it in np.unique(c["iteration"][main]):
            mine = np.flatnonzero(main & (c["iteration"] == it))
            span = c["vend_s"][mine].max() - c["vstart_s"][mine].min()
            periods.append(span / (len(mine) * c["scale"][mine[0]]))
        keys = set(zip(c["iteration"][main], c["layer"][main], strict=True))
        per_layer += [np.sum((c["iteration"] == it) & (c["layer"] == ly)) for it, ly in keys]
    if not calls:
        raise ValueError("the run file's expert dies recorded no call of a main-model MoE layer")
    t_b = float(np.median(periods))
    gemm = float(np.mean([k["gemm_s"] for k in calls]))
    flops = FLOPS_PER_TOKEN_PER_HM * hm * float(np.mean([k["pairs"] for k in calls]))
    return Measured(
        num_calls=len(calls),
        calls_per_layer=float(np.mean(per_layer)),
        budget_s=t_b,
        tokens_per_expert=float(np.mean([k["tokens"] for k in calls])),
        hottest_over_mean=float(np.nanmean([k["hottest"] for k in calls])),
        gemm_s=gemm,
        ofu=flops / (gemm * hw.flops) if gemm else 0.0,
        temporal_sparsity=gemm / t_b,
        hfu=flops / (hw.flops * t_b),
        layers=_by_layer(calls),
    )


def _calls(load: MeasuredLoad, main: np.ndarray) -> list[dict]:
    """Per main-layer call of one die: its layer, token-expert pairs of the cost shape, tokens per
    expert, hottest routed slot over the mean, active expert seconds."""
    routed = load.rows[:, load.is_routed].astype(float)  # [calls, routed slots]
    experts_here = load.experts_per_slot * routed.shape[1]
    pairs = routed.sum(axis=1) * load.topk_scale
    mean = routed.mean(axis=1)
    return [
        dict(layer=int(load.columns["layer"][i]), pairs=pairs[i], tokens=pairs[i] / experts_here,
             hottest=routed[i].max() / mean[i] if mean[i] else np.nan,
             gemm_s=load.columns["active_s"][i])
        for i in np.flatnonzero(main)
    ]  # fmt: skip


def _by_layer(calls: list[dict]) -> tuple[LayerLoad, ...]:
    out = []
    for layer in sorted({k["layer"] for k in calls}):
        mine = [k for k in calls if k["layer"] == layer]
        out.append(
            LayerLoad(
                layer=layer,
                num_calls=len(mine),
                tokens_per_expert=float(np.mean([k["tokens"] for k in mine])),
                hottest_over_mean=float(np.nanmean([k["hottest"] for k in mine])),
                gemm_s=float(np.mean([k["gemm_s"] for k in mine])),
            )
        )
    return tuple(out)


def eq1_budget_s(path: str, model: MoeShape, num_bo: int) -> float:
    """Eq. 1 on the run's projection: (iteration - t_g) / (MoE layers x N_BO)."""
    with h5py.File(path, "r") as f:
        s = f["summary"].attrs
        iteration = float(s["projected_iteration_ms"]) * 1e-3
        gap = sum(float(s.get(f"projected_ms_{op}", 0.0)) for op in GAP_OPS) * 1e-3
    return (iteration - gap) / (model.num_moe_layers * num_bo)


@dataclass(frozen=True, kw_only=True)
class Comparison:
    quantity: str
    analytic: float
    measured: float
    unit: str
    note: str = ""


def compare(path: str, model: MoeShape, hw: Platform, cfg) -> tuple[list[Comparison], Measured]:
    """The measured-vs-analytic rows for the run file at `path` (its config `cfg`)."""
    dep = cfg.deployment
    num_bo = dep.num_dp_domains * dep.num_microbatches
    m = measure(read_loads(path), model, hw, cfg.model.num_layers)
    num_ffn = dep.num_expert_dies
    bound = stage_point(model, hw, m.budget_s, num_ffn, max(num_bo, 2))
    g = bound.experts_per_rank
    gemm = gemm_seconds(model, hw, m.tokens_per_expert * g, g)
    flops = FLOPS_PER_TOKEN_PER_HM * m.tokens_per_expert * g * model.hidden * model.moe_intermediate
    rows = [
        Comparison(quantity="calls per layer (N_BO)", analytic=num_bo,
                   measured=m.calls_per_layer, unit=""),
        Comparison(quantity="t_B per stage", analytic=eq1_budget_s(path, model, num_bo) * 1e6,
                   measured=m.budget_s * 1e6, unit="us"),
        Comparison(quantity="tokens per expert per stage (link bound vs run)",
                   analytic=bound.link_tokens / g, measured=m.tokens_per_expert, unit=""),
        Comparison(quantity="hottest slot / mean (1 / sigma)", analytic=1.0,
                   measured=m.hottest_over_mean, unit=""),
        Comparison(quantity="t_G at the run's tokens", analytic=gemm * 1e6,
                   measured=m.gemm_s * 1e6, unit="us",
                   note=f"003 reads all {g} local experts; the run only those a row reaches"),
        Comparison(quantity="OFU at the run's tokens", analytic=flops / (gemm * hw.flops),
                   measured=m.ofu, unit=""),
        Comparison(quantity="S_t = t_G / t_B", analytic=gemm / m.budget_s,
                   measured=m.temporal_sparsity, unit=""),
        Comparison(quantity="HFU = OFU x S_t (003's bound at t_B vs run)", analytic=bound.hfu,
                   measured=m.hfu, unit="", note=bound.bound),
    ]  # fmt: skip
    return rows, m
