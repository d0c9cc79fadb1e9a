"""The budget method of Baidu's AFD analysis (seed 003, "Revealing the challenges of
Attention-FFN disaggregation"): an upper bound on the FFN side's hardware FLOPS utilization
(HFU) when attention and FFN instances are disaggregated and pipelined.

Step 1 (Eq. 1): the TPOT target, relaxed by MTP's acceptance length, less the gap t_g, is shared
    by N_layers x N_BO stages: the per-microbatch, per-layer budget t_B.
Step 2 (Eq. 9, Eq. 17): how many tokens the interconnect brings one FFN rank within t_B: a token
    costs 3H bytes there and back (FP8 dispatch + BF16 combine); scale-out traffic overlaps with
    scale-up forwarding TopK / N_F times, never beyond the scale-up link. A Superpod's scale-up
    reaches every rank (Appendix A: B_rank = B_ScaleUp).
Step 3 (Eq. 10, §3.2): the rank's G = ceil(E / (N_F g)) local experts share those tokens;
    FLOPs = 6 B_rank H M, weight bytes 3 G H M; the two grouped GEMMs take the roofline's t_G.
Step 4 (Eq. 6-8): S_t = t_G / t_B, OFU = FLOPs / (t_G x peak), HFU = OFU x S_t.
Step 5 (§3.2): over N_F, the "dead zone" is where more FFN instances do not raise HFU because the
    scale-out link caps the tokens: OFU rises, S_t falls.
Step 6 (§2.2, Fig. 1b, Eq. 2-4): with two batches in flight (2BO) instead of three (3BO), a
    microbatch's dispatch, FFN and combine must fit in what attention leaves of two stages.
Step 7 (§3.3, Eq. 11-16): the throughput penalty of EP imbalance sigma: continuous for large EP,
    discrete (whole attention instances) for AFD.

Everything here is a pure function of the model, the platform and the scenario; the paper's own
numbers to check it against are in xds_mpi/projection/afd_analysis/paper.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Eq. 17: bytes one token costs on the FFN side's link, per hidden unit: FP8 in, BF16 out.
BYTES_PER_TOKEN_PER_HIDDEN = 1 + 2
# §3.2: two grouped GEMMs of a SwiGLU expert: FLOPs = 6 G B H M, FP8 weights 3 G H M bytes.
FLOPS_PER_TOKEN_PER_HM = 6
WEIGHT_BYTES_PER_HM = 3


@dataclass(frozen=True, kw_only=True)
class MoeShape:
    """What the method reads from a model (003 Table 4)."""

    name: str
    hidden: int  # H
    num_layers: int  # N_layers: every layer is budgeted alike (Figure 4's caption)
    num_moe_layers: int  # the layers whose experts an FFN rank holds
    num_experts: int  # routed experts, E
    top_k: int
    moe_intermediate: int  # M

    @property
    def sparsity(self) -> float:
        """§4.1: routed experts / TopK."""
        return self.num_experts / self.top_k

    @property
    def granularity(self) -> float:
        """§2.4: hidden size / MoE intermediate size."""
        return self.hidden / self.moe_intermediate


@dataclass(frozen=True, kw_only=True)
class Platform:
    """What the method reads from a hardware system (003 Table 5), per rank (GPU or die)."""

    name: str
    flops: float  # peak FLOP/s of the GEMMs' format (FP8; INT8 on the 910C)
    mem_bytes_per_s: float
    mem_bytes: float
    scale_up_bytes_per_s: float  # unidirectional, per rank
    scale_out_bytes_per_s: float | None  # per rank; None: a Superpod (scale-up spans the pod)
    ranks_per_node: int  # g: the FFN side scales by whole nodes of g ranks

    @property
    def is_superpod(self) -> bool:
        return self.scale_out_bytes_per_s is None


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """Eq. 1's inputs. Defaults: 003 §3.2 (L_accept 1.7, t_g 15 ms), §2.2 (N_BO = 3); the TPOT
    target 003 does not state: 50 ms is xDeepServe's (seed 000 §7.1)."""

    tpot_s: float = 0.050
    accept_len: float = 1.7
    gap_s: float = 0.015
    num_bo: int = 3


def budget_s(model: MoeShape, scenario: Scenario, *, num_bo: int | None = None) -> float:
    """Eq. 1: t_B = (SLO x L_accept - t_g) / (N_layers x N_BO)."""
    n_bo = num_bo or scenario.num_bo
    spare = scenario.tpot_s * scenario.accept_len - scenario.gap_s
    if spare <= 0 or n_bo < 2:
        raise ValueError(
            f"no budget: TPOT {scenario.tpot_s * 1e3:g} ms x L_accept {scenario.accept_len:g} "
            f"- t_g {scenario.gap_s * 1e3:g} ms = {spare * 1e3:g} ms (need > 0), N_BO {n_bo} "
            "(need >= 2)"
        )
    return spare / (model.num_layers * n_bo)


def link_tokens(bytes_per_s: float, t_b: float, hidden: int) -> float:
    """Eq. 17: tokens a link carries to a rank (and their outputs back) within t_B."""
    return bytes_per_s * t_b / (BYTES_PER_TOKEN_PER_HIDDEN * hidden)


def rank_tokens(model: MoeShape, hw: Platform, t_b: float, num_ffn_nodes: int) -> tuple[float, str]:
    """Eq. 9: (B_rank, which link bounds it)."""
    up = link_tokens(hw.scale_up_bytes_per_s, t_b, model.hidden)
    if hw.is_superpod:
        return up, "scale-up"
    out = link_tokens(hw.scale_out_bytes_per_s, t_b, model.hidden)
    overlapped = out * max(1.0, model.top_k / num_ffn_nodes)
    return (up, "scale-up") if up <= overlapped else (overlapped, "scale-out")


def local_experts(model: MoeShape, hw: Platform, num_ffn_nodes: int) -> int:
    """Eq. 10's denominator: routed experts per FFN rank."""
    return math.ceil(model.num_experts / (num_ffn_nodes * hw.ranks_per_node))


@dataclass(frozen=True, kw_only=True)
class FfnPoint:
    """One FFN instance count N_F: the tokens an FFN rank takes per stage and what its grouped
    GEMMs make of them. `bound` names the term that caps the tokens: "scale-up", "scale-out",
    "compute" (the GEMMs fill t_B), "round trip" (2BO: dispatch + FFN + combine fill what
    attention leaves); an infeasible point names "HBM capacity" or "HBM bandwidth" and holds
    zeros."""

    num_ffn_nodes: int
    num_bo: int
    budget_s: float  # t_B
    link_tokens: float  # Eq. 9's B_rank, what the links could bring
    tokens: float  # what the rank takes: B_rank capped by compute and the round trip
    experts_per_rank: int  # G
    tokens_per_expert: float  # B = B_rank / G
    intensity: float  # Eq. 10: I = 2B FLOPs per weight byte
    gemm_s: float  # t_G
    ofu: float
    temporal_sparsity: float  # S_t
    hfu: float
    bound: str
    is_feasible: bool = True

    @property
    def is_link_bound(self) -> bool:
        return self.bound in ("scale-up", "scale-out")


def ffn_point(
    model: MoeShape, hw: Platform, scenario: Scenario, num_ffn_nodes: int, *, num_bo: int = 0
) -> FfnPoint:
    """Steps 1-4 at one N_F (and N_BO: 0 takes the scenario's)."""
    n_bo = num_bo or scenario.num_bo
    return stage_point(model, hw, budget_s(model, scenario, num_bo=n_bo), num_ffn_nodes, n_bo)


def stage_point(
    model: MoeShape, hw: Platform, t_b: float, num_ffn_nodes: int, num_bo: int = 3
) -> FfnPoint:
    """Steps 2-4 for a stage budget t_b (from Eq. 1, or measured on a run's virtual clock)."""
    g = local_experts(model, hw, num_ffn_nodes)
    hm = model.hidden * model.moe_intermediate
    weights = WEIGHT_BYTES_PER_HM * g * hm  # one layer's local experts, FP8
    link, link_bound = rank_tokens(model, hw, t_b, num_ffn_nodes)
    common = dict(num_ffn_nodes=num_ffn_nodes, num_bo=num_bo, budget_s=t_b, link_tokens=link,
                  experts_per_rank=g)  # fmt: skip
    if weights * model.num_moe_layers > hw.mem_bytes:
        return _infeasible(common, "HBM capacity")
    weights_s = weights / hw.mem_bytes_per_s
    spare = (num_bo - 1) * t_b - weights_s  # Eq. 2-4: dispatch + FFN + combine after attention
    if weights_s > t_b or spare <= 0:
        return _infeasible(common, "HBM bandwidth")
    per_token_s = FLOPS_PER_TOKEN_PER_HM * hm / hw.flops  # compute time of one token
    link_rate = link / t_b  # tokens per second
    caps = {
        link_bound: link,
        "compute": t_b / per_token_s,
        "round trip": min(spare * link_rate, (num_bo - 1) * t_b / (1 / link_rate + per_token_s)),
    }
    bound = min(caps, key=caps.get)
    tokens = caps[bound]
    flops = FLOPS_PER_TOKEN_PER_HM * tokens * hm
    gemm_s = gemm_seconds(model, hw, tokens, g)
    return FfnPoint(
        **common,
        tokens=tokens,
        tokens_per_expert=tokens / g,
        intensity=2 * tokens / g,
        gemm_s=gemm_s,
        ofu=flops / (gemm_s * hw.flops),
        temporal_sparsity=gemm_s / t_b,
        hfu=flops / (hw.flops * t_b),
        bound=bound,
    )


def gemm_seconds(model: MoeShape, hw: Platform, tokens: float, num_experts: int) -> float:
    """§3.2's roofline of the two grouped GEMMs: `tokens` token-expert pairs over `num_experts`
    local experts, at 100 % of peak and of memory bandwidth."""
    hm = model.hidden * model.moe_intermediate
    flops = FLOPS_PER_TOKEN_PER_HM * tokens * hm
    return max(flops / hw.flops, WEIGHT_BYTES_PER_HM * num_experts * hm / hw.mem_bytes_per_s)


def _infeasible(common: dict, why: str) -> FfnPoint:
    zeros = dict(tokens=0.0, tokens_per_expert=0.0, intensity=0.0, gemm_s=0.0, ofu=0.0,
                 temporal_sparsity=0.0, hfu=0.0)  # fmt: skip
    return FfnPoint(**common, **zeros, bound=why, is_feasible=False)


def hfu_ceiling(model: MoeShape, hw: Platform) -> float:
    """Eq. 19 (Appendix A): the HFU of the most tokens Eq. 9 allows (B_rank = B_ScaleUp) at 100 %
    OFU, at most 1; it comes to 2 x scale-up bandwidth x M / peak, independent of t_B."""
    t_b = 1.0  # any budget: tokens and FLOPs scale with it
    tokens = link_tokens(hw.scale_up_bytes_per_s, t_b, model.hidden)
    flops = FLOPS_PER_TOKEN_PER_HM * tokens * model.hidden * model.moe_intermediate
    return min(1.0, flops / (hw.flops * t_b))


def curve(
    model: MoeShape, hw: Platform, scenario: Scenario, max_ffn_nodes: int, *, num_bo: int = 0
) -> list[FfnPoint]:
    """Step 5's x axis: N_F = 1 .. max_ffn_nodes."""
    if max_ffn_nodes < 1:
        raise ValueError(f"need at least 1 FFN node, got max_ffn_nodes {max_ffn_nodes}")
    return [ffn_point(model, hw, scenario, n, num_bo=num_bo) for n in range(1, max_ffn_nodes + 1)]


def dead_zone(points: list[FfnPoint]) -> tuple[int, ...]:
    """Step 5: the N_F whose tokens the scale-out link caps and whose HFU is no higher than a
    feasible smaller N_F's: adding FFN instances there buys nothing. Empty on a Superpod."""
    zone, best = [], -1.0
    for p in points:
        if not p.is_feasible:
            continue
        if p.bound == "scale-out" and p.hfu <= best + 1e-12:
            zone.append(p.num_ffn_nodes)
        best = max(best, p.hfu)
    return tuple(zone)


# -- Step 7: imbalance penalties (§3.3) ------------------------------------------------------------
def alpha_ep(lam: float, sigma: float) -> float:
    """Eq. 12: large EP's throughput factor under balancedness sigma, lambda_EP = t_a / t_f."""
    _check_sigma(sigma)
    return (lam + 1) / (lam + 1 / sigma)


def alpha_afd(num_attention: int, num_ffn: int, sigma: float) -> float:
    """Eq. 13-16: AFD's throughput factor per node when only whole attention instances can be
    removed. Eq. 14-15 as printed multiply by (lambda + 1); the balanced throughput per node they
    divide by is N_A / (N_A + N_F) = lambda / (lambda + 1), so the factor is (lambda + 1) /
    lambda, which also makes Eq. 14 equal Eq. 13 when sigma N_A is whole (docs/afd_analysis.md)."""
    _check_sigma(sigma)
    if num_attention < 1 or num_ffn < 1:
        raise ValueError(f"need N_A >= 1 and N_F >= 1, got {num_attention}, {num_ffn}")
    n_a, n_f = num_attention, num_ffn
    balanced = n_a / (n_a + n_f)
    scaled = sigma * n_a
    if abs(scaled - round(scaled)) < 1e-9:  # Eq. 13
        return sigma * (n_a + n_f) / (sigma * n_a + n_f)
    lo, hi = math.floor(scaled), math.ceil(scaled)
    floor = (lo / (lo + n_f)) / balanced if lo else 0.0  # Eq. 14
    ceil = (hi / (hi + n_f)) * (scaled / hi) / balanced  # Eq. 15: attention not filled
    return max(floor, ceil)  # Eq. 16


def _check_sigma(sigma: float) -> None:
    if not 0 < sigma <= 1:
        raise ValueError(f"balancedness sigma must be in (0, 1], got {sigma}")
