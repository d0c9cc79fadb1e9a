"""The 910C cost model: what one operation takes on a die, at the target model's shapes.

Every compute operation is a roofline: max(FLOPs / (peak x compute efficiency), bytes /
(HBM bandwidth x memory efficiency)); the efficiencies are the achieved/peak ratios of the papers'
operator tables (configs/hardware/ascend910c.yaml cites each). GEMMs use INT8 weights and the
INT8 peak; MLA's attention core uses the BF16 peak. Transfers: dispatch/combine and the A2E/E2A
stages are priced by their mechanism (below): kernel start, the flags and pulls to the peers,
the bytes taken in, the wait for the slowest peer. The only fitted constants (kernel
starts, die jitter) are fitted to a primitive latency table; nothing is fitted to a published
end-to-end number.

The cost of one die's part in an all-to-all primitive (dispatch, combine, A2E, E2A), from its
mechanism (xDeepServe §3.3, Figure 7): a kernel start, one count/offset flag written to every
peer, one pull from every peer plus the bytes this die takes in at its own read bandwidth (the
incast), and the wait for the slowest of the peers (each die starts with its own jitter; the
barrier waits for the maximum). The cores issue their flags and pulls back to back, each core's
sends pipelined (CloudMatrix-Infer §4.2.1 ④: the next token is staged while the previous one's
write is in flight, "hiding both computation and communication latency"; xDeepServe §3.1: each
unified buffer runs "in a ping-pong fashion"), so a call pays the link's latency once, not once
per peer: growth with EP size comes from the maximum of more dies' jitter (and, on a two-tier
network, from the bytes leaving the node). Table 7 agrees: given a per-peer round latency as a
free weight, its fit sets it to 0 (tests/unit/xds_mpi/projection/test_paper_table.py).

The kernel starts and the jitter's spread are the only fitted constants; `fit_table7` fits them
to the primitive latency table (CloudMatrix-Infer Table 7), a calibration table, never to an
end-to-end number (docs/design.md, "Calibration and validation")"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cache

import numpy as np

from xds_mpi.config.hardware import stream_split
from xds_mpi.config.schema import ModelConfig
from xds_mpi.plan.kv_memory import token_layer_bytes
from xds_mpi.projection.kernels import KernelCosts, operator_costs
from xds_mpi.projection.normal import normal_quantile
from xds_mpi.projection.waits import Tail
from xds_mpi.projection.waits import wait_s as tail_wait_s


@dataclass(frozen=True, kw_only=True)
class Hardware:
    bf16_flops: float  # FLOP/s
    int8_ops: float
    hbm_bytes_per_s: float
    read_bytes_per_s: float  # UB, one die pulling from others
    write_latency_s: float
    read_latency_s: float
    node_dies: int  # dies on the inner tier of the network (0: the fabric is one tier)
    intra_read_bytes_per_s: float
    intra_write_latency_s: float
    intra_read_latency_s: float
    aiv_cores: int
    aic_cores: int
    dies_per_chip: int  # dies a "per chip" figure counts together (910C: 2, H800: 1)
    dispatch_start_s: float  # fitted to a primitive latency table (the profile names it)
    combine_start_s: float
    jitter_s: float
    graph_launch_s: float
    gemm_eff: float
    mla_eff: float
    mem_eff: float
    bubble_s: float  # per iteration scheduling bubble
    weight_bytes: int
    kv_bytes: int
    act_bytes: int
    # GEMM efficiency by shape and the per-kernel fixed cost (kernels.py), for a profile with an
    # `operators` section (opt-in: ascend910c_kernels, h800); None: the flat path, one
    # efficiency per class of operator and no fixed cost (the default profile, ascend910c)
    ops: KernelCosts | None = None
    kernels: dict = field(default_factory=dict)  # operation -> kernels it launches
    tail: Tail | None = None  # the straggler tail a scenario pays (waits.py; None: the body only)
    # Unpublished choices the bands bracket (bands.py); the defaults are the point values.
    # start_per_peer_at: 0, an XCCL call's kernel start is one fixed time; N, the start was set
    # on an N-peer call and scales with the peers a call reaches (A2E's stages reach few)
    start_per_peer_at: int = 0
    head_int8: bool = False  # the LM head's weights INT8 (point: BF16, xDeepServe §4.7)
    head_shards: int = 1  # dies the LM head's vocabulary is split over (point: 1, whole)
    # the colocated two-stream die's core split where no split is given: False, the whole-core
    # split with the shorter longer stream; True, the share that equalises the two streams
    # (die.stream_split: equal; layers.py equalising_split)
    equal_streams: bool = False

    @classmethod
    def from_profile(cls, p: dict) -> Hardware:
        die, ub, eff, srv = p["die"], p["ub"], p["efficiency"], p["serving"]
        return cls(
            bf16_flops=die["bf16_tflops"] * 1e12,
            int8_ops=die["int8_tops"] * 1e12,
            hbm_bytes_per_s=die["hbm_tb_per_s"] * 1e12,
            read_bytes_per_s=ub["read_gb_per_s_inter"] * 1e9,
            write_latency_s=ub["write_latency_us_inter"] * 1e-6,
            read_latency_s=ub["read_latency_us_inter"] * 1e-6,
            node_dies=ub["node_dies"],
            intra_read_bytes_per_s=ub["read_gb_per_s_intra"] * 1e9,
            intra_write_latency_s=ub["write_latency_us_intra"] * 1e-6,
            intra_read_latency_s=ub["read_latency_us_intra"] * 1e-6,
            aiv_cores=die["aiv_cores"],
            aic_cores=die["aic_cores"],
            dies_per_chip=die.get("dies_per_chip", 1),
            equal_streams=stream_split(die) == "equal",
            dispatch_start_s=p["xccl"]["dispatch_start_us"] * 1e-6,
            combine_start_s=p["xccl"]["combine_start_us"] * 1e-6,
            jitter_s=p["xccl"]["die_jitter_us"] * 1e-6,
            graph_launch_s=srv["graph_launch_ms"] * 1e-3,
            gemm_eff=eff["gemm_int8"],
            mla_eff=eff["mla_compute"],
            mem_eff=eff["memory"],
            bubble_s=srv["scheduler_bubble_ms"] * 1e-3,
            weight_bytes=srv["weight_bytes"],
            kv_bytes=srv["kv_bytes"],
            act_bytes=srv["activation_bytes"],
            ops=operator_costs(p),
            kernels=dict(p.get("kernels", {})),
        )


class CostModel:
    """Seconds per operation for one die at shape `m` on hardware `hw`."""

    def __init__(
        self, m: ModelConfig, hw: Hardware, *, kv_int8: bool = False, int8_attention: float = 0.0
    ) -> None:
        """kv_int8: the latent KV's non-RoPE part is read as INT8 + a per-token scale
        (scheduler.kv_int8); otherwise all of it in hw.kv_bytes per value. int8_attention: the
        share of the layers whose attention core runs entirely in INT8 (xDeepServe §4.7: "For
        attention layers with lower sensitivity to precision, we further optimize by performing
        the attention computation entirely in INT8"; the paper does not say how many)."""
        if not 0.0 <= int8_attention <= 1.0:
            raise ValueError(f"int8_attention is a share of the layers, got {int8_attention}")
        self.m, self.hw, self.kv_int8 = m, hw, kv_int8
        self.int8_attention = int8_attention
        self.kv_token_bytes = token_layer_bytes(m, itemsize=hw.kv_bytes, kv_int8=kv_int8)
        self._links: dict[tuple[str, bool], LinkCosts] = {}  # `link`'s, made once each

    def _roofline(self, flops: float, nbytes: float, *, peak: float, eff: float) -> float:
        return max(flops / (peak * eff), nbytes / (self.hw.hbm_bytes_per_s * self.hw.mem_eff))

    @property
    def shaped(self) -> bool:
        """Shape-aware GEMMs and per-kernel fixed costs (the profile's `operators` section,
        kernels.py); False: the flat path, every formula as before issue 61 (the default)."""
        return self.hw.ops is not None

    def gemm(self, rows: float, params: float, *, n: int | None = None, groups: float = 1) -> float:
        """rows x [in -> out] with `params` = in x out INT8 weights read once (n: out, which
        names the shape's measured bandwidth; groups: a grouped kernel's groups, `rows` each),
        at the efficiencies its shape reaches (kernels.py); its fixed cost is the caller's.
        Flat path: a roofline at the profile's one GEMM efficiency (n unused)."""
        hw = self.hw
        if hw.ops is None:
            if rows == 0:
                return 0.0
            return groups * self._roofline(
                2.0 * rows * params, params * hw.weight_bytes, peak=hw.int8_ops, eff=hw.gemm_eff
            )
        return hw.ops.gemm_s(m=rows, params=params, n=n, groups=groups, peak=hw.int8_ops,
                             hbm=hw.hbm_bytes_per_s, weight_bytes=hw.weight_bytes)  # fmt: skip

    def fixed(self, operation: str) -> float:
        """The fixed cost of the kernels `operation` launches (the profile's `kernels` counts;
        a stream pays its own, whatever its share of the cores); 0 on the flat path."""
        if self.hw.ops is None:
            return 0.0
        return self.hw.kernels.get(operation, 0) * self.hw.ops.fixed_s

    # -- attention side -------------------------------------------------------------------------
    def mla_prolog(self, rows: int) -> float:
        """MLAProlog (q/kv down and up projections, the absorbed W_UK) + W_UV and o_proj. The
        INT8 weights are those xDeepServe §4.7 names (W_q_a, W_kv_a, W_q_b, W_o); the absorbed
        per-head W_UK and W_UV (W_kv_b's halves) are not among them: BF16 at the BF16 peak."""
        m = self.m
        qk = m.qk_nope_dim + m.qk_rope_dim
        if not self.shaped:  # the flat path: one roofline per weight precision
            int8_params = (
                m.hidden * m.q_lora_rank
                + m.q_lora_rank * m.num_heads * qk
                + m.hidden * (m.kv_lora_rank + m.qk_rope_dim)
                + m.num_heads * m.v_head_dim * m.hidden
            )
            absorbed = 2 * m.num_heads * m.qk_nope_dim * m.kv_lora_rank
            return self.gemm(rows, int8_params) + self.bf16_gemm(rows, absorbed)
        if rows <= 0:
            return 0.0
        down = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_dim  # q_a and kv_a, one GEMM
        up = m.num_heads * qk
        o_in = m.num_heads * m.v_head_dim
        per_head = m.qk_nope_dim * m.kv_lora_rank
        return (
            self.gemm(rows, m.hidden * down, n=down)
            + self.gemm(rows, m.q_lora_rank * up, n=up)
            + self.bf16_gemm(rows, per_head, n=m.kv_lora_rank, groups=m.num_heads)  # W_UK
            + self.bf16_gemm(rows, per_head, n=m.v_head_dim, groups=m.num_heads)  # W_UV
            + self.gemm(rows, o_in * m.hidden, n=m.hidden)
            + self.fixed("mla_prolog")
            + self.fixed("o_proj")
        )

    def attention(self, seqs: list[tuple[int, int]]) -> float:
        """Absorbed MLA: seqs = (KV length, new rows) per sequence; each row scores and reads
        its sequence's latent cache (read once per sequence). A layer's mean over the layers:
        the `int8_attention` share of them runs the core on the INT8 peak (at Table 8's
        utilization, the only MLA utilization published) reading the non-RoPE latent as INT8
        + a scale, the rest in BF16 reading the cache as it is kept."""
        m, width = self.m, self.m.kv_lora_rank + self.m.qk_rope_dim
        flops = sum(2.0 * rows * m.num_heads * n * (width + m.kv_lora_rank) for n, rows in seqs)
        tokens = sum(n for n, _ in seqs)
        bf16 = self._roofline(
            flops, tokens * self.kv_token_bytes, peak=self.hw.bf16_flops, eff=self.hw.mla_eff
        )
        bf16 += self.fixed("attention")
        if not self.int8_attention:
            return bf16
        int8_bytes = token_layer_bytes(m, itemsize=self.hw.kv_bytes, kv_int8=True)
        int8 = self._roofline(
            flops, tokens * int8_bytes, peak=self.hw.int8_ops, eff=self.hw.mla_eff
        )
        int8 += self.fixed("attention")
        return (1 - self.int8_attention) * bf16 + self.int8_attention * int8

    def bf16_gemm(
        self, rows: float, params: float, *, n: int | None = None, groups: float = 1
    ) -> float:
        """rows x [in -> out] with `params` BF16 weights, at the BF16 peak: a weight INT8
        quantization leaves out (xDeepServe §4.7 quantizes the MLA, MoE and MLP modules only).
        The efficiencies are the INT8/FP8 table's (assumption: no BF16 table is published)."""
        hw = self.hw
        if hw.ops is None:  # the flat path
            if rows == 0:
                return 0.0
            return groups * self._roofline(
                2.0 * rows * params, params * 2, peak=hw.bf16_flops, eff=hw.gemm_eff
            )
        return hw.ops.gemm_s(m=rows, params=params, n=n, groups=groups, peak=hw.bf16_flops,
                             hbm=hw.hbm_bytes_per_s, weight_bytes=2, act_bytes=2)  # fmt: skip

    def gate(self, rows: int) -> float:
        """The router: BF16 weights (CloudMatrix-Infer §4.5: "critical gating mechanisms retain
        higher precision using BF16 or FP32"; xDeepServe §4.7 does not list it)."""
        if rows <= 0:
            return 0.0
        e = self.m.num_routed_experts
        return self.bf16_gemm(rows, self.m.hidden * e, n=e) + self.fixed("gate")

    # -- FFN side -------------------------------------------------------------------------------
    def experts(self, rows_per_expert: list[float]) -> float:
        """SwiGLU experts (the shared expert) run one after another on the die, each over its
        own rows: up/gate and down GEMMs and their kernels each (flat path: one roofline)."""
        if not self.shaped:
            params = 3.0 * self.m.hidden * self.m.moe_intermediate
            return sum(self.gemm(rows, params) for rows in rows_per_expert if rows > 0)
        return sum(self.swiglu(rows) + self.fixed("shared_expert")
                   for rows in rows_per_expert if rows > 0)  # fmt: skip

    def swiglu(self, rows: float, *, groups: float = 1, inner: int | None = None) -> float:
        """One SwiGLU FFN's GEMMs (`groups` of them, `rows` each): up/gate hidden -> 2 x inner,
        down inner -> hidden."""
        h, inner = self.m.hidden, inner or self.m.moe_intermediate
        return self.gemm(rows, h * 2 * inner, n=2 * inner, groups=groups) + self.gemm(
            rows, inner * h, n=h, groups=groups
        )

    def routed(self, rows: float, num_experts: float) -> float:
        """A die's `rows` routed rows over its `num_experts` experts, each row to one of them at
        random: only the experts some row reaches run, n x (1 - (1 - 1/n)^rows) of them on
        average (at a few rows most experts' weights are never read)."""
        if rows <= 0 or num_experts <= 0:
            return 0.0
        touched = num_experts * (1 - (1 - 1 / num_experts) ** rows) if num_experts > 1 else 1.0
        if not self.shaped:  # the flat path: each touched expert one roofline
            params = 3.0 * self.m.hidden * self.m.moe_intermediate
            return touched * self.gemm(rows / touched, params)
        # one grouped kernel per GEMM over the touched experts (DeepGEMM's masked layout)
        return self.swiglu(rows / touched, groups=touched) + self.fixed("experts")

    def dense_ffn(self, rows: int) -> float:
        if not self.shaped:  # the flat path
            return self.gemm(rows, 3.0 * self.m.hidden * self.m.intermediate)
        if rows <= 0:
            return 0.0
        return self.swiglu(rows, inner=self.m.intermediate) + self.fixed("dense_ffn")

    def mtp_projection(self, rows: float) -> float:
        """An MTP module's eh_proj: [normed embedding; normed hidden] (2 x hidden) -> hidden.
        xDeepServe §4.7 quantizes MLA, MoE and MLP weights to INT8, not this one: BF16 weights
        at the BF16 peak."""
        h = self.m.hidden
        return self.bf16_gemm(rows, 2.0 * h * h, n=h) + self.fixed("mtp_projection")

    def head(self, rows: int) -> float:
        """The LM head (shared by the MTP modules): BF16 weights, as xDeepServe §4.7 lists the
        MLA, MoE and MLP modules and not the head (CloudMatrix-Infer §4.5 quantizes "large
        matrix multiplications in feed-forward networks (FFNs) and attention mechanisms")."""
        v = math.ceil(self.m.vocab_size / self.hw.head_shards)
        gemm = self.gemm if self.hw.head_int8 else self.bf16_gemm
        return gemm(rows, self.m.hidden * v, n=v) + self.fixed("head")

    def sampling(self, rows: int) -> float:
        """Reading the logits once (argmax / top-p), memory-bound."""
        read = rows * self.m.vocab_size * 4 / (self.hw.hbm_bytes_per_s * self.hw.mem_eff)
        return read + self.fixed("sampling")

    # -- transfers ------------------------------------------------------------------------------
    def link(self, kind: str, *, persistent: bool = False) -> LinkCosts:
        """The mechanism's constants for a dispatch-like (A2E) or combine-like (E2A) exchange;
        persistent: run by a kernel already polling (xDeepServe §5.2: the MoE dies' persistent
        kernels), so without the kernel start."""
        link = self._links.get((kind, persistent))
        if link is None:
            link = self._links[kind, persistent] = self._link(kind, persistent)
        return link

    def _link(self, kind: str, persistent: bool) -> LinkCosts:
        hw = self.hw
        start = hw.dispatch_start_s if kind == "dispatch" else hw.combine_start_s
        return LinkCosts(
            read_bytes_per_s=hw.read_bytes_per_s,
            write_latency_s=hw.write_latency_s,
            read_latency_s=hw.read_latency_s,
            start_s=0.0 if persistent else start,
            jitter_s=hw.jitter_s,
            node_dies=hw.node_dies,
            intra_read_bytes_per_s=hw.intra_read_bytes_per_s,
            intra_write_latency_s=hw.intra_write_latency_s,
            intra_read_latency_s=hw.intra_read_latency_s,
            tail=hw.tail,
        )

    def row_bytes(self, kind: str, *, int8: bool = True) -> int:
        """Dispatch rows are INT8 + a 4-byte scale (or activations); combine rows activations."""
        if kind == "dispatch" and int8:
            return self.m.hidden + 4
        return self.m.hidden * self.hw.act_bytes

    def dispatch(
        self, rows_in: float, *, peers: int, int8: bool = True, persistent: bool = False
    ) -> float:
        """Flags to every peer, then pull `rows_in` rows from the peers."""
        nbytes = rows_in * self.row_bytes("dispatch", int8=int8)
        link = self._start_for(self.link("dispatch", persistent=persistent), peers)
        return exchange_s(link, peers=peers, bytes_in=nbytes)

    def combine(self, rows_back: float, *, peers: int, persistent: bool = False) -> float:
        """Flags, then pull this die's rows' expert outputs back."""
        nbytes = rows_back * self.row_bytes("combine")
        link = self._start_for(self.link("combine", persistent=persistent), peers)
        return exchange_s(link, peers=peers, bytes_in=nbytes)

    def _start_for(self, link: LinkCosts, peers: int) -> LinkCosts:
        """The link with its kernel start for a call reaching `peers` dies: fixed (the point), or,
        with hw.start_per_peer_at N, the start set on an N-peer call times peers / N."""
        if not self.hw.start_per_peer_at:
            return link
        return replace(link, start_s=link.start_s * peers / self.hw.start_per_peer_at)

    def start_wait(self, kind: str, *, peers: int) -> float:
        """The part of a dispatch-like or combine-like call spent waiting for the last of
        `peers` dies to start (stragglers: the fitted jitter), inside `dispatch`/`combine`."""
        return wait_s(self.link(kind), peers)

    def expert_pull(self) -> float:
        """One routed expert's weights (SwiGLU, weight_bytes each) pulled over the UB from a
        die that hosts it: an EPLB replica load (xds_mpi/eplb)."""
        nbytes = 3.0 * self.m.hidden * self.m.moe_intermediate * self.hw.weight_bytes
        return self.hw.write_latency_s + self.hw.read_latency_s + nbytes / self.hw.read_bytes_per_s


@cache  # a die prices two exchanges a MoE layer, always with the same n
def expected_max_z(n: int) -> float:
    """E[max of n standard normal draws] (Blom's approximation); 0 for a single die."""
    if n <= 1:
        return 0.0
    return normal_quantile((n - 0.375) / (n + 0.25))


@dataclass(frozen=True, kw_only=True)
class LinkCosts:
    """What the mechanism reads from a hardware profile."""

    read_bytes_per_s: float  # from a peer outside the die's node
    write_latency_s: float
    read_latency_s: float
    start_s: float  # kernel start (and quantization, for dispatch): fitted
    jitter_s: float  # spread of a die's start: fitted
    node_dies: int = 0  # dies in a node, reached over the inner tier (0: one tier)
    intra_read_bytes_per_s: float = 0.0
    intra_write_latency_s: float = 0.0
    intra_read_latency_s: float = 0.0
    tail: Tail | None = None  # stragglers beyond the jitter (waits.py)

    def inside(self, peers: int) -> int:
        """How many of `peers` (the die included) sit in the die's node."""
        return min(peers, self.node_dies) if self.node_dies else peers


def exchange_s(link: LinkCosts, *, peers: int, bytes_in: float) -> float:
    """Seconds of one die's dispatch-like exchange with `peers` dies (itself included) taking in
    `bytes_in` bytes."""
    return link.start_s + transfer_s(link, peers=peers, bytes_in=bytes_in) + wait_s(link, peers)


def transfer_s(link: LinkCosts, *, peers: int, bytes_in: float) -> float:
    """Step 1 (flags to every peer) and Step 2 (a pull from every peer), then the bytes in. The
    cores' sends are pipelined (module docstring), so the call pays one write and one read
    latency however many peers each core serves: a stream with fewer AIV cores
    (CloudMatrix-Infer §4.2.3's stream 1: 16 of 48) is not slower for it. Two tiers (a node's
    inner links, the network between nodes): with uniform routing a share inside / peers of the
    bytes comes from the die's node and the rest from outside, both links at once; the call
    pays the outer tier's latency once any of its peers is outside the node."""
    inside = link.inside(peers)
    if not link.node_dies:  # one tier
        return link.write_latency_s + link.read_latency_s + bytes_in / link.read_bytes_per_s
    outer = inside < peers
    latency = (
        link.write_latency_s + link.read_latency_s
        if outer
        else link.intra_write_latency_s + link.intra_read_latency_s
    )
    bytes_out = bytes_in * (1 - inside / peers)
    moving = max(
        (bytes_in - bytes_out) / link.intra_read_bytes_per_s, bytes_out / link.read_bytes_per_s
    )
    return latency + moving


def wait_s(link: LinkCosts, peers: int) -> float:
    """The barrier waits for the slowest of `peers` dies' starts: the jitter's normal body and,
    where the link carries one, the straggler tail (waits.py)."""
    if link.tail is None:
        return link.jitter_s * expected_max_z(peers)
    return tail_wait_s(link.jitter_s, link.tail, peers)


@dataclass(frozen=True, kw_only=True)
class Table7Fit:
    """Fitted constants and the table they reproduce: rows are (op, EP, published us, fit us)."""

    dispatch_start_us: float
    combine_start_us: float
    jitter_us: float
    rows: tuple[tuple[str, int, float, float], ...]


def fit_table7(
    link: LinkCosts, table: list[tuple[str, int, float]], *, tokens: int, row_bytes: dict
) -> Table7Fit:
    """Least squares (no negative constant) of published = start(op) + jitter x z(EP) +
    transfer terms over the rows (op, EP, latency us) of a primitive table measured at `tokens`
    x top-8 rows per rank; row_bytes: op -> bytes of one row."""
    z = np.array([expected_max_z(ep) for _, ep, _ in table])
    known = np.array(
        [transfer_s(link, peers=ep, bytes_in=tokens * 8 * row_bytes[op]) for op, ep, _ in table]
    )
    published = np.array([us * 1e-6 for _, _, us in table])
    design = np.stack(
        [
            [1.0 if op == "dispatch" else 0.0 for op, _, _ in table],
            [1.0 if op == "combine" else 0.0 for op, _, _ in table],
            z,
        ],
        axis=1,
    )
    d0, c0, jitter = _non_negative_lstsq(design, published - known)
    fitted = design @ np.array([d0, c0, jitter]) + known
    return Table7Fit(
        dispatch_start_us=d0 * 1e6,
        combine_start_us=c0 * 1e6,
        jitter_us=jitter * 1e6,
        rows=tuple((op, ep, us, f * 1e6) for (op, ep, us), f in zip(table, fitted, strict=True)),
    )


def _non_negative_lstsq(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a constant that would come out negative (a
    start shorter than nothing) is held at 0 and the others refitted."""
    free = list(range(design.shape[1]))
    while True:
        coef = np.zeros(design.shape[1])
        coef[free], *_ = np.linalg.lstsq(design[:, free], target, rcond=None)
        if (coef >= 0).all():
            return coef
        free.remove(int(np.argmin(coef)))
