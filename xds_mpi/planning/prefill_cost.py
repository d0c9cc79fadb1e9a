"""What a prefill pass costs a die, as the dies' Pricer prices it: one prompt on a grid of
lengths (`PrefillCurve`: a colocated die's chunks) and a prefill DP group's pass over pieces of
several prompts (`PrefillPass`).

The pass is `RequestPricer.pass_s` (xds_mpi/results/request_pricing.py: causal at 512-token
grain, TP1/2/4), which spreads the routed rows evenly: a die of the EP group receives its own
rows x top-k. With the tiny checkpoint the hottest die receives more (its gate sends ~40 % of
a layer's rows to one expert), and the dispatch and routed experts wait for it: `pass_s`
with `skew` prices the pass with the hottest die's rows, `skew[i]` x the even spread at MoE
layer i (xds_mpi/planning/routing_skew.py `prefill_skew`); skew None (the cost shape at pod
scale, its gate balanced) spreads them evenly."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from xds_mpi.planning.costs import base_config
from xds_mpi.results.request_pricing import RequestPricer, causal_chunks

Skew = tuple[float, ...] | None  # per main MoE layer, then the MTP block


@dataclass(frozen=True, kw_only=True)
class PrefillCurve:
    """pass_s[k]: a prompt of prompt_len[k] tokens in one pass (index 0: 0 tokens, 0 s)."""

    prompt_len: np.ndarray
    pass_s: np.ndarray

    def __call__(self, tokens: float) -> float:
        return float(np.interp(tokens, self.prompt_len, self.pass_s))

    def chunk(self, start: float, end: float) -> float:
        return self(end) - self(start)


@lru_cache(maxsize=256)
def prefill_curve(
    num_dies: int, tp: int, profile: str, max_prompt: int, skew: Skew = None
) -> PrefillCurve:
    rp = _request_pricer(num_dies, tp, profile)
    # short prompts on their own points: a pass's fixed costs (graph launch, bubble, the
    # exchanges' latency) make F far from linear below 512 tokens, where a reduced run's are
    lens = [0, 1, 16, 64, 256, 512]
    while lens[-1] < max_prompt:
        lens.append(lens[-1] * 2)
    secs = [0.0] + [
        rp.pass_s(causal_chunks(n), num_dies, sampled=1, tp=tp, skew=skew) for n in lens[1:]
    ]
    return PrefillCurve(prompt_len=np.array(lens, float), pass_s=np.array(secs))


class PrefillPass:
    """One prefill DP group's pass over pieces of several prompts, as the dies' Pricer prices it
    (`pass_s` with the skew over each piece's causal chunks in one pass): the batch's rows share the
    pass's fixed costs and its MoE, each prompt's attention stays its own. With MTP the prefill
    dies also run each MTP module over the pass's rows (xds_mpi/execution/executor.py
    `_draft`), which `pass_s` leaves out: `mtp_s` adds it."""

    def __init__(
        self, num_dies: int, tp: int, profile: str, mtp_depth: int = 0, skew: Skew = None
    ) -> None:
        self.pricer = _request_pricer(num_dies, tp, profile)
        self.num_dies, self.tp, self.mtp_depth, self.skew = num_dies, tp, mtp_depth, skew
        self._cache: dict[tuple, float] = {}

    def __call__(self, pieces: tuple[tuple[int, int], ...], num_sampled: int) -> float:
        """pieces: (first, end) tokens of each prompt computed in the pass; num_sampled: the
        prompts whose last token is in it."""
        key = (pieces, num_sampled)
        if key not in self._cache:
            seqs = [c for start, end in pieces for c in causal_chunks(end, start)]
            main = self.pricer.pass_s(
                seqs, self.num_dies, sampled=num_sampled, tp=self.tp, skew=self.skew
            )
            self._cache[key] = main + self.mtp_depth * self.mtp_s(seqs, num_sampled)
        return self._cache[key]

    def mtp_s(self, seqs: list[tuple[int, int]], num_sampled: int) -> float:
        """One MTP module over the pass's rows, priced as `RequestPricer.pass_s` prices a MoE
        layer (`Pricer.mtp_layer`: one layer of the cost shape), then its head over the prompts
        that draft (those sampled)."""
        rp, tp = self.pricer, self.tp
        pricer = rp.die_pricer(self.num_dies, tp)
        share = -(-sum(n for _, n in seqs) // tp)
        with pricer.mtp_layer():
            pricer.mtp_projection(share)
            if tp > 1:
                pricer.mla_layer(seqs, share, is_moe=True)
            else:
                pricer.attention_rows(seqs, is_moe=True)
            rows_in = share * rp.tiny.top_k * (self.skew[-1] if self.skew else 1.0)
            pricer.gate(share)
            pricer.dispatch(rows_in)
            pricer.experts(rows_in, share)
            pricer.combine(share)
            if tp > 1:
                pricer.exchanged(pricer.rows_values(share), 0.0, is_moe=None)
            pricer.mtp_head(num_sampled)
        return pricer.clock.now_ns / 1e9


@lru_cache(maxsize=64)
def prefill_pass(
    num_dies: int, tp: int, profile: str, mtp_depth: int = 0, skew: Skew = None
) -> PrefillPass:
    return PrefillPass(num_dies, tp, profile, mtp_depth, skew)


def _request_pricer(num_dies: int, tp: int, profile: str) -> RequestPricer:
    cfg = base_config((f"deployment.prefill_tp={tp}",), profile)
    return RequestPricer(
        cfg, num_prefill_dies=num_dies, num_decode_dies=num_dies, batch_per_die=1, is_pd=tp > 1
    )
