"""combined: DeepServe's Algorithm 1 (§5.4), narrowing the TEs to one:

1. PD-aware: with a heatmap (`cluster.heatmap`), the TEs of the type it picks for the request
   (`pd_heatmap`'s rule); without one, every TE.
2. Balanced or not: the remaining TEs are *balanced* when the most loaded one's unfinished tokens
   exceed the least loaded one's by at most `cluster.balance_tolerance` of it:
   max - min <= tolerance x min (every TE idle is balanced; one idle and one not is not).
3. Balanced: locality-aware, the TE with the longest cached prefix (`prefix`, ties by the load).
   Unbalanced: load-aware, the least loaded TE (`least_load`'s order).

Its score, per TE considered: its prefix tokens on the balanced branch, minus its unfinished
tokens on the other; NaN for a TE the type left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from xds_mpi.cluster.policies import Scored, ScoredPolicy, TeState, load_key
from xds_mpi.cluster.policies.pd_heatmap import TypeByHeatmap, output_scale, read_map
from xds_mpi.cluster.policies.prefix import longest_prefix
from xds_mpi.cluster.predict import predictor_from
from xds_mpi.workload.requests import Request

if TYPE_CHECKING:
    from xds_mpi.config.schema import Config


def check(cfg: Config) -> None:
    """A heatmap named must be readable (none: step 1 keeps every TE)."""
    if cfg.cluster.heatmap:
        read_map(cfg)


def is_balanced(te_states: Sequence[TeState], tolerance: float) -> bool:
    """Step 2: the most loaded TE's unfinished tokens within `tolerance` of the least's."""
    loads = [s.unfinished_tokens for s in te_states]
    return max(loads) - min(loads) <= tolerance * min(loads)


def make(cfg: Config) -> ScoredPolicy:
    by_type = (
        TypeByHeatmap(read_map(cfg), predictor_from(cfg), output_scale(cfg))
        if cfg.cluster.heatmap
        else None
    )
    tolerance = cfg.cluster.balance_tolerance

    def scored(request: Request, te_states: Sequence[TeState], now_s: float) -> Scored:
        # Step 1 (§5.4): the type by the heatmap
        candidates, note = list(te_states), "no heatmap"
        if by_type is not None:
            candidates, _, note = by_type.narrow(request, te_states)
        scores = [math.nan] * len(te_states)
        at = {state.te: i for i, state in enumerate(te_states)}  # a score per candidate
        # Step 2: balanced -> the most reusable KV (§5.2); else the least load
        if is_balanced(candidates, tolerance):
            best = longest_prefix(candidates)
            for s in candidates:
                scores[at[s.te]] = float(s.prefix_tokens)
            note += f"; balanced -> prefix {best.prefix_tokens} tokens"
        else:
            best = min(candidates, key=load_key)
            for s in candidates:
                scores[at[s.te]] = -float(s.unfinished_tokens)
            note += "; unbalanced -> least load"
        return Scored(te=best.te, scores=tuple(scores), note=note)

    return ScoredPolicy(scored)
