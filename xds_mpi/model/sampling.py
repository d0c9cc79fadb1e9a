"""Choosing tokens from logits: greedy or seeded temperature sampling, and checking MTP drafts.

Drafts are the MTP head's greedy choices (a point mass), so speculative sampling reduces to:
accept draft d with probability p(d), otherwise sample from p with d removed. The accepted tokens
are then distributed exactly as plain sampling from the main model; greedy accepts d iff it is the
main model's argmax, so greedy MTP yields exactly the tokens of greedy decoding.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, *, temperature: float, generator: torch.Generator) -> int:
    """logits: [vocab] -> token id (argmax when temperature is 0)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_drafts(
    logits: torch.Tensor, drafts: list[int], *, temperature: float, generator: torch.Generator
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
        probs = torch.softmax(row / temperature, dim=-1)
        if float(torch.rand((), generator=generator, dtype=probs.dtype)) < float(probs[draft]):
            continue
        probs[draft] = 0
        token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
        return [*drafts[:draft_idx], token]
    return [*drafts, sample(logits[len(drafts)], temperature=temperature, generator=generator)]
