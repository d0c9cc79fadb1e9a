"""What the dies and the TE-shell tell each other about expert load (§4.5 Steps 1 and 3), on
the control plane (two-sided MPI, tags beside ranks/core/messages.py's)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xds_mpi.eplb.placement import Placement


@dataclass(frozen=True, kw_only=True)
class CountSlice:
    """One DP group's counts over one time slice (`interval` iterations), die -> TE-shell.

    slice_idx: the slice's number, from 0, the same on every die (dies run in lockstep).
    counts: [num_moe_layers, num_experts] tokens its gate sent to each logical expert.
    rows_in: [num_moe_layers] routed rows dispatch delivered to this die (its measured load).
    moe_vtime_s: virtual seconds of gate + dispatch + experts + combine over the slice.
    num_iterations: iterations in the slice. version_start / version_end: placement version in
    use at the slice's first / after its last iteration. num_loading: iterations of the slice
    that ran while weights were loading (Step 3 phase 3); num_prefill: iterations whose batch on
    this die held prompt rows. load_s: virtual seconds of every
    weight load of the die so far (overlapped with decoding, not on the iteration's path)."""

    die_rank: int
    slice_idx: int
    counts: np.ndarray
    rows_in: np.ndarray
    moe_vtime_s: float
    num_iterations: int
    version_start: int
    version_end: int
    num_loading: int
    num_prefill: int
    load_s: float


@dataclass(frozen=True, kw_only=True)
class PlacementUpdate:
    """A new placement from the TE-shell (Step 2's result), to be swapped in by Step 3.

    version: 1, 2, ... in the order the TE-shell computed them; placement: every MoE layer."""

    version: int
    placement: Placement
