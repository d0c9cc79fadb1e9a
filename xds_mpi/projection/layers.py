"""One MoE layer of the projection (xds_mpi/projection/project.py), colocated or disaggregated,
priced at the slowest dies.

Colocated (DP x EP, xDeepServe §7.1): attention side, gate, dispatch, routed experts, combine.
Dispatch waits for the slowest DP group's attention (it absorbs MLA variance, xDeepServe §7.1)
and takes in the hottest die's rows; combine waits for the hottest expert die. With two
microbatches (CloudMatrix-Infer §4.2.3) stream 0 (MLAProlog, attention; 16 AIC, 32 AIV) and
stream 1 (gate, dispatch, experts, combine; 8 AIC, 16 AIV) overlap, so a layer takes 2 x the
longer stream. Disaggregated (xDeepServe §5.2, Figure 19): D domains x M microbatches take turns
at the expert dies; a layer takes the longest of M x the attention side, one microbatch's round trip
(attention, A2E, MoE, E2A) and D x M x the expert side's compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from xds_mpi.config.schema import Config
from xds_mpi.projection.cost import CostModel, expected_max_z
from xds_mpi.projection.imbalance import Imbalance

# CloudMatrix-Infer §4.2.3: stream 0 gets 16 AIC and 32 AIV, stream 1 gets 8 AIC and 16 AIV
# "under typical decode conditions (4K sequence, batch size 96, MTP enabled)"; elsewhere "the
# allocation ... can be adjusted adaptively" so that the two streams stay balanced.
PAPER_SPLIT = 16  # stream 0's AIC at the typical conditions; AIV follow as 2 per AIC


@dataclass(frozen=True, kw_only=True)
class LayerInputs:
    cfg: Config
    cost: CostModel
    n: dict
    batch: int
    kv_len: float
    rows_per_seq: int
    imbalance: Imbalance
    microbatches: int
    stream0_aic: float | None = None  # two streams: stream 0's AIC (None: the balanced split)


def counts(cfg: Config, topo, *, redundant_dies: int = 0) -> dict:
    """Die counts; `redundant_dies` of the dedicated non-routed dies hold a routed replica
    instead of a shared-expert copy (CloudMatrix-Infer §4.1: 32 shared copies, 256 routed and
    32 redundant experts, one per die: a topology without empty routed dies cannot say so)."""
    hosts = [r for r in topo.ranks if r.expert_slots]
    routed = [r for r in hosts if any(s.kind == "routed" for s in r.expert_slots)]
    return {
        "dies": topo.num_dies,
        "expert_dies": len(hosts),
        "routed_dies": len(routed),
        "shared_dies": len(hosts) - len(routed) - redundant_dies,
        "attention": topo.num_dp_domains * topo.dp_groups_per_domain,
    }


def _share(cost: CostModel, cores: tuple[int, int]) -> CostModel:
    """The cost model of a stream given (AIC, AIV) of the die's cores: the cube cores set its
    compute. Its dispatch/combine cost the same on fewer vector cores: their sends are pipelined
    (cost.py `transfer_s`), and the bytes stay under the link's rate (16 AIV x the profile's
    per-core MTE rate is over 2x the UB read)."""
    aic, aiv = cores
    f = aic / cost.hw.aic_cores
    hw = replace(
        cost.hw, int8_ops=cost.hw.int8_ops * f, bf16_flops=cost.hw.bf16_flops * f, aiv_cores=aiv
    )
    return CostModel(cost.m, hw, kv_int8=cost.kv_int8, int8_attention=cost.int8_attention)


def _attention(cost: CostModel, x: LayerInputs, batch: float, *, slowest: bool) -> float:
    imb = x.imbalance if slowest else Imbalance()
    seqs = [(x.kv_len * imb.kv, x.rows_per_seq)] * max(1, round(batch * imb.batch))
    return cost.mla_prolog(round(batch * imb.batch) * x.rows_per_seq) + cost.attention(seqs)


def _routed(cost: CostModel, n: dict, tokens: float, imb: Imbalance | None) -> tuple[float, float]:
    """(rows in, expert seconds) of a routed die. imb None: the typical die, the mean of
    `tokens`' routed rows. Otherwise the hottest die: imb.moe x the mean, and, when that is the
    expected loads' max/mean (not a measured one), at least the mean plus one iteration's routing
    noise (rows land on dies at random: the largest of n Poisson counts of mean R is about
    R + z(n) sqrt(R))."""
    m = cost.m
    mean = tokens * m.top_k / n["routed_dies"]
    per_die = mean if imb is None else mean * imb.moe
    if imb is not None and imb.noise:
        per_die = max(per_die, mean + expected_max_z(n["routed_dies"]) * math.sqrt(mean))
    experts_per_die = max(1, round(m.num_routed_experts / n["routed_dies"]))
    return per_die, cost.routed(per_die, experts_per_die)


def colocated_layer(x: LayerInputs) -> tuple[dict, dict, dict]:
    """One stream runs the layer's ops one after another. Two streams (CloudMatrix-Infer
    §4.2.3, Figure 14b): stream 0 runs one microbatch's attention path while stream 1 runs the
    other's MoE path, each on its own AIC/AIV; in steady state each stream runs both
    microbatches per layer, so a layer takes 2 x the longer stream."""
    if x.microbatches == 1:
        parts, stream0, stream1 = _streams(x, x.cost, x.cost)
        return _layer(parts, stream0 + stream1, {}, stream0, stream1)
    aic = x.cost.hw.aic_cores
    if x.stream0_aic:
        splits = [x.stream0_aic]
    elif x.cost.hw.equal_streams:
        splits = [equalising_split(x)]
    else:
        splits = range(aic // 3, aic - aic // 6 + 1)
    priced = {a: _streams(x, *split_streams(x.cost, a)) for a in splits}
    best = min(priced, key=lambda a: max(priced[a][1:]))
    parts, stream0, stream1 = priced[best]
    streams = {"stream 0": stream0, "stream 1": stream1}
    return _layer(parts, 2 * max(stream0, stream1), streams, stream0, stream1, split=best)


def equalising_split(x: LayerInputs, *, tolerance: float = 1e-3) -> float:
    """Stream 0's AIC at which the two streams take the same time (hw.equal_streams): a share of
    the cube cores, not a whole number of them, standing for §4.2.3's "adjusted adaptively"
    (the whole-core split leaves the longer stream up to a core's worth over the other). Stream
    0 shrinks and stream 1 grows as stream 0 takes cores, so bisection finds the crossing."""
    lo, hi = 1.0, x.cost.hw.aic_cores - 1.0
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        _, stream0, stream1 = _streams(x, *split_streams(x.cost, mid))
        lo, hi = (mid, hi) if stream0 > stream1 else (lo, mid)
    return (lo + hi) / 2


def split_streams(cost: CostModel, stream0_aic: float) -> tuple[CostModel, CostModel]:
    """Stream 0 on `stream0_aic` AIC and twice as many AIV, stream 1 on the rest (§4.2.3's
    16/32 and 8/16 of 24/48 keep that ratio)."""
    aic, aiv = cost.hw.aic_cores, cost.hw.aiv_cores
    s0_aiv = round(aiv * stream0_aic / aic)
    return _share(cost, (stream0_aic, s0_aiv)), _share(cost, (aic - stream0_aic, aiv - s0_aiv))


def _streams(x: LayerInputs, s0: CostModel, s1: CostModel) -> tuple[dict, float, float]:
    """(one microbatch's parts, its attention path on s0, its MoE path on s1)."""
    cfg, n = x.cfg, x.n
    m, dedicated = x.cost.m, cfg.deployment.shared_experts == "dedicated"
    batch = x.batch / x.microbatches
    rows = batch * x.rows_per_seq
    attn_mean = _attention(s0, x, batch, slowest=False)
    attn_max = _attention(s0, x, batch, slowest=True)
    tokens = rows * n["dies"]
    rows_max, experts_max = _routed(s1, n, tokens, x.imbalance)
    _, experts_mean = _routed(s1, n, tokens, None)
    shared = s1.experts([tokens / n["shared_dies"]]) if dedicated else 0.0
    every_die_shared = 0.0 if dedicated else s1.experts([rows] * m.num_shared_experts)
    dispatch = s1.dispatch(rows_max, peers=n["dies"], int8=cfg.xccl.use_int8)
    combine = s1.combine(rows * (m.top_k + (1 if dedicated else 0)), peers=n["dies"])
    slowest_experts = max(experts_max, shared) + every_die_shared
    typical_experts = max(experts_mean, shared) + every_die_shared
    parts = {
        "MLAProlog": s0.mla_prolog(rows),
        "attention": attn_mean - s0.mla_prolog(rows),
        "gate": s1.gate(rows),
        "dispatch": dispatch + attn_max - attn_mean,  # waits for the slowest DP group
        "experts": typical_experts,
        "combine": combine + slowest_experts - typical_experts,  # waits for the hottest die
    }
    # The waits, mean over dies minus the fastest call (a die's call lasts from its own start to
    # the last peer's): the slowest DP group's attention over the mean's, the hottest expert
    # die's experts over the typical die's, and the last die's start (stragglers).
    mean_rows = tokens * m.top_k / n["routed_dies"]
    intrinsic = s1.dispatch(mean_rows, peers=n["dies"], int8=cfg.xccl.use_int8)
    primitives = {
        "dispatch": dispatch,
        "combine": combine,
        "dispatch intrinsic": intrinsic - s1.start_wait("dispatch", peers=n["dies"]),
        "combine intrinsic": combine - s1.start_wait("combine", peers=n["dies"]),
        "dispatch wait": attn_max - attn_mean + s1.start_wait("dispatch", peers=n["dies"]),
        "combine wait": slowest_experts
        - typical_experts
        + s1.start_wait("combine", peers=n["dies"]),
        # the compute imbalance part of the waits (the same in every call of the layer)
        "dispatch imbalance": attn_max - attn_mean,
        "combine imbalance": slowest_experts - typical_experts,
    }
    return {**parts, "_primitives": primitives}, attn_max, sum(parts.values()) - attn_max


def _layer(parts: dict, layer: float, streams: dict, stream0: float, stream1: float, *,
           split: float | None = None) -> tuple[dict, dict, dict]:  # fmt: skip
    """(parts scaled to the layer's time, one call of each primitive, details)."""
    primitives = {**parts.pop("_primitives"), "layer": layer, **streams}
    scale = layer / sum(parts.values())
    scaled = {k: v * scale for k, v in parts.items()}
    details = {"layer": scaled, "streams": {"attention path": stream0, "MoE path": stream1}}
    if split is not None:
        details["stream 0 AIC"] = split
    return scaled, primitives, details


@dataclass(frozen=True, kw_only=True)
class AfdHops:
    """A2E and E2A of one microbatch of one attention die (xDeepServe §3.3, Figure 8): to its
    trampoline, then from the domain's trampolines (as many expert dies as attention dies) to
    the experts; back through the trampolines. The expert dies' stages run in persistent
    kernels (xDeepServe §5.2), without a kernel start; the attention dies' stages start one."""

    trampolines: int
    domain_trampolines: int
    expert_dies: int
    routed_dies: int
    groups_per_domain: int

    @classmethod
    def of(cls, cfg: Config, n: dict) -> AfdHops:
        groups = cfg.deployment.dp_groups_per_domain
        return cls(
            trampolines=math.ceil(groups / n["expert_dies"]),
            domain_trampolines=min(groups, n["expert_dies"]),
            expert_dies=n["expert_dies"],
            routed_dies=n["routed_dies"],
            groups_per_domain=groups,
        )

    def a2e_first(self, cost: CostModel, mb_rows: float, *, int8: bool) -> float:
        """Stage 1: the attention die's rows to its trampoline."""
        return cost.dispatch(mb_rows, peers=self.trampolines, int8=int8)

    def a2e(
        self, cost: CostModel, mb_rows: float, *, expert_rows: float | None = None, int8: bool
    ) -> float:
        """mb_rows: the attention die's rows; expert_rows: what the hottest expert die takes
        in at stage 2, from the trampolines (None: the mean die's share)."""
        if expert_rows is None:
            expert_rows = mb_rows * self.groups_per_domain * cost.m.top_k / self.routed_dies
        return self.a2e_first(cost, mb_rows, int8=int8) + cost.dispatch(
            expert_rows, peers=self.domain_trampolines, int8=int8, persistent=True
        )

    def e2a(self, cost: CostModel, mb_rows: float) -> float:
        """Each trampoline takes its attention dies' top-k and shared outputs from the expert
        dies, then the attention die its rows from its trampoline."""
        served = self.groups_per_domain / self.domain_trampolines
        per_trampoline = mb_rows * served * (cost.m.top_k + 1)
        return cost.combine(per_trampoline, peers=self.expert_dies, persistent=True) + (
            cost.combine(mb_rows, peers=self.trampolines)
        )


def afd_layer(x: LayerInputs) -> tuple[dict, dict, dict]:
    cfg, n, cost = x.cfg, x.n, x.cost
    dep = cfg.deployment
    micro = dep.num_microbatches
    batch = x.batch / micro
    mb_rows = batch * x.rows_per_seq  # one attention die, one microbatch
    tokens = mb_rows * dep.dp_groups_per_domain  # one domain's microbatch
    rows_max, experts_max = _routed(cost, n, tokens, x.imbalance)
    if n["shared_dies"]:  # dedicated shared-expert dies
        shared = cost.experts([tokens / n["shared_dies"]])
        moe = max(experts_max, shared)
    else:  # every expert die runs the shared expert on its share of the tokens
        shared = cost.experts([tokens / n["expert_dies"]])
        moe = experts_max + shared
    hops = AfdHops.of(cfg, n)
    a2e = hops.a2e(cost, mb_rows, expert_rows=rows_max, int8=cfg.xccl.use_int8)
    e2a = hops.e2a(cost, mb_rows)
    attention = _attention(cost, x, batch, slowest=True) + cost.gate(mb_rows)
    a2e_first = hops.a2e_first(cost, mb_rows, int8=cfg.xccl.use_int8)
    side = attention + a2e_first  # xDeepServe §7.1: A2E's first stage is the attention die's
    expert_side = dep.num_dp_domains * micro * moe
    layer = max(micro * side, side + (a2e - a2e_first) + moe + e2a, expert_side)
    parts = {"MLAProlog+attention+gate+A2E stage 1": micro * side, "A2E stage 2": a2e - a2e_first,
             "MoE": moe, "E2A": e2a}  # fmt: skip
    scale = layer / sum(parts.values())
    # the last layer's last microbatch: its way through the experts and back is not overlapped
    # (xDeepServe §7.1: "the second microbatch of the final layer cannot be overlapped")
    tail = (a2e - a2e_first) + moe + e2a
    primitives = {"attention side": side, "A2E": a2e, "MoE": moe, "E2A": e2a, "layer": layer,
                  "tail": tail}  # fmt: skip
    prolog = cost.mla_prolog(round(batch * x.imbalance.batch) * x.rows_per_seq)
    e2a_last = cost.combine(mb_rows, peers=hops.trampolines)
    details = {
        "attention side": {
            "MLAProlog": prolog, "attention": attention - prolog - cost.gate(mb_rows),
            "gate": cost.gate(mb_rows), "A2E stage 1": a2e_first,
        },
        "A2E": {"stage 1": a2e_first, "stage 2 (trampolines)": a2e - a2e_first},
        "E2A": {"stage 1 (to trampolines)": e2a - e2a_last, "stage 2": e2a_last},
        "MoE": {"routed experts, hottest die": experts_max, "shared expert": shared},
        "layer": {k: v * scale for k, v in parts.items()},
    }  # fmt: skip
    return {k: v * scale for k, v in parts.items()}, primitives, details
