"""prefix: locality-aware routing (DeepServe §5.2): the TE whose cache holds the longest prefix
of the prompt as the JE's prompt tree knows it (`TeState.prefix_tokens`,
xds_mpi/cluster/prompt_tree.py); ties (no TE holds any of it, or two hold as much) go to the
least loaded (`least_load`'s order). Its score: each TE's prefix tokens."""

from __future__ import annotations

from collections.abc import Sequence

from xds_mpi.cluster.policies import Scored, ScoredPolicy, TeState, load_key
from xds_mpi.workload.requests import Request


def longest_prefix(te_states: Sequence[TeState]) -> TeState:
    """The state with the most prefix tokens, ties by the load."""
    return min(te_states, key=lambda s: (-s.prefix_tokens, *load_key(s)))


def scored(request: Request, te_states: Sequence[TeState], now_s: float) -> Scored:
    best = longest_prefix(te_states)
    return Scored(
        te=best.te,
        scores=tuple(float(s.prefix_tokens) for s in te_states),
        note=f"prefix {best.prefix_tokens} tokens",
    )


pick = ScoredPolicy(scored)
