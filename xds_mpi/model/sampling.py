"""Choosing tokens from logits: greedy or seeded temperature sampling, and checking MTP drafts.

Drafts are the MTP head's greedy choices (a point mass), so speculative sampling reduces to:
accept draft d with probability p(d), otherwise sample from p with d removed. The accepted tokens
are then distributed exactly as plain sampling from the main model; greedy accepts d iff it is the
main model's argmax, so greedy MTP yields exactly the tokens of greedy decoding.
"""

from __future__ import annotations

import numpy as np

from xds_mpi.model.layers import softmax


def sample(logits: np.ndarray, *, temperature: float, generator: np.random.Generator | None) -> int:
    """logits: [vocab] -> token id (argmax when temperature is 0)."""
    if temperature == 0:
        return int(logits.argmax())
    return _draw(softmax(logits / temperature), generator)


def _draw(probs: np.ndarray, generator: np.random.Generator) -> int:
    """One token from probs [vocab] (not necessarily summing to 1): inverse CDF of one uniform."""
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, generator.random() * cdf[-1], side="right")), len(cdf) - 1)


def verify_drafts(
    logits: np.ndarray,
    drafts: list[int],
    *,
    temperature: float,
    generator: np.random.Generator | None,
) -> list[int]:
    """logits: [len(drafts) + 1, vocab], row j from the main model at the position before draft j.

    Returns the accepted drafts followed by one token from the main model (the correction at the
    first rejected draft, or the bonus token after the last when all are accepted).
    """
    for draft_idx, draft in enumerate(drafts):
        row = logits[draft_idx]
        if temperature == 0:
            token = int(row.argmax())
            if token != draft:
                return [*drafts[:draft_idx], token]
            continue
        probs = softmax(row / temperature)
        if generator.random() < probs[draft]:
            continue
        probs[draft] = 0
        return [*drafts[:draft_idx], _draw(probs, generator)]
    return [*drafts, sample(logits[len(drafts)], temperature=temperature, generator=generator)]
