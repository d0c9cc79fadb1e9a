"""A discrete-event replay of a workload's arrivals on a deployment's iteration cost
(docs/planning.md, "The queue model").

Decode is continuous batching over `num_groups` DP groups of at most `max_batch` requests each:
every iteration runs on every die together (dispatch and combine are barriers), so it costs
step(requests on the fullest group, mean KV length, mean requests per group: the routed rows
every die receives) and gives every decoding request
`tokens_per_step` tokens. A request joins at the first iteration that starts at or after it is
ready, when a slot is free (FIFO).

- colocated: a request is ready at its arrival and prefills on the decode dies, `chunk_tokens`
  of its prompt per iteration, at most one prompt per DP group at a time; an iteration with
  prefill chunks also pays the costliest chunk. Its first token comes with its last chunk.
- PD (`prefill_ready_s` given): the prefill dies' batches are replayed apart
  (xds_mpi/planning/prefill_batches.py); a request is ready for decode when its KV has
  arrived, and its first token is the end of its first decode iteration (as
  xds_mpi/results/request_pricing.py prices TTFT: prefill + transfer + one decode step). The
  prefill samples that first token; it streams with the first decode iteration's own, so
  decode owes the other output - 1, as the emulated PD dies do (docs/virtual_time.md, PD).

Between events (a request ready, a prefill done, a request done) the iterations are alike, so
they are taken as one block of k iterations (at most MAX_BLOCK, so the KV length's growth is
priced as it goes)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_BLOCK = 32
NONE = np.zeros(0, np.int64)


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
    prefill_ready_s=None,
) -> Served:
    """The replay; step(fullest group's batch, mean KV, mean batch per group) and
    chunk_cost(start, end) are seconds;
    prefill_ready_s: PD's decode-ready times (None: colocated prefill on the decode dies);
    tokens_per_step: one for all, or [n] each request's own (a run's measured acceptance)."""
    n = len(arrival_s)
    per_request = np.broadcast_to(np.asarray(tokens_per_step, float), (n,))
    is_pd = prefill_ready_s is not None
    ready = np.asarray(prefill_ready_s if is_pd else arrival_s, float)
    order = list(np.argsort(ready, kind="stable"))[::-1]  # pop() takes the earliest
    first, finish = np.full(n, np.nan), np.full(n, np.nan)
    # the active requests: index, KV length, tokens still to emit, prompt tokens still to prefill
    idx, kv, left, pre = (np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0))
    tps = np.zeros(0)  # the active requests' tokens per step
    capacity, t = num_groups * max_batch, 0.0
    while order or len(idx):
        joining = []
        while order and ready[order[-1]] <= t and len(idx) + len(joining) < capacity:
            joining.append(order.pop())
        if joining:
            new = np.array(joining)
            idx = np.concatenate([idx, new])
            kv = np.concatenate([kv, prompt_len[new] if is_pd else np.zeros(len(new))])
            # the first token is the prefill's (PD: it streams with the first decode step's)
            left = np.concatenate([left, output_len[new] - 1])
            pre = np.concatenate([pre, np.zeros(len(new)) if is_pd else prompt_len[new]])
            tps = np.concatenate([tps, per_request[new]])
        if not len(idx):
            t = max(t, ready[order[-1]])
            continue
        decoding = pre == 0
        prefilling = NONE if is_pd else np.flatnonzero(~decoding)[:num_groups]
        num_decoding = int(decoding.sum())
        batch = -(-num_decoding // num_groups)
        mean_kv = float(kv[decoding].sum()) / num_decoding if batch else 1.0
        it = step(max(batch, 1), mean_kv, num_decoding / num_groups)
        blocks = [MAX_BLOCK]
        if batch:
            blocks.append(math.ceil((left[decoding] / tps[decoding]).min() - 1e-9))
        if len(prefilling):
            blocks.append(math.ceil(pre[prefilling].min() / chunk_tokens))
        if order and len(idx) < capacity:
            blocks.append(math.ceil((ready[order[-1]] - t) / it))
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
        idx, kv, left, pre, tps = idx[~gone], kv[~gone], left[~gone], pre[~gone], tps[~gone]
    ttft = first - np.asarray(arrival_s)
    outputs = np.asarray(output_len)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(outputs > 1, (finish - first) / (outputs - 1), np.nan)
    return Served(first_s=first, finish_s=finish, ttft_s=ttft, tpot_s=tpot)
