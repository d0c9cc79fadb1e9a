"""Per-iteration timing of a die (torch-free, so control-plane code can carry it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class IterationTiming:
    """Wall seconds of one iteration on one die, by kind of work."""

    num_rows: int
    num_sampled: int                   # rows that yield a token (decode-only when == num_rows)
    attention_s: float
    xccl_s: float                      # dispatch + combine, waiting for peers included
    experts_s: float                   # gate, routed experts, shared expert
    total_s: float
    vtime_s: float                     # the same iteration on the 910C virtual clock
