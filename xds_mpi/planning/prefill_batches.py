"""PD's prefill replayed as the prefill dies schedule it (docs/planning.md, "The queue model").

The rule, the emulator's own functions where they are pure:
1. The JE routes each request at its arrival to a prefill TE (xds_mpi/pd/route.py
   `pick_prefill_te`: by length class with 2+ TEs, then the fewest prompt tokens in flight).
2. A TE's prefill DP groups iterate in lockstep (every MoE layer is a dispatch/combine among
   the TE's dies), so a TE's iteration lasts as long as its costliest group's pass.
3. At each iteration's start the TE's leader hands the requests that arrived by then to its
   groups (xds_mpi/pd/prefill.py `assign`: the fewest tokens queued, an idle group takes one,
   a busy one more while its queued tokens stay within one pass's budget, long and short
   prompts never on one group, at most max_batch on a group).
4. Each group's pass is the die scheduler's batch (xds_mpi/scheduling/scheduler.py `schedule`):
   its prompts in order, each a chunk of at most `chunk_tokens`, within `step_tokens` rows.
5. A pass over several prompts is priced by the dies' own pricer (`pass_cost`: the chunks'
   causal pieces in one pass); a prompt whose last chunk is in it ends with the iteration.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from xds_mpi.pd.prefill import PrefillStatus, assign, length_class
from xds_mpi.pd.route import pick_prefill_te

FREE_BLOCKS = 1 << 40  # the replay checks no KV memory (docs/planning.md, "not modelled")


@dataclass(frozen=True, kw_only=True)
class PrefillRule:
    """The prefill dies' batching as a config sets it: step_tokens (xccl.max_tokens_per_die:
    one pass's rows, and the leader's cap on a busy group's queued tokens), chunk_tokens
    (scheduler.prefill_chunk_tokens), long_prompt_tokens (pd.long_prompt_tokens, 0: one class),
    max_batch (scheduler.max_batch_per_die), mtp_depth (scheduler.mtp_depth: depth - 1 rows of
    headroom an entry)."""

    step_tokens: int
    chunk_tokens: int
    long_prompt_tokens: int
    max_batch: int
    mtp_depth: int = 0


@dataclass(frozen=True)
class _Prompt:
    """What `assign` reads of a request: its id and its prompt's length."""

    req_id: int
    prompt: range


@dataclass
class _Held:
    """A prompt on a group: how many of its tokens are computed."""

    req: _Prompt
    done: int = 0

    @property
    def left(self) -> int:
        return len(self.req.prompt) - self.done


@dataclass
class _Te:
    groups: list[list[_Held]]
    pool: list[_Prompt] = field(default_factory=list)
    free_s: float = 0.0  # the end of its last iteration

    def next_start(self) -> float:
        """Its next iteration's start (inf: nothing to do)."""
        if any(self.groups):
            return self.free_s
        return self.free_s if self.pool else math.inf


# pass_cost(pieces, num_sampled): one group's pass over (start, end) pieces of prompts, seconds
PassCost = Callable[[tuple[tuple[int, int], ...], int], float]


def prefill_batches(
    arrival_s: np.ndarray,
    prompt_len: np.ndarray,
    *,
    num_tes: int,
    groups_per_te: int,
    rule: PrefillRule,
    pass_cost: PassCost,
) -> np.ndarray:
    """Each request's prefill end (seconds); arrival_s ascending."""
    n = len(arrival_s)
    tes = [_Te(groups=[[] for _ in range(groups_per_te)]) for _ in range(num_tes)]
    loads, ends = [0] * num_tes, np.full(n, np.nan)
    finished: list[tuple[float, int, int]] = []  # (end, TE, tokens): leaves the JE's load then
    i = 0
    while i < n or any(te.next_start() < math.inf for te in tes):
        te_idx = min(range(num_tes), key=lambda k: tes[k].next_start())
        start = tes[te_idx].next_start()
        if i < n and arrival_s[i] <= start:  # Step 1: the JE routes it, its loads as of now
            while finished and finished[0][0] <= arrival_s[i]:
                _, k, tokens = heapq.heappop(finished)
                loads[k] -= tokens
            tokens = int(prompt_len[i])
            k = pick_prefill_te(tokens, loads, rule.long_prompt_tokens)
            loads[k] += tokens
            te = tes[k]
            if not te.pool and not any(te.groups):
                te.free_s = max(te.free_s, float(arrival_s[i]))  # an idle TE wakes at it
            te.pool.append(_Prompt(i, range(tokens)))
            i += 1
            continue
        te = tes[te_idx]
        cost, done = _iteration(te, rule, pass_cost)  # Steps 2-5
        te.free_s = start + cost
        for req_idx in done:
            ends[req_idx] = te.free_s
            heapq.heappush(finished, (te.free_s, te_idx, int(prompt_len[req_idx])))
    return ends


def _iteration(te: _Te, rule: PrefillRule, pass_cost: PassCost) -> tuple[float, list[int]]:
    """One lockstep iteration of a TE: (its seconds, the requests whose prompts it ended)."""
    # Step 3: the leader assigns the pool by the groups' status
    statuses = [_status(g, rule) for g in te.groups]
    batches, left = assign(
        te.pool,
        statuses,
        block_tokens=1,
        long_prompt_tokens=rule.long_prompt_tokens,
        step_tokens=rule.step_tokens,
    )
    te.pool = left
    for g, batch in zip(te.groups, batches):
        g.extend(_Held(req) for req in batch)
    # Step 4 and 5: each group's pass; the TE waits for its costliest
    cost, done = 0.0, []
    for g in te.groups:
        pieces = _schedule(g, rule)
        if not pieces:
            continue
        ended = [h for h in g if not h.left]
        cost = max(cost, pass_cost(tuple(pieces), len(ended)))
        done += [h.req.req_id for h in ended]
        g[:] = [h for h in g if h.left]
    return cost, done


def _status(group: list[_Held], rule: PrefillRule) -> PrefillStatus:
    """`PrefillScheduler.status` of a group holding `group`."""
    classes = {length_class(h.req, rule.long_prompt_tokens) for h in group}
    return PrefillStatus(
        free_blocks=FREE_BLOCKS,
        room=rule.max_batch - len(group),
        queued_tokens=sum(h.left for h in group),
        length_class=classes.pop() if len(classes) == 1 else -1,
    )


def _schedule(group: list[_Held], rule: PrefillRule) -> list[tuple[int, int]]:
    """`DieScheduler.schedule` over prompts only: chunks in order within the pass's rows;
    advances each prompt's computed tokens."""
    budget, headroom, pieces = rule.step_tokens, max(rule.mtp_depth - 1, 0), []
    for h in group:
        if budget <= headroom:
            break
        num = min(h.left, rule.chunk_tokens, budget - headroom)
        pieces.append((h.done, h.done + num))
        h.done += num
        budget -= num + headroom
    return pieces
