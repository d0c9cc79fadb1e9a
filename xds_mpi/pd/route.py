"""The JE's choice of a prefill TE for a request (xDeepServe §5.1 step 1), torch-free.

The rule, by length first and load second:
- Length: with 2+ prefill TEs and `pd.long_prompt_tokens` > 0, the last n // 2 TEs serve long
  prompts (at least that many tokens) and the first n - n // 2 serve short ones, so long and
  short requests never share a TE (nor, within a TE, a DP group: its leader keeps them apart,
  xds_mpi/pd/prefill.py). With one TE, or the threshold 0, every TE serves every prompt. The
  split is static: a stream of only long (or only short) prompts leaves the other TEs idle,
  which is the price of never putting a short request behind a long one.
- Lost TEs (a prefill die found silent, ranks/recovery/je_prefill_loss.py) take nothing more; when
no
  live TE serves a prompt's length, any live TE takes it (losing a TE must lose no request).
- Load: among the TEs serving its length, the one with the fewest prompt tokens the JE sent it
  whose prefill has not finished (pending in its pool or being computed); ties go to the lowest
  TE index.
"""

from __future__ import annotations

from collections.abc import Sequence


def tes_for(prompt_tokens: int, num_tes: int, long_prompt_tokens: int) -> range:
    """The TEs a prompt of this length may go to."""
    if num_tes < 2 or not long_prompt_tokens:
        return range(num_tes)
    first_long = num_tes - num_tes // 2
    return range(first_long, num_tes) if prompt_tokens >= long_prompt_tokens else range(first_long)


def pick_prefill_te(
    prompt_tokens: int, loads: Sequence[int], long_prompt_tokens: int, lost: frozenset = frozenset()
) -> int:
    """The TE for a prompt of `prompt_tokens`, given each TE's tokens in flight."""
    live = [t for t in tes_for(prompt_tokens, len(loads), long_prompt_tokens) if t not in lost]
    live = live or [t for t in range(len(loads)) if t not in lost]
    if not live:
        raise RuntimeError(f"every prefill TE ({len(loads)}) is lost: no prefill left")
    return min(live, key=lambda t: (loads[t], t))


class PrefillRouter:
    """The JE's view of its prefill TEs: tokens in flight per TE, updated on dispatch and when a
    request's prefill finishes (its PD-transfer task, or its only token, reaches the JE)."""

    def __init__(self, num_tes: int, long_prompt_tokens: int) -> None:
        self.loads = [0] * num_tes
        self.long_prompt_tokens = long_prompt_tokens
        self._where: dict[int, tuple[int, int]] = {}  # req_id -> (TE, prompt tokens)
        self.lost: frozenset[int] = frozenset()

    def dispatch(self, req_id: int, prompt_tokens: int) -> int:
        te = pick_prefill_te(prompt_tokens, self.loads, self.long_prompt_tokens, self.lost)
        self.loads[te] += prompt_tokens
        self._where[req_id] = (te, prompt_tokens)
        return te

    def prefilled(self, req_id: int) -> None:
        """No-op for a request already counted (its later tokens)."""
        if (where := self._where.pop(req_id, None)) is not None:
            self.loads[where[0]] -= where[1]

    def in_flight(self) -> tuple[int, ...]:
        return tuple(self._where)

    def lose(self, te: int) -> tuple[int, ...]:
        """TE `te` is gone: it takes nothing more; the requests it had not prefilled."""
        self.lost |= {te}
        ids = tuple(r for r, (t, _) in self._where.items() if t == te)
        for req_id in ids:
            self.prefilled(req_id)
        return ids
