"""Per-iteration timing of a die (torch-free, so control-plane code can carry it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class IterationTiming:
    """Wall seconds of one iteration on one die, by kind of work."""

    num_rows: int
    num_sampled: int                   # entries that step (decode-only when rows = sampled + drafted)
    attention_s: float
    xccl_s: float                      # dispatch + combine, waiting for peers included
    experts_s: float                   # gate, routed experts, shared expert
    total_s: float
    vtime_s: float                     # the same iteration on the 910C virtual clock
    num_tokens: int = 0                # tokens the step produced (accepted drafts included)
    num_drafted: int = 0               # MTP drafts verified
    num_accepted: int = 0              # MTP drafts accepted
