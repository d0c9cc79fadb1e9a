"""The H800 profile against DeepSeek's own published decode profile, kernel by kernel.

DeepSeek's decode profile (deepseek-ai/profile-data, decode.json): EP128, TP1, 4K prompts, 128
requests per GPU in two microbatches of 64, MTP (two rows per request: FlashMLA's 255 us is
2 x 64 x 128 heads x 4K x 1,088 FLOPs at ~580 TFLOPS), computation on all SMs while the
low-latency all-to-all runs on none ("after RDMA messages are issued, all GPU SMs are freed").
The trace file itself was out of reach here; its kernel times are taken from a public
transcription (docs/projection.md, sources: flagged), per microbatch, and none sets a constant:
the H800 profile is calibrated on DeepGEMM's and FlashMLA's READMEs and [001] Table 7 only.

The schedule priced (`decode_layer`) is DeepSeek's decoding pipeline (deepseek-ai/
open-infra-index, Day 6 "inference system overview": "we subdivide the attention layer into two
steps and use a 5-stage pipeline", its figure "Communication-Computation Overlapping during
Decoding Phase"). Per microbatch the compute is ATTN-0 (the projections before the core
attention), ATTN-1 (the core attention, the output projection and the gate), SHARED (the shared
expert) and MLP (the routed experts); its dispatch and combine (DeepEP's low-latency kernels:
pure RDMA, priced on one tier as the Table 7 fit is) run on no SMs, each under the other
microbatch's block that does not wait for it (the figure's pairing as a public description of
it reads it, flagged in docs/projection.md), and the compute stream waits for a call to
finish before the work that needs it. Two microbatches alternate, so a layer takes

    2 x (max(SHARED + ATTN-0, dispatch) + MLP + max(ATTN-1, combine))

where the first and last blocks each end when both the compute and the call under it are done.
The form before it, max(2 C, C + M) for a microbatch's compute C and communication M, lets any
call hide under any compute; it is kept as `free overlap` for comparison.

Measured at the shape (`at_shape_s`, issue 61's remaining misses): where a calibration table
measured a kernel at exactly the shape the profile runs, the harness takes that measurement and
not the fit through the table (the fit interpolates; the row is the kernel). DeepGEMM's README
has the shared expert's two GEMMs and q_a/kv_a, q_b, o_proj at M = 128, and the routed experts'
masked grouped GEMMs at 2 x 512 rows; [001] Table 7 has DeepEP's dispatch and combine at EP128
and 128 tokens per rank, the profile's own microbatch. Each replaces its kernel's fixed cost
plus roofline in the block it belongs to (`decode_layer(measured=...)`); the MTP module's layer
(64 rows a microbatch, no such rows for its grouped GEMMs) stays on the fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xds_mpi.config.hardware import load_profile
from xds_mpi.model.shapes import cost_shape
from xds_mpi.projection.cost import CostModel, Hardware
from xds_mpi.projection.kernels import gemm_rows
from xds_mpi.projection.paper_data import TABLE7_H800, TABLE7_TOKENS

REQUESTS_PER_MB = 64  # 128 requests per GPU, two microbatches
ROWS_PER_REQUEST = 2  # MTP: the token and one draft
KV_LEN = 4096
EP = 128
LOCAL_EXPERTS = 2  # 256 routed experts over EP128, balanced ("absolutely balanced" routing)

# VALIDATION: the public transcription of decode.json's H800 kernel times, us per microbatch.
PROFILE_KERNEL_US = {
    "q_a/kv_a GEMM": 13.0,
    "q_b GEMM": 19.0,
    "W_UK bmm": 16.0,
    "FlashMLA": 255.0,
    "W_UV bmm": 15.0,
    "o_proj GEMM": 50.0,
    "up/gate grouped GEMM": 81.0,
    "down grouped GEMM": 39.0,
    "dispatch": 187.0,
    "combine": 394.0,
}
PROFILE_GROUP_US = {"attention side": 388.0, "gate": 19.0}
PROFILE_LAYERS_MS = 87.32  # the 61 layers
PROFILE_END_TO_END_MS = 96.0
# [001] Table 4, "DeepSeek (Profile) on H800": batch 128, KV 4,096, TPOT ~50.2 ms, 2,325 tokens/s.
# Pinned: 128 / 50.2 ms is 2,550, not 2,325; the two use different step times: 50.2 = the 61
# layers' 87.3 ms / 1.74 and 2,325 = 128 x 1.74 / 95.8 ms (end to end). Both are the profile's
# own times with an acceptance (0.74 fits both; the table states 70 % for its MTP rows):
# derived rows of the profile's, priced here at [001]'s 70 %.
TABLE4_TPOT_MS = 50.2
TABLE4_TOKENS_PER_S = 2325.0
TABLE4_ACCEPT = 0.7


@dataclass(frozen=True, kw_only=True)
class HarnessRow:
    what: str
    level: str  # kernel, group, layer, end to end, Table 4
    published: float
    projected: float
    unit: str
    role: str = "validation"
    derived_from: str = ""

    @property
    def error(self) -> float:
        return self.projected / self.published - 1.0


def h800_cost(hw: Hardware | None = None) -> CostModel:
    """The H800 profile's cost model, its links on one tier (DeepEP's low-latency kernels
    reach every peer over RDMA, as the Table 7 fit takes them)."""
    hw = hw or Hardware.from_profile(load_profile("h800"))
    return CostModel(cost_shape(), replace(hw, node_dies=0))


def kernel_us(cost: CostModel) -> dict[str, float]:
    """Each profiled kernel as the model prices it, one microbatch (us)."""
    m, rows = cost.m, REQUESTS_PER_MB * ROWS_PER_REQUEST
    fixed = cost.hw.ops.fixed_s
    down = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_dim
    up = m.num_heads * (m.qk_nope_dim + m.qk_rope_dim)
    per_head = m.qk_nope_dim * m.kv_lora_rank
    expert_rows = rows * EP * m.top_k / (EP * LOCAL_EXPERTS)  # per local expert
    inner = m.moe_intermediate
    seconds = {
        "q_a/kv_a GEMM": fixed + cost.gemm(rows, m.hidden * down, n=down),
        "q_b GEMM": fixed + cost.gemm(rows, m.q_lora_rank * up, n=up),
        "W_UK bmm": fixed + cost.bf16_gemm(rows, per_head, n=m.kv_lora_rank, groups=m.num_heads),
        "FlashMLA": cost.attention([(KV_LEN, ROWS_PER_REQUEST)] * REQUESTS_PER_MB),
        "W_UV bmm": fixed + cost.bf16_gemm(rows, per_head, n=m.v_head_dim, groups=m.num_heads),
        "o_proj GEMM": fixed + cost.gemm(rows, m.num_heads * m.v_head_dim * m.hidden, n=m.hidden),
        "up/gate grouped GEMM": fixed
        + cost.gemm(expert_rows, m.hidden * 2 * inner, n=2 * inner, groups=LOCAL_EXPERTS),
        "down grouped GEMM": fixed
        + cost.gemm(expert_rows, inner * m.hidden, n=m.hidden, groups=LOCAL_EXPERTS),
        "dispatch": cost.dispatch(rows * m.top_k, peers=EP),
        "combine": cost.combine(rows * m.top_k, peers=EP),
    }
    return {k: v * 1e6 for k, v in seconds.items()}


def kernel_shapes(cost: CostModel) -> dict[str, tuple[str, tuple[int, int, int, int]]]:
    """Each GEMM kernel of a microbatch: (its block, (groups, M per group, N, K))."""
    m, rows = cost.m, REQUESTS_PER_MB * ROWS_PER_REQUEST
    down = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_dim
    up = m.num_heads * (m.qk_nope_dim + m.qk_rope_dim)
    inner = m.moe_intermediate
    per_expert = rows * m.top_k // LOCAL_EXPERTS  # balanced: 512 rows each
    return {
        "q_a/kv_a GEMM": ("ATTN-0", (1, rows, down, m.hidden)),
        "q_b GEMM": ("ATTN-0", (1, rows, up, m.q_lora_rank)),
        "o_proj GEMM": ("ATTN-1", (1, rows, m.hidden, m.num_heads * m.v_head_dim)),
        "shared up/gate GEMM": ("SHARED", (1, rows, 2 * inner, m.hidden)),
        "shared down GEMM": ("SHARED", (1, rows, m.hidden, inner)),
        "up/gate grouped GEMM": ("MLP", (LOCAL_EXPERTS, per_expert, 2 * inner, m.hidden)),
        "down grouped GEMM": ("MLP", (LOCAL_EXPERTS, per_expert, m.hidden, inner)),
    }


def fitted_s(cost: CostModel) -> dict[str, float]:
    """Each kernel of `kernel_shapes` and the two calls as the fit prices them (seconds): the
    fixed cost plus the roofline at the fitted efficiencies."""
    fixed, rows = cost.hw.ops.fixed_s, REQUESTS_PER_MB * ROWS_PER_REQUEST
    out = {what: fixed + cost.gemm(mm, n * k, n=n, groups=g)
           for what, (_, (g, mm, n, k)) in kernel_shapes(cost).items()}  # fmt: skip
    out["dispatch"] = cost.dispatch(rows * cost.m.top_k, peers=EP)
    out["combine"] = cost.combine(rows * cost.m.top_k, peers=EP)
    return out


def at_shape_s(cost: CostModel) -> dict[str, tuple[float, str]]:
    """kernel -> (seconds, source) for the kernels a calibration table measured at exactly the
    profile's shape: DeepGEMM's README rows (h800.yaml operators.gemm_rows) and [001] Table 7's
    DeepEP rows at EP128 and 128 tokens per rank (module docstring)."""
    table = {(r.groups, r.m, r.n, r.k): r.seconds for r in gemm_rows(load_profile("h800"))}
    found = {what: (table[shape], f"DeepGEMM README row {shape}")
             for what, (_, shape) in kernel_shapes(cost).items() if shape in table}  # fmt: skip
    if REQUESTS_PER_MB * ROWS_PER_REQUEST == TABLE7_TOKENS:
        for op, ep, us in TABLE7_H800:
            if ep == EP:
                found[op] = (us * 1e-6, f"[001] Table 7 DeepEP row, EP{ep}, {TABLE7_TOKENS} tokens")
    return found


def at_shape_deltas(cost: CostModel) -> dict[str, float]:
    """block -> seconds its kernels measured at their shape add over their fitted price (what
    `decode_layer(measured=...)` takes)."""
    blocks = {what: block for what, (block, _) in kernel_shapes(cost).items()}
    blocks |= {"dispatch": "dispatch", "combine": "combine"}
    fitted, deltas = fitted_s(cost), {}
    for what, (seconds, _) in at_shape_s(cost).items():
        deltas[blocks[what]] = deltas.get(blocks[what], 0.0) + seconds - fitted[what]
    return deltas


def decode_layer(
    cost: CostModel, rows_per_request: int = ROWS_PER_REQUEST, *, measured: dict | None = None
) -> dict[str, float]:
    """One microbatch's blocks and calls and the layer the five-stage pipeline makes of two
    (module docstring; seconds). measured: block -> seconds the kernels measured at their shape
    take over their fitted price (`at_shape_deltas`); None: the fit alone."""
    delta = measured or {}
    m, rows = cost.m, REQUESTS_PER_MB * rows_per_request
    per_head = m.qk_nope_dim * m.kv_lora_rank
    # W_UV and o_proj follow the core attention: ATTN-1's, though mla_prolog prices them
    o_part = (
        cost.bf16_gemm(rows, per_head, n=m.v_head_dim, groups=m.num_heads)
        + cost.gemm(rows, m.num_heads * m.v_head_dim * m.hidden, n=m.hidden)
        + cost.fixed("o_proj")
    )
    core = cost.attention([(KV_LEN, rows_per_request)] * REQUESTS_PER_MB)
    attn0 = cost.mla_prolog(rows) - o_part + delta.get("ATTN-0", 0.0)
    attn1 = core + o_part + cost.gate(rows) + delta.get("ATTN-1", 0.0)
    shared = cost.experts([rows]) + delta.get("SHARED", 0.0)
    # each GPU takes in rows x top-k from the EP peers (balanced), over its local experts
    mlp = cost.routed(rows * m.top_k, LOCAL_EXPERTS) + delta.get("MLP", 0.0)
    dispatch = cost.dispatch(rows * m.top_k, peers=EP) + delta.get("dispatch", 0.0)
    combine = cost.combine(rows * m.top_k, peers=EP) + delta.get("combine", 0.0)
    compute, comm = attn0 + attn1 + shared + mlp, dispatch + combine
    stages = max(shared + attn0, dispatch) + mlp + max(attn1, combine)
    dense = cost.mla_prolog(rows) + core + cost.dense_ffn(rows)
    return {
        "attention side": attn0 + attn1 - cost.gate(rows),
        "gate": cost.gate(rows),
        "ATTN-0": attn0,
        "ATTN-1": attn1,
        "SHARED": shared,
        "MLP": mlp,
        "dispatch": dispatch,
        "combine": combine,
        "compute": compute,
        "communication": comm,
        "moe layer": 2 * stages,
        "free overlap": max(2 * compute, compute + comm),
        "dense layer": 2 * dense,
    }


def end_tail_s(cost: CostModel) -> dict[str, float]:
    """What end to end adds to the 61 layers, each from its shape (seconds): the MTP module's
    layer (one row per request, the same pipeline) and its eh_proj (2 x hidden -> hidden, BF16);
    the head (BF16: the DeepSeek-V3 report keeps the output head in its original precision) as
    two calls, since the MTP module runs on the main model's hidden state (DeepSeek-V3 report
    §2.2, the modules are sequential): the main model's two rows a request, then the draft's
    one, each call reading the 129,280 x 7,168 weights; sampling reads each call's logits."""
    batch = 2 * REQUESTS_PER_MB
    main, draft = batch * ROWS_PER_REQUEST, batch
    return {
        "MTP layer": decode_layer(cost, 1)["moe layer"],
        "MTP eh_proj": cost.mtp_projection(batch),
        "head, main rows": cost.head(main),
        "head, draft rows": cost.head(draft),
        "sampling": cost.sampling(main) + cost.sampling(draft),
    }


def pipeline_at_published(cost: CostModel) -> float:
    """The five-stage MoE layer with every block's transcribed kernels at their published times
    and the rest (norms, RoPE, quantization, SiLU, the shared expert: not timed in the
    transcription) at the model's: how much of the layer's miss the kernel rows explain."""
    fit = kernel_us(cost)
    pub = {k: v * 1e-6 for k, v in PROFILE_KERNEL_US.items()}
    off = {k: pub[k] - fit[k] * 1e-6 for k in pub}
    gate_off = PROFILE_GROUP_US["gate"] * 1e-6 - cost.gate(REQUESTS_PER_MB * ROWS_PER_REQUEST)
    deltas = {
        "ATTN-0": off["q_a/kv_a GEMM"] + off["q_b GEMM"] + off["W_UK bmm"],
        "ATTN-1": off["FlashMLA"] + off["W_UV bmm"] + off["o_proj GEMM"] + gate_off,
        "MLP": off["up/gate grouped GEMM"] + off["down grouped GEMM"],
        "dispatch": off["dispatch"],
        "combine": off["combine"],
    }
    return decode_layer(cost, measured=deltas)["moe layer"]


def harness_rows(hw: Hardware | None = None, *, at_shape: bool = True) -> list[HarnessRow]:
    """The validation rows: each kernel, the two groups, the mean layer, end to end, and
    Table 4's row (derived from the profile's own times). at_shape: the kernels a calibration
    table measured at the profile's shape take that measurement (module docstring); False:
    the fit alone (the harness before)."""
    cost = h800_cost(hw)
    m = cost.m
    mine = kernel_us(cost)
    measured = at_shape_deltas(cost) if at_shape else None
    if at_shape:
        mine |= {k: s * 1e6 for k, (s, _) in at_shape_s(cost).items() if k in mine}
    rows = [HarnessRow(what=k, level="kernel", published=v, projected=mine[k], unit="us")
            for k, v in PROFILE_KERNEL_US.items()]  # fmt: skip
    layer = decode_layer(cost, measured=measured)
    for k, v in PROFILE_GROUP_US.items():
        rows.append(HarnessRow(what=k, level="group", published=v, projected=layer[k] * 1e6,
                               unit="us"))  # fmt: skip
    num_moe = m.num_layers - m.num_dense_layers
    layers = num_moe * layer["moe layer"] + m.num_dense_layers * layer["dense layer"]
    rows.append(HarnessRow(what="61 layers / 61", level="layer",
                           published=PROFILE_LAYERS_MS * 1e3 / m.num_layers,
                           projected=layers / m.num_layers * 1e6, unit="us"))  # fmt: skip
    end_to_end = layers + sum(end_tail_s(cost).values())
    batch = 2 * REQUESTS_PER_MB
    rows.append(HarnessRow(what="end to end", level="end to end",
                           published=PROFILE_END_TO_END_MS, projected=end_to_end * 1e3,
                           unit="ms"))  # fmt: skip
    tokens = 1 + TABLE4_ACCEPT
    rows += [
        HarnessRow(what="TPOT", level="Table 4", published=TABLE4_TPOT_MS,
                   projected=layers / tokens * 1e3, unit="ms", role="derived",
                   derived_from="the 61 layers' 87.3 ms / 1.74"),
        HarnessRow(what="tokens/s per GPU", level="Table 4", published=TABLE4_TOKENS_PER_S,
                   projected=batch * tokens / end_to_end, unit="tok/s", role="derived",
                   derived_from="128 x 1.74 / 95.8 ms end to end"),
    ]  # fmt: skip
    return rows
