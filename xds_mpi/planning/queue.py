"""A discrete-event replay of a workload's arrivals on a deployment's iteration cost
(docs/planning.md, "The queue model").

Decode is continuous batching over `num_groups` DP groups of at most `max_batch` requests each.
A request reaches its group as the virtual clock hands it over (xds_mpi/planning/kv_handoff.py:
the decode balancer picks its group when it is ready, FIFO; it joins at the first iteration
that starts at or after its KV lands). Every iteration runs on every die together (dispatch and
combine are barriers), so it costs step(requests on the fullest group, their mean KV length,
mean requests per group: the routed rows every die receives) and gives every decoding request
`tokens_per_step` tokens.

- colocated: a request is ready at its arrival and prefills on the decode dies, `chunk_tokens`
  of its prompt per iteration, one prompt at a time on each DP group; an iteration with
  prefill chunks also pays the costliest chunk. Its first token comes with its last chunk.
- PD (`prefill_end_s` given): the prefill dies' batches are replayed apart
  (xds_mpi/planning/prefill_batches.py); a one-token output ends there (ranks/pd/prefill.py
  hands its token to the JE); another is ready for the balancer when its prefill ends, joins
  when its KV has landed, and its first token is the end of its first decode iteration (as
  xds_mpi/results/request_pricing.py prices TTFT: prefill + transfer + one decode step). The
  prefill samples that first token; it streams with the first decode iteration's own, so
  decode owes the other output - 1, as the emulated PD dies do (docs/virtual_time.md, PD).

Between events (a request ready or landing, a prefill done, a request done) the iterations are
alike, so they are taken as one block of k iterations (at most MAX_BLOCK, so the KV length's
growth is priced as it goes)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from xds_mpi.planning.kv_handoff import Balance, KvHandoff, batch_of

MAX_BLOCK = 32
NONE = np.zeros(0, np.int64)
DEFAULT_BALANCE = Balance()


@dataclass(frozen=True, kw_only=True)
class Served:
    """Per request ([n] float64, seconds on the virtual clock): first token and finish times,
    TTFT and TPOT (NaN for a one-token output: no TPOT)."""

    first_s: np.ndarray
    finish_s: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray


def serve(
    *,
    arrival_s,
    prompt_len,
    output_len,
    num_groups: int,
    max_batch: int,
    step,
    tokens_per_step,
    chunk_tokens: int = 0,
    chunk_cost=None,
    prefill_end_s=None,
    transfer_s=None,
    balance: Balance = DEFAULT_BALANCE,
) -> Served:
    """The replay; step(fullest group's batch, its mean KV, mean batch per group) and
    chunk_cost(start, end) are seconds;
    prefill_end_s: PD's prefill ends (None: colocated prefill on the decode dies), transfer_s:
    [n] each KV's move (None: none); balance: the decode balancer's config;
    tokens_per_step: one for all, or [n] each request's own (a run's measured acceptance)."""
    n = len(arrival_s)
    per_request = np.broadcast_to(np.asarray(tokens_per_step, float), (n,))
    is_pd = prefill_end_s is not None
    ready = np.asarray(prefill_end_s if is_pd else arrival_s, float)
    moves = np.zeros(n) if transfer_s is None else np.asarray(transfer_s, float)
    first, finish = np.full(n, np.nan), np.full(n, np.nan)
    # PD: a one-token output ends with its prefill, whose first token goes straight to the JE
    ends_at_prefill = is_pd & (np.asarray(output_len) <= 1)
    first[ends_at_prefill] = finish[ends_at_prefill] = ready[ends_at_prefill]
    handoff = KvHandoff(
        ready,
        moves,
        prompt_len,
        output_len,
        req_ids=np.flatnonzero(~ends_at_prefill),
        num_groups=num_groups,
        max_batch=max_batch,
        balance=balance,
    )
    # the active requests: index, DP group, KV length, tokens still to emit, prompt still to
    # prefill, tokens per step
    idx, group = np.zeros(0, np.int64), np.zeros(0, np.int64)
    kv, left, pre, tps = np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0)
    t = 0.0
    while not handoff.is_done or len(idx):
        handoff.decide(t)
        joining = handoff.land(t)
        if joining:
            new = np.array([i for i, _ in joining], np.int64)
            idx = np.concatenate([idx, new])
            group = np.concatenate([group, np.array([g for _, g in joining], np.int64)])
            kv = np.concatenate([kv, prompt_len[new] if is_pd else np.zeros(len(new))])
            # the first token is the prefill's (PD: it streams with the first decode step's)
            left = np.concatenate([left, output_len[new] - 1])
            pre = np.concatenate([pre, np.zeros(len(new)) if is_pd else prompt_len[new]])
            tps = np.concatenate([tps, per_request[new]])
        if not len(idx):
            assert handoff.next_s() > t, "idle dies, and nothing to join later"
            t = handoff.next_s()
            continue
        decoding = pre == 0
        prefilling = NONE if is_pd else _first_per_group(np.flatnonzero(~decoding), group)
        b = batch_of(group[decoding], kv[decoding], num_groups)
        it = step(max(b.fullest, 1), b.kv_len, b.mean)
        blocks = [MAX_BLOCK]
        if b.fullest:
            blocks.append(math.ceil((left[decoding] / tps[decoding]).min() - 1e-9))
        if len(prefilling):
            blocks.append(math.ceil(pre[prefilling].min() / chunk_tokens))
        if handoff.next_s() < math.inf:
            blocks.append(math.ceil((handoff.next_s() - t) / it))
        k = max(1, min(blocks))
        if len(prefilling):
            done = prompt_len[idx[prefilling]] - pre[prefilling]
            it += max(
                chunk_cost(d, d + min(k * chunk_tokens, p)) / k
                for d, p in zip(done, pre[prefilling])
            )
        if is_pd:  # a request's first decode iteration gives its first token
            new = decoding & np.isnan(first[idx])
            first[idx[new]] = t + it
        t += k * it
        left[decoding] -= k * tps[decoding]
        kv[decoding] += k * tps[decoding]
        if len(prefilling):
            pre[prefilling] = np.maximum(0.0, pre[prefilling] - k * chunk_tokens)
            now = prefilling[pre[prefilling] == 0]
            first[idx[now]] = t  # the last chunk samples the first token
            kv[now] = prompt_len[idx[now]]
        gone = (pre == 0) & (left <= 1e-9)
        finish[idx[gone]] = t
        handoff.finished(idx[gone], t)
        keep = ~gone
        idx, group, kv, left, pre, tps = (
            idx[keep],
            group[keep],
            kv[keep],
            left[keep],
            pre[keep],
            tps[keep],
        )
    ttft = first - np.asarray(arrival_s)
    outputs = np.asarray(output_len)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(outputs > 1, (finish - first) / (outputs - 1), np.nan)
    return Served(first_s=first, finish_s=finish, ttft_s=ttft, tpot_s=tpot)


def _first_per_group(active: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Of the active requests' positions (in joining order), the first on each DP group: a
    die prefills one prompt at a time."""
    _, first = np.unique(group[active], return_index=True)
    return active[np.sort(first)]
