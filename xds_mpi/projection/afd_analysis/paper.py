"""Seed 003's inputs and the numbers its text states, each with where it says so.

Models: Table 4 (Appendix B). Platforms: Table 5 (Appendix B), per GPU, 8 GPUs a node (Figure 4's
caption: "a fixed deployment unit of 8 GPUs per node regardless of the physical Superpod scale");
"Superpod" in Table 5's scale-out row means the scale-up network spans the deployment.

`stated_rows()` evaluates the method (xds_mpi/projection/afd_analysis/budget.py) where the text
gives a number, for `xds-mpi project --afd-analysis --paper` and
tests/e2e/afd/test_afd_analysis.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.projection.afd_analysis.budget import (
    MoeShape,
    Platform,
    Scenario,
    alpha_ep,
    curve,
    dead_zone,
    hfu_ceiling,
    rank_tokens,
)

# Table 4: hidden, layers, dense layers, routed experts, experts per token, MoE intermediate.
_TABLE4 = {
    "deepseek_v3": ("DeepSeek-V3", 7168, 61, 3, 256, 8, 2048),
    "kimi_k2": ("Kimi-K2", 7168, 61, 1, 384, 8, 2048),
    "step3": ("Step3", 7168, 61, 5, 48, 3, 5120),
    "qwen3_coder": ("Qwen3-Coder", 6144, 62, 0, 160, 8, 2560),
    "ernie_4_5": ("ERNIE-4.5", 8192, 54, 3, 64, 8, 3584),
    "glm_4_7": ("GLM-4.7", 5120, 92, 3, 160, 8, 1536),
}
MODELS = {
    key: MoeShape(name=name, hidden=h, num_layers=n, num_moe_layers=n - dense, num_experts=e,
                  top_k=k, moe_intermediate=m)
    for key, (name, h, n, dense, e, k, m) in _TABLE4.items()
}  # fmt: skip

# Table 5: peak FP8 TFLOPS, memory TB/s, memory GB, scale-out GB/s (None: Superpod), scale-up GB/s.
_TABLE5 = {
    "h20": (296, 4, 96, 50, 360),
    "h100": (1979, 3.35, 80, 50, 360),
    "h200": (1979, 4, 141, 50, 360),
    "h800": (1979, 3.35, 80, 50, 160),
    "b200": (4500, 7.7, 180, 50, 720),
    "b300": (4500, 8, 270, 100, 720),
    "gb200": (4500, 7.7, 180, None, 720),
    "gb300": (4500, 8, 270, None, 720),
}
GPUS_PER_NODE = 8  # Figure 4's caption
PLATFORMS = {
    key: Platform(name=key.upper(), flops=tf * 1e12, mem_bytes_per_s=tb * 1e12,
                  mem_bytes=gb * 1e9, scale_out_bytes_per_s=None if out is None else out * 1e9,
                  scale_up_bytes_per_s=up * 1e9, ranks_per_node=GPUS_PER_NODE)
    for key, (tf, tb, gb, out, up) in _TABLE5.items()
}  # fmt: skip

# §3.2 and Figure 4's caption: L_accept 1.7, t_g 15 ms; N_BO = 3 (§2.2). The TPOT the figure
# uses is not stated; its stated HFU numbers do not depend on it (Eq. 19 has no t_B).
PAPER_SCENARIO = Scenario(accept_len=1.7, gap_s=0.015, num_bo=3)

# §3.1: "an average of 740 tokens per expert, indicating an HFU of approximately 60% considering
# EP imbalance" (large-scale EP, from DeepSeek's published inference statistics): a reading of
# the measured GEMM curve of Figure 3, which the text does not tabulate.
LARGE_EP_TOKENS_PER_EXPERT = 740
LARGE_EP_HFU = 0.60
# §3.3: lambda_EP ~ 4 in DeepSeek's profile data; Figure 6 lets AFD reach lambda 5.
LAMBDA_EP_DEEPSEEK = 4.0
LAMBDA_AFD_FIGURE6 = 5.0


@dataclass(frozen=True, kw_only=True)
class StatedRow:
    """A number 003's text states and the method's value for it. tolerance: the half-width of the
    last digit the paper prints (33.1 % -> 0.05 points), as a fraction of the stated value."""

    source: str
    quantity: str
    stated: float
    computed: float
    tolerance: float

    @property
    def error(self) -> float:
        return self.computed / self.stated - 1

    @property
    def is_within(self) -> bool:
        return abs(self.error) <= self.tolerance


def _row(source: str, quantity: str, stated: float, computed: float, last_digit: float):
    return StatedRow(
        source=source,
        quantity=quantity,
        stated=stated,
        computed=computed,
        tolerance=last_digit / 2 / stated,
    )


def stated_rows() -> list[StatedRow]:
    """Every number of 003's text the method reproduces (what it cannot: docs/afd_analysis.md)."""
    dsv3, kimi = MODELS["deepseek_v3"], MODELS["kimi_k2"]
    h800, h20 = PLATFORMS["h800"], PLATFORMS["h20"]
    t_b = 1e-3  # any budget: the ratios below do not depend on it
    up, _ = rank_tokens(dsv3, h800, t_b, 2)
    out = rank_tokens(dsv3, h800, t_b, 64)[0]  # N_F >= TopK: scale-out alone
    rows = [
        _row("§3.2", "AFD HFU ceiling, DeepSeek-V3 on H800 (%)", 33.1,
             100 * hfu_ceiling(dsv3, h800), 0.1),
        _row("App. A", "HFU ceiling, DeepSeek-V3 on GB200 (%)", 65.5,
             100 * hfu_ceiling(dsv3, PLATFORMS["gb200"]), 0.1),
        _row("App. A", "HFU ceiling, Kimi-K2 on GB300 (%)", 65.5,
             100 * hfu_ceiling(kimi, PLATFORMS["gb300"]), 0.1),
        _row("§3.1", "H800 scale-up / scale-out bandwidth", 3.2,
             h800.scale_up_bytes_per_s / h800.scale_out_bytes_per_s, 0.1),
        _row("§3.1", "H20 scale-up / scale-out bandwidth", 7.2,
             h20.scale_up_bytes_per_s / h20.scale_out_bytes_per_s, 0.1),
        _row("§3.1", "DeepSeek-V3, H800, N_F=2: B_rank / B_ScaleOut (scale-up bound)", 3.2,
             up / out, 0.1),
        _row("§3.1", "DeepSeek-V3, N_F=2: TopK / N_F", 4, dsv3.top_k / 2, 1),
        _row("§4.1", "sparsity, DeepSeek-V3", 32, dsv3.sparsity, 1),
        _row("§4.1", "sparsity, Step3", 16, MODELS["step3"].sparsity, 1),
        _row("§3.2", "sparsity, ERNIE-4.5", 8, MODELS["ernie_4_5"].sparsity, 1),
        _row("§3.2", "granularity, ERNIE-4.5 (8/3.5)", 8 / 3.5,
             MODELS["ernie_4_5"].granularity, 0.01),
        _row("§3.2", "granularity, Step3 (7/5)", 7 / 5, MODELS["step3"].granularity, 0.01),
        _row("§5.3", "EaaS scale for DeepSeek-V3 (x base nodes)", 58, dsv3.num_moe_layers, 1),
        _row("§3.3", "FFN share of the budget at lambda_EP 4", 0.2,
             1 / (1 + LAMBDA_EP_DEEPSEEK), 0.1),
        _row("§3.3", "FFN share of the budget at lambda 5", 0.17,
             1 / (1 + LAMBDA_AFD_FIGURE6), 0.01),
    ]  # fmt: skip
    return rows


def figure4_grid(scenario: Scenario, max_ffn_nodes: int = 32) -> list[dict]:
    """Figure 4's configurations (Tables 4 x 5): per platform and model, Eq. 19's ceiling, the
    best HFU over N_F = 1..max_ffn_nodes at `scenario`'s TPOT, where it is reached, and the dead
    zone."""
    grid = []
    for hw_key, hw in PLATFORMS.items():
        for model_key, model in MODELS.items():
            points = curve(model, hw, scenario, max_ffn_nodes)
            feasible = [p for p in points if p.is_feasible]
            best = max(feasible, key=lambda p: p.hfu, default=None)
            grid.append(
                dict(
                    platform=hw_key,
                    model=model_key,
                    ceiling=hfu_ceiling(model, hw),
                    best_hfu=best.hfu if best else 0.0,
                    best_ffn_nodes=best.num_ffn_nodes if best else 0,
                    first_feasible=feasible[0].num_ffn_nodes if feasible else 0,
                    dead_zone=dead_zone(points),
                )
            )
    return grid


def large_ep_reference() -> dict:
    """§3.1's large-EP reference beside the method: 740 tokens per expert is far above H800's
    roofline ridge (peak / memory bandwidth), so the roofline allows 100 % there; the ~60 % is the
    measured GEMM efficiency of Figure 3, which the method cannot derive."""
    h800 = PLATFORMS["h800"]
    ridge = h800.flops / h800.mem_bytes_per_s  # FLOPs per weight byte
    intensity = 2 * LARGE_EP_TOKENS_PER_EXPERT
    return dict(
        tokens_per_expert=LARGE_EP_TOKENS_PER_EXPERT,
        intensity=intensity,
        ridge=ridge,
        roofline_ofu=min(1.0, intensity / ridge),
        stated_hfu=LARGE_EP_HFU,
        afd_ceiling=hfu_ceiling(MODELS["deepseek_v3"], h800),
    )


def alpha_ep_reference(sigma: float) -> float:
    """Eq. 12 at DeepSeek's lambda_EP ~ 4 (§3.3)."""
    return alpha_ep(LAMBDA_EP_DEEPSEEK, sigma)
