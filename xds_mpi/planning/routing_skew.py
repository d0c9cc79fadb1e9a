"""How the tiny model's gate splits a batch's routed rows between two dies, measured from its
checkpoint, beside the uniform assumption the pod-scale pricing keeps.

Two assumptions, one per model:
- the cost shape at pod scale (DeepSeek-V3, its gate balanced by the auxiliary-loss-free bias):
  each routed row goes to a die at random, the hottest die's rows are the uniform
  multinomial's expected maximum (`die_step.hottest_rows`);
- the tiny trained checkpoint (`model.weights: tiny`, which every reduced verification serves):
  its gate is far from uniform (one expert takes ~40 % of a layer's rows), and with its 16
  experts over 2 dies (the reduced runs' EP width) the hottest die's rows follow the measured
  `TwoDieSplit` per MoE layer: the share of tokens sending 0, 1 or 2 of their top-2 rows to the
  first die (experts 0-7, as `ExpertSlots` places them). For n tokens the first die receives
  S ~ the n-fold sum, the other 2n - S, and the hottest die max(S, 2n - S): exact, no sampling.

How the tables were made (xds_mpi/planning/routing_measure.py, rerun by the unit test):
NUM_REQUESTS prompts of random tokens (the trace's served prompts are random tokens too) of
20-299 tokens, seed SEED, decoded greedily by the reference generator for OUTPUT_LEN tokens past
EOS (the verification runs ignore EOS); then each prompt + output in one causal pass, the gate's
top-2 at every MoE layer and at the MTP module's block (the draft pass's rows) counted over the
generated positions (the decode rows). Prefill rows (the prompts') are counted alike in
PREFILL_SPLITS. EXPERT_SHARES (the decode rows' share of each expert) prices a disaggregated
expert die, which pays per expert slot a row reaches (xds_mpi/planning/afd_step.py);
PREFILL_EXPERT_SHARES (the prompt rows') the hottest die of a prefill EP group (`prefill_skew`,
xds_mpi/planning/prefill_cost.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from xds_mpi.config.model import ModelConfig

SEED = 0
NUM_REQUESTS = 32
OUTPUT_LEN = 48
MEASURED_WEIGHTS = "tiny"
MEASURED_SHAPE = (16, 2)  # (num_routed_experts, top_k) the table holds for
EXACT_TOKENS = 1024  # beyond, the normal approximation of S


@dataclass(frozen=True, kw_only=True)
class TwoDieSplit:
    """One MoE layer's tokens by how many of their top-2 rows go to the first of two dies:
    share[j] = P(j rows), j = 0, 1, 2 (sums to 1)."""

    share: tuple[float, float, float]

    def hottest_rows(self, num_tokens: float) -> float:
        """E[max(S, 2n - S)]: the rows the hottest of the two dies receives from n tokens
        (fractional n interpolated)."""
        if num_tokens <= 0:
            return 0.0
        low = math.floor(num_tokens)
        frac = num_tokens - low
        return (1 - frac) * _hottest(self.share, low) + frac * _hottest(self.share, low + 1)


@lru_cache(maxsize=8192)
def _hottest(share: tuple[float, float, float], n: int) -> float:
    if n == 0:
        return 0.0
    if n > EXACT_TOKENS:  # S normal: E|S - n| = sd x sqrt(2 / pi), E[max] = n + that
        mean = share[1] + 2 * share[2]
        var = share[1] + 4 * share[2] - mean * mean
        drift = n * abs(mean - 1)
        return n + max(drift, math.sqrt(n * var * 2 / math.pi))
    pmf, base = np.array([1.0]), np.array(share)
    times = n
    while times:  # n-fold convolution by squaring: S's distribution over 0..2n
        if times & 1:
            pmf = np.convolve(pmf, base)
        times >>= 1
        if times:
            base = np.convolve(base, base)
    s = np.arange(2 * n + 1)
    return float(np.dot(pmf, np.maximum(s, 2 * n - s)))


# `routing_measure.measure()` at SEED: main MoE layers 1-3, then the MTP module's block.
DECODE_SPLITS = (
    TwoDieSplit(share=(0.0462, 0.3522, 0.6016)),
    TwoDieSplit(share=(0.0026, 0.6628, 0.3346)),
    TwoDieSplit(share=(0.0111, 0.8574, 0.1315)),
    TwoDieSplit(share=(0.071, 0.6868, 0.2422)),
)
PREFILL_SPLITS = (
    TwoDieSplit(share=(0.1785, 0.5607, 0.2608)),
    TwoDieSplit(share=(0.0406, 0.6029, 0.3565)),
    TwoDieSplit(share=(0.054, 0.8587, 0.0873)),
    TwoDieSplit(share=(0.3549, 0.562, 0.0831)),
)
# the decode rows' share of each expert (P(a token sends a row to it); sums to top_k = 2)
# fmt: off
EXPERT_SHARES = (
    (0.0208, 0.3184, 0.0143, 0.3216, 0.707, 0.0026, 0.0026, 0.168,
     0.0169, 0.0124, 0.1543, 0.0866, 0.0033, 0.097, 0.0273, 0.0469),
    (0.0475, 0.0488, 0.1725, 0.1139, 0.8822, 0.0508, 0.0124, 0.0039,
     0.0163, 0.0195, 0.0365, 0.2507, 0.0007, 0.0052, 0.3392, 0.0),
    (0.0365, 0.002, 0.0697, 0.0072, 0.9759, 0.0215, 0.0007, 0.0072,
     0.0007, 0.0495, 0.0007, 0.0625, 0.0039, 0.0039, 0.0697, 0.6888),
    (0.4342, 0.0195, 0.0241, 0.4375, 0.0, 0.0703, 0.0482, 0.1374,
     0.0078, 0.0111, 0.0729, 0.0026, 0.002, 0.6536, 0.0384, 0.0404),
)
# fmt: on
# the prompt rows' share of each expert
# fmt: off
PREFILL_EXPERT_SHARES = (
    (0.0387, 0.0523, 0.0686, 0.2212, 0.396, 0.0466, 0.0458, 0.2131,
     0.0492, 0.0998, 0.1658, 0.1395, 0.0869, 0.2105, 0.069, 0.097),
    (0.1232, 0.0335, 0.1325, 0.1292, 0.7452, 0.1092, 0.0138, 0.0294,
     0.0337, 0.0327, 0.0948, 0.1408, 0.0208, 0.0045, 0.3496, 0.0073),
    (0.0107, 0.0107, 0.0495, 0.0101, 0.894, 0.0249, 0.0135, 0.02,
     0.0258, 0.1152, 0.0052, 0.1898, 0.005, 0.0052, 0.1105, 0.51),
    (0.359, 0.0438, 0.0213, 0.0927, 0.0011, 0.0606, 0.0088, 0.1409,
     0.0653, 0.0542, 0.381, 0.0081, 0.0045, 0.6978, 0.0463, 0.0147),
)
# fmt: on


def measured_splits(model: ModelConfig, num_dies: int, *, is_prefill: bool = False):
    """The measured splits (main MoE layers, then the MTP block) for a model and EP width, or
    None where the uniform assumption applies (another checkpoint or shape, or not 2 dies)."""
    shape = (model.num_routed_experts, model.top_k)
    if model.weights != MEASURED_WEIGHTS or shape != MEASURED_SHAPE or num_dies != 2:
        return None
    return PREFILL_SPLITS if is_prefill else DECODE_SPLITS


def measured_expert_shares(
    model: ModelConfig, *, is_prefill: bool = False
) -> tuple[tuple[float, ...], ...] | None:
    """EXPERT_SHARES (PREFILL_EXPERT_SHARES) for the tiny checkpoint, None where the uniform
    assumption applies."""
    shape = (model.num_routed_experts, model.top_k)
    if model.weights != MEASURED_WEIGHTS or shape != MEASURED_SHAPE:
        return None
    return PREFILL_EXPERT_SHARES if is_prefill else EXPERT_SHARES


def prefill_skew(model: ModelConfig, num_dies: int) -> tuple[float, ...] | None:
    """Per main MoE layer, then the MTP block: the rows the hottest of num_dies dies receives
    from a prefill pass over the rows an even spread gives it (its experts in order,
    num_routed_experts / num_dies each, as `ExpertSlots` places them). A pass holds hundreds
    of rows, so the mean share stands for the hottest die's (no fluctuation). None where the
    uniform assumption applies, or the experts do not divide evenly."""
    shares = measured_expert_shares(model, is_prefill=True)
    if shares is None or num_dies <= 1 or model.num_routed_experts % num_dies:
        return None
    per_die = model.num_routed_experts // num_dies
    even = model.top_k / num_dies
    return tuple(
        max(sum(layer[d * per_die : (d + 1) * per_die]) for d in range(num_dies)) / even
        for layer in shares
    )


def expected_over_experts(shares, num_tokens: int, cost_of_rows) -> float:
    """E[sum over the experts of cost_of_rows(their rows)] when num_tokens tokens are routed:
    an expert's rows are Binomial(num_tokens, its share), whatever the others get; an expert
    no row reaches costs nothing (cost_of_rows(0) is not called)."""
    if num_tokens <= 0:
        return 0.0
    rows = np.arange(1, num_tokens + 1)
    costs = np.array([cost_of_rows(int(r)) for r in rows])
    log_choose = np.array(
        [math.lgamma(num_tokens + 1) - math.lgamma(r + 1) - math.lgamma(num_tokens - r + 1)
         for r in rows]
    )  # fmt: skip
    total = 0.0
    for p in shares:
        if p <= 0:
            continue
        if p >= 1:
            total += costs[-1]
            continue
        pmf = np.exp(log_choose + rows * math.log(p) + (num_tokens - rows) * math.log1p(-p))
        total += float(np.dot(pmf, costs))
    return total
