"""A colocated decode iteration priced the way the dies price it: the dies' `Pricer`
(xds_mpi/execution/pricing.py) called layer by layer as the executor calls it
(xds_mpi/execution/executor.py `forward`: the main pass, then with MTP the draft passes).

Every die runs every iteration (dispatch and combine are barriers), so an iteration costs what
the fullest DP group's die spends on its own rows (MLAProlog, attention, gate, the shared
expert, head and sampling, the combine of its rows) plus what a die spends on the routed rows
it receives: those come from every die of the EP group, so they follow the *mean* batch over
the DP groups, not the fullest one. At a batch of 1-2 requests on a few dies the two differ
most: one request on two dies sends its rows to half the experts two requests would reach.

The Pricer adds one term per operation, so an iteration is the sum of two tables: `own_s`
(fullest batch x KV length) and `received_s` (mean batch), each evaluated once per grid point."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from xccl.vclock import VirtualClock
from xds_mpi.config.hardware import load_profile
from xds_mpi.config.model import ModelConfig
from xds_mpi.config.schema import Config
from xds_mpi.execution.pricing import Pricer
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.topology import Topology
from xds_mpi.planning.routing_skew import measured_splits
from xds_mpi.projection.cost import CostModel, Hardware, expected_max_z

EXACT_ROWS = 512  # beyond, the normal approximation (and its cost stays flat)


@dataclass(frozen=True, kw_only=True)
class DieStep:
    """One decode iteration of a colocated EP group, split as the barriers split it.

    fullest: requests on the fullest DP group; mean: requests per DP group over the group
    (may be fractional, and below 1 when some dies are idle); kv_len: their mean KV length;
    accepted: MTP drafts accepted per request per step (the rows the MTP passes run over)."""

    cfg: Config
    mtp_depth: int
    accepted: float

    def _pricer(self) -> Pricer:
        hw = Hardware.from_profile(load_profile(self.cfg.hardware.profile))
        cost = CostModel(cost_shape(), hw, kv_int8=self.cfg.scheduler.kv_int8)
        return Pricer(
            cost,
            self.cfg.model,
            VirtualClock(),
            num_routed_dies=routed_dies(self.cfg),
            use_int8=self.cfg.xccl.use_int8,
        )

    def own_s(self, fullest: int, kv_len: float) -> float:
        """The fullest die's work on its own rows, and the iteration's fixed costs."""
        pricer, tiny = self._pricer(), self.cfg.model
        rows_per_seq = 1 + self.mtp_depth  # the last token and the drafts to verify
        rows = fullest * rows_per_seq
        seqs = [(kv_len + rows_per_seq, rows_per_seq)] * fullest
        shared = rows if is_shared_on_every_die(self.cfg) else 0
        for layer_idx in range(tiny.num_layers):
            is_moe = layer_idx >= tiny.num_dense_layers
            pricer.attention_rows(seqs, is_moe=is_moe)
            if not is_moe:
                pricer.dense_ffn(rows)
                continue
            pricer.gate(rows)
            pricer.experts(0, shared)
            pricer.combine(rows)
        pricer.finish(rows)
        mtp_rows_per_seq = 1 + self.accepted
        for _ in range(self.mtp_depth):  # `Executor._draft`: one pass per depth
            with pricer.mtp_layer():
                mtp_rows = fullest * mtp_rows_per_seq
                pricer.mtp_projection(mtp_rows)
                pricer.attention_rows([(kv_len + rows_per_seq, mtp_rows_per_seq)] * fullest,
                                      is_moe=True)  # fmt: skip
                pricer.gate(mtp_rows)
                pricer.experts(0, mtp_rows if shared else 0)
                pricer.combine(mtp_rows)
                pricer.mtp_head(fullest)
        return pricer.clock.now_ns / 1e9

    def received_s(self, mean: float) -> float:
        """The hottest die's dispatch and routed experts over the rows every die sends it: mean
        requests per DP group x their rows (the tiny model's, as a die receives them; the Pricer
        scales them to the cost shape), layer by layer. The hottest die, since combine waits
        for it: the tiny checkpoint's measured split where it applies (routing_skew.py), else
        top-k rows a token spread at random over the routed dies (the uniform multinomial)."""
        if mean <= 0:
            return 0.0
        pricer, tiny = self._pricer(), self.cfg.model
        groups, dies = num_dp_groups(self.cfg), routed_dies(self.cfg)
        main_tokens = mean * (1 + self.mtp_depth) * groups
        mtp_tokens = mean * (1 + self.accepted) * groups
        num_moe = tiny.num_layers - tiny.num_dense_layers
        main_in, mtp_in = received_rows(tiny, dies, num_moe, main_tokens, mtp_tokens)
        for rows_in in main_in:
            pricer.dispatch(rows_in)
            pricer.experts(rows_in, 0)
        for _ in range(self.mtp_depth):
            with pricer.mtp_layer():
                pricer.dispatch(mtp_in)
                pricer.experts(mtp_in, 0)
        return pricer.clock.now_ns / 1e9


def received_rows(
    tiny: ModelConfig, num_dies: int, num_moe: int, main_tokens: float, mtp_tokens: float
) -> tuple[list[float], float]:
    """(the hottest die's rows at each main MoE layer, at the MTP block) when main_tokens and
    mtp_tokens rows (before top-k) are routed over num_dies dies."""
    splits = measured_splits(tiny, num_dies)
    if splits is None or len(splits) != num_moe + 1:
        main = hottest_rows(main_tokens * tiny.top_k, num_dies)
        return [main] * num_moe, hottest_rows(mtp_tokens * tiny.top_k, num_dies)
    return [s.hottest_rows(main_tokens) for s in splits[:-1]], splits[-1].hottest_rows(mtp_tokens)


def hottest_rows(num_rows: float, num_dies: int) -> float:
    """E[the most rows one of num_dies dies receives] when num_rows rows each go to a die at
    random (fractional num_rows interpolated): exact up to EXACT_ROWS rows, the normal
    approximation beyond."""
    if num_dies <= 1 or num_rows <= 0:
        return num_rows
    if num_rows > EXACT_ROWS:
        p = 1.0 / num_dies
        return num_rows * p + expected_max_z(num_dies) * math.sqrt(num_rows * p * (1 - p))
    low = math.floor(num_rows)
    frac = num_rows - low
    return (1 - frac) * _multinomial_max(low, num_dies) + frac * _multinomial_max(low + 1, num_dies)


@lru_cache(maxsize=4096)
def _multinomial_max(n: int, num_dies: int) -> float:
    """E[max] of a uniform multinomial: sum over k of P(max > k), each P(max <= k) by
    Poissonization: the dies' counts are independent Poisson(n / num_dies) given their sum n,
    so P(max <= k) = P(sum of the counts truncated at k = n) / P(sum = n)."""
    if n == 0:
        return 0.0
    lam = n / num_dies
    ks = np.arange(n + 1)
    pmf = np.exp(ks * math.log(lam) - lam - np.array([math.lgamma(k + 1) for k in ks]))
    p_sum = math.exp(n * math.log(n) - n - math.lgamma(n + 1))
    expected = 0.0
    for k in range(n):
        p_le = _power(pmf[: k + 1], num_dies, n)[n] / p_sum if (k + 1) * num_dies >= n else 0.0
        expected += 1.0 - min(p_le, 1.0)
        if p_le > 1 - 1e-9:
            break
    return expected


def _power(pmf: np.ndarray, times: int, max_len: int) -> np.ndarray:
    """pmf convolved with itself `times` times, truncated to max_len + 1 terms."""
    out, base = np.array([1.0]), pmf
    while times:
        if times & 1:
            out = np.convolve(out, base)[: max_len + 1]
        times >>= 1
        if times:
            base = np.convolve(base, base)[: max_len + 1]
    return np.pad(out, (0, max(0, max_len + 1 - len(out))))


def routed_dies(cfg: Config) -> int:
    """The dies hosting routed experts (ranks/core/die_parts.py `make_pricer`'s count)."""
    dies = Topology.dies_needed(cfg)["colocated"]
    return max(1, dies - cfg.deployment.num_shared_expert_dies)


def num_dp_groups(cfg: Config) -> int:
    return cfg.deployment.num_dp_domains * cfg.deployment.dp_groups_per_domain


def is_shared_on_every_die(cfg: Config) -> bool:
    return cfg.deployment.shared_experts == "every_die"
