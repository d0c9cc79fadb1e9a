"""Two runs of the same config and workload compared over the same time slices: a baseline
(`eplb.policy: none`, collect only) and an EPLB run. Only the EPLB run's steady slices with a
rebalanced placement are taken (one version, no loading, decode only), and only where the baseline
did not prefill either, so both sides saw the same iterations."""

from __future__ import annotations

from dataclasses import dataclass

import h5py
import numpy as np

from xds_mpi.eplb.policy import max_over_mean
from xds_mpi.eplb.report import SCALED_BATCH
from xds_mpi.projection.moe_time import MoePricing


@dataclass(frozen=True, kw_only=True)
class Side:
    """One run over the compared slices: max/mean per layer, rows per die (all layers, per
    iteration), virtual MoE ms per iteration, projected MoE ms (run's batch / SCALED_BATCH)."""

    name: str
    max_over_mean: tuple[float, ...]
    die_rows: tuple[float, ...]
    moe_ms: float
    projected_ms: float
    projected_scaled_ms: float


def _steady_rebalanced(g) -> np.ndarray:
    start, end = g["slice_version_start"][:], g["slice_version_end"][:]
    quiet = (g["slice_num_loading"][:] == 0) & (g["slice_num_prefill"][:] == 0)
    return (start == end) & quiet & (start > 0)


def compare_run_files(base_path, eplb_path, pricing: MoePricing, target_rows: float):
    """(slice indices, iterations, [baseline Side, EPLB Side])."""
    with h5py.File(base_path, "r") as fb, h5py.File(eplb_path, "r") as fe:
        base, eplb = fb["eplb"], fe["eplb"]
        n = min(len(base["slice_num_iterations"]), len(eplb["slice_num_iterations"]))
        chosen = _steady_rebalanced(eplb)[:n] & (base["slice_num_prefill"][:n] == 0)
        iterations = eplb["slice_num_iterations"][:n][chosen]
        if not np.array_equal(base["slice_num_iterations"][:n][chosen], iterations):
            raise ValueError("the two runs' slices hold different iterations: not comparable")
        num_iterations = int(iterations.sum())
        sides = [
            _side(name, g, chosen, n, num_iterations, pricing, target_rows)
            for name, g in (("no EPLB", base), ("EPLB", eplb))
        ]
    return np.flatnonzero(chosen).tolist(), num_iterations, sides


def _side(name, g, chosen, n, num_iterations, pricing, target_rows) -> Side:
    rows = g["slice_die_rows"][:n][chosen].sum(axis=0) / max(num_iterations, 1)  # [L, dies]
    mean = float(rows[0].mean())
    return Side(
        name=name,
        max_over_mean=tuple(max_over_mean(r) for r in rows),
        die_rows=tuple(rows.sum(axis=0).tolist()),
        moe_ms=1e3 * float(g["slice_moe_s"][:n][chosen].sum()) / max(num_iterations, 1),
        projected_ms=pricing.ms(rows),
        projected_scaled_ms=pricing.ms(rows, target_rows / mean if mean else float("nan")),
    )


def format_comparison(slices, num_iterations: int, sides: list[Side]) -> list[str]:
    lines = [f"compared over time slices {slices} ({num_iterations} decode iterations)"]
    for s in sides:
        lines.append(
            f"{s.name:8s} max/mean die load per MoE layer "
            + " ".join(f"{r:.2f}" for r in s.max_over_mean)
            + "; rows per die per iteration "
            + " ".join(f"{r:.1f}" for r in s.die_rows)
            + f"; MoE {s.moe_ms:.2f} ms/iteration (virtual clock), projected "
            f"{s.projected_ms:.2f} ms ({s.projected_scaled_ms:.2f} ms at {SCALED_BATCH} "
            "requests per die)"
        )
    return lines
