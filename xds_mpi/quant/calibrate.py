"""Calibration: what each quantizable projection's input looks like on training text.

Every projection of a float model is wrapped by a recorder that keeps, over the rows it sees, the
per-input-channel max |x| (for smoothing) and X^T X (GPTQ's Hessian). Windows are added in
batches until every routed expert of every MoE layer has seen `min_tokens_per_expert` rows
(xDeepServe §4.7 grows the calibration set until each expert has enough samples) or
`max_windows` is reached; experts still short are reported (quantize.py rounds them to nearest
without smoothing or GPTQ: too few rows to estimate either).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xds_mpi.model.transformer import DeepSeekModel
from xds_mpi.quant.sites import blocks, forward_windows, projection_sites
from xds_mpi.quant.text import random_windows


class InputStats:
    """One projection's calibration inputs: absmax [in], xtx [in, in] = sum of x^T x, num_rows."""

    def __init__(self, in_features: int) -> None:
        self.absmax = np.zeros(in_features)
        self.xtx = np.zeros((in_features, in_features))
        self.num_rows = 0

    def add(self, x: np.ndarray) -> None:
        """x: [rows, in]"""
        x = np.asarray(x, np.float64)
        if x.shape[0]:
            self.absmax = np.maximum(self.absmax, np.abs(x).max(axis=0))
            self.xtx += x.T @ x
            self.num_rows += x.shape[0]

    @property
    def hessian(self) -> np.ndarray:
        """[in, in] X^T X / rows (zeros before any row)."""
        return self.xtx / max(1, self.num_rows)


class _Recorder:
    def __init__(self, inner, stats: InputStats) -> None:
        self.inner, self.stats = inner, stats

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.stats.add(x)
        return self.inner(x)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    stats: dict[str, InputStats]  # projection weight name -> its input statistics
    num_windows: int
    window_len: int
    expert_tokens: dict[str, list[int]]  # MoE prefix ("layers.1.ffn.") -> rows per expert
    min_tokens_per_expert: int

    @property
    def short_experts(self) -> dict[str, int]:
        """Expert prefix ("layers.1.ffn.experts.7.") -> its rows, for those under the minimum."""
        return {
            f"{prefix}experts.{e}.": n
            for prefix, counts in self.expert_tokens.items()
            for e, n in enumerate(counts)
            if n < self.min_tokens_per_expert
        }


def calibrate(
    model: DeepSeekModel,
    train_stream: np.ndarray,
    *,
    window_len: int,
    batch_windows: int,
    min_tokens_per_expert: int,
    max_windows: int,
    seed: int,
) -> Calibration:
    """Run `model` (float, built for this call: its projections get wrapped) over random training
    windows until every expert has min_tokens_per_expert rows or max_windows were run."""
    stats = {}
    for name, owner, attr in projection_sites(model):
        inner = getattr(owner, attr)
        stats[name] = InputStats(inner.weight.shape[1])
        setattr(owner, attr, _Recorder(inner, stats[name]))
    for _, block in blocks(model):
        block.attn.use_projections()  # Wq_b and Wo see their own inputs
    moe_prefixes = [f"{prefix}ffn." for prefix, block in blocks(model) if block.is_moe]
    num_experts = model.cfg.num_routed_experts
    num_windows, batch_idx = 0, 0
    while num_windows < max_windows:
        batch = min(batch_windows, max_windows - num_windows)
        windows = random_windows(
            train_stream, num_windows=batch, window_len=window_len, seed=[seed, batch_idx]
        )
        forward_windows(model, windows)
        num_windows, batch_idx = num_windows + batch, batch_idx + 1
        counts = [
            stats[f"{p}experts.{e}.w1.weight"].num_rows
            for p in moe_prefixes
            for e in range(num_experts)
        ]
        if min(counts, default=min_tokens_per_expert) >= min_tokens_per_expert:
            break
    return Calibration(
        stats=stats,
        num_windows=num_windows,
        window_len=window_len,
        expert_tokens={
            p: [stats[f"{p}experts.{e}.w1.weight"].num_rows for e in range(num_experts)]
            for p in moe_prefixes
        },
        min_tokens_per_expert=min_tokens_per_expert,
    )
