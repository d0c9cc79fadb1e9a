"""What one decode iteration costs a candidate, as a function of batch and KV length, and
what a prompt's KV costs to move.

Colocated and PD: the dies' own pricing (xds_mpi/planning/die_step.py `DieStep`: the fullest DP
group's rows on a grid of requests x KV length, the routed rows a die receives on a grid of the
mean requests per DP group), interpolated (linear) in between. afd: the afd dies' own pricing on
their two clocks (xds_mpi/planning/afd_step.py `AfdStep`) at the fullest attention die's batch,
on the same grid. A prefill pass: xds_mpi/planning/prefill_cost.py. PD's KV moves over UB to
another server (the same LinkModel the PD dies use)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from xccl.vclock import LinkModel
from xds_mpi.config.hardware import load_profile
from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import Config, load_config
from xds_mpi.model.shapes import load_model_preset
from xds_mpi.plan.kv_memory import projected_kv_bytes
from xds_mpi.planning.afd_step import AfdStep
from xds_mpi.planning.die_step import DieStep

BASE_CONFIG = "ep288"  # the model section every pod-scale config of the repo carries
SHAPE = "deepseek_v3"
BATCH_GRID = (1, 2, 4, 8, 16, 32, 64, 96, 128)
KV_GRID = (1024, 8192, 65536, 262144)
MEAN_GRID = (0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0, 96.0, 128.0)


def base_config(sets: tuple[str, ...], profile: str, base: str = BASE_CONFIG) -> Config:
    """`base` (a config of configs/) with `sets` on the hardware profile."""
    return load_config(resolve_config(base), [*sets, f"hardware.profile={profile}"])


@dataclass(frozen=True, kw_only=True)
class StepTable:
    """One decode iteration = iteration_s at (the fullest DP group's requests, their mean KV
    length) + received_s at the mean requests per DP group; tokens_per_step: 1 + MTP depth x
    acceptance.

    iteration_s[i][j]: BATCH_GRID[i] requests on the fullest DP group, mean KV KV_GRID[j] (its
    own rows and the fixed costs; afd: the whole iteration); received_s[k]: a die's routed rows
    at MEAN_GRID[k] requests per DP group (afd: 0, `AfdStep` holds them)."""

    iteration_s: tuple[tuple[float, ...], ...]  # [len(BATCH_GRID)][len(KV_GRID)] seconds
    received_s: tuple[float, ...]  # [len(MEAN_GRID)] seconds
    tokens_per_step: float

    def __call__(self, batch: float, kv_len: float, mean: float | None = None) -> float:
        """Linear between the grid's points, held at its edges (called once per event of the
        replay: plain floats, no numpy call); mean: requests per DP group (None: batch)."""
        i, u = _cell(BATCH_GRID, batch)
        j, v = _cell(KV_GRID, kv_len)
        g = self.iteration_s
        low = g[i][j] + (g[i + 1][j] - g[i][j]) * u
        high = g[i][j + 1] + (g[i + 1][j + 1] - g[i][j + 1]) * u
        k, w = _cell(MEAN_GRID, batch if mean is None else mean)
        r = self.received_s
        return low + (high - low) * v + r[k] + (r[k + 1] - r[k]) * w


def _cell(grid: tuple, x: float) -> tuple[int, float]:
    """(i, fraction) with grid[i] <= x <= grid[i + 1], x clamped to the grid."""
    i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
    frac = (x - grid[i]) / (grid[i + 1] - grid[i])
    return i, min(max(frac, 0.0), 1.0)


@lru_cache(maxsize=4096)
def step_table(
    decode_sets: tuple[str, ...],
    profile: str,
    mtp_depth: int,
    accept: float,
    base: str = BASE_CONFIG,
) -> StepTable:
    """The candidate's decode iteration (decode_sets over `base`) at MTP `mtp_depth`, each
    draft accepted at `accept`."""
    cfg = base_config(decode_sets, profile, base)
    tokens_per_step = 1 + mtp_depth * accept
    if cfg.deployment.kind != "afd":
        die = DieStep(cfg=cfg, mtp_depth=mtp_depth, accepted=mtp_depth * accept)
        return StepTable(
            iteration_s=tuple(tuple(die.own_s(b, kv) for kv in KV_GRID) for b in BATCH_GRID),
            received_s=tuple(die.received_s(mean) for mean in MEAN_GRID),
            tokens_per_step=tokens_per_step,
        )
    afd = AfdStep(cfg=cfg, mtp_depth=mtp_depth, accepted=mtp_depth * accept)
    return StepTable(
        iteration_s=tuple(tuple(afd.iteration_s(b, kv) for kv in KV_GRID) for b in BATCH_GRID),
        received_s=(0.0,) * len(MEAN_GRID),
        tokens_per_step=tokens_per_step,
    )


@lru_cache(maxsize=8)
def kv_transfer(profile: str) -> tuple[LinkModel, int]:
    cfg = base_config((), profile)
    return LinkModel.from_profile(load_profile(profile)), cfg.xccl.num_cores


def transfer_s(prompt_len: np.ndarray, profile: str, *, kv_int8: bool) -> np.ndarray:
    """A prompt's latent KV over UB to a decode die on another server, per request."""
    link, cores = kv_transfer(profile)
    m = load_model_preset(SHAPE)
    return np.array(
        [
            link.transfer_ns(projected_kv_bytes(int(p), m, kv_int8=kv_int8), num_cores=cores) / 1e9
            for p in prompt_len
        ]
    )
