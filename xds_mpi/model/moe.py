"""DeepSeek-V3 MoE: sigmoid gate with selection bias and group-limited routing, SwiGLU experts.

The distributed engine runs exactly these pieces on different dies, so they stay separate:
`Gate.forward` (attention die), `dispatch_input` (what leaves the attention die, optionally INT8),
`MoE.expert_forward` (one expert over the rows it received), `MoE.shared_forward` and `combine`.
`MoE.forward` chains them in one process for the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from xccl.quant import quant_dequant
from xds_mpi.config.schema import Config, ModelConfig
from xds_mpi.model.layers import SwiGLU


@dataclass(frozen=True, kw_only=True)
class Routing:
    """The gate's decision for a batch of rows."""

    topk_idx: torch.Tensor  # [rows, top_k] int64: routed expert ids, highest biased score first
    topk_weight: torch.Tensor  # [rows, top_k] float: unbiased scores normalized, x routed_scaling


def select_experts(
    scores: torch.Tensor,
    bias: torch.Tensor,
    *,
    top_k: int,
    num_expert_groups: int,
    topk_groups: int,
    routed_scaling: float,
) -> Routing:
    """DeepSeek-V3 routing from sigmoid scores: [rows, num_experts] (bias: [num_experts]).

    The bias only steers which experts are chosen; the weights use the unbiased scores.
    """
    num_rows, num_experts = scores.shape
    biased = scores + bias  # [rows, experts]
    if num_expert_groups > 1:
        # Step 1: a group's score is the sum of its two best biased scores.
        grouped = biased.view(num_rows, num_expert_groups, -1)  # [rows, groups, per_group]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        # Step 2: keep the topk_groups best groups, hide every other group's experts.
        group_idx = group_scores.topk(topk_groups, dim=-1).indices  # [rows, topk_groups]
        is_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        biased = grouped.masked_fill(~is_kept[..., None], -torch.inf).view(num_rows, num_experts)
    # Step 3: top-k experts by biased score; weights from the unbiased scores.
    topk_idx = biased.topk(top_k, dim=-1).indices  # [rows, top_k]
    weight = scores.gather(1, topk_idx)
    weight = weight / weight.sum(-1, keepdim=True) * routed_scaling
    return Routing(topk_idx=topk_idx, topk_weight=weight)


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_routed_experts, cfg.hidden))
        # DeepSeek-V3's e_score_correction_bias (auxiliary-loss-free load balancing).
        self.bias = nn.Parameter(torch.zeros(cfg.num_routed_experts))

    def forward(self, x: torch.Tensor) -> Routing:
        """x: [rows, hidden] normalized hidden rows -> Routing"""
        scores = torch.sigmoid(x @ self.weight.T)  # [rows, num_routed_experts]
        return select_experts(
            scores,
            self.bias,
            top_k=self.cfg.top_k,
            num_expert_groups=self.cfg.num_expert_groups,
            topk_groups=self.cfg.topk_groups,
            routed_scaling=self.cfg.routed_scaling,
        )


ROW_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def dispatch_input(x: torch.Tensor, *, use_int8: bool, row_dtype: str = "float64") -> torch.Tensor:
    """The rows as the routed experts receive them: after the INT8 per-token trip that xccl's
    dispatch makes (the very same function, so INT8 runs compare token for token), or rounded
    to the wire's row dtype (x itself when that is x's own dtype)."""
    if use_int8:
        return torch.from_numpy(quant_dequant(x.detach().numpy())).to(x.dtype)
    return on_wire(x, row_dtype)


def on_wire(x: torch.Tensor, row_dtype: str) -> torch.Tensor:
    """x after a trip through XCCL rows of `row_dtype` (float64 or float32), back in x's dtype:
    x itself when the wire is as wide as x."""
    wire_dtype = ROW_DTYPES[row_dtype]
    if torch.finfo(wire_dtype).bits >= torch.finfo(x.dtype).bits:
        return x
    return x.to(wire_dtype).to(x.dtype)


@dataclass(frozen=True, kw_only=True)
class Wire:
    """What XCCL does to a MoE layer's rows on their way to the experts and back, so the
    single-process reference makes the same trip as the distributed path.

    use_int8: routed rows cross dispatch / A2E as INT8 + a per-token scale.
    row_dtype: rows not sent as INT8, and every expert output coming back, cross in this dtype.
    shared: where the shared expert's rows go: "local" (computed where the token is: colocated
    every_die), "routed" (one more dispatch column, sent like the routed rows: colocated with
    dedicated shared-expert dies) or "rows" (A2E's shared rows, in row_dtype: afd).
    """

    use_int8: bool = False
    row_dtype: str = "float64"
    shared: Literal["local", "routed", "rows"] = "local"

    @classmethod
    def for_config(cls, cfg: Config) -> Wire:
        dep = cfg.deployment
        if dep.kind == "afd":
            shared = "rows"
        else:
            shared = "routed" if dep.shared_experts == "dedicated" else "local"
        return cls(use_int8=cfg.xccl.use_int8, row_dtype=cfg.xccl.row_dtype, shared=shared)

    def routed_in(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch_input(x, use_int8=self.use_int8, row_dtype=self.row_dtype)

    def shared_in(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared == "routed":
            return self.routed_in(x)
        return on_wire(x, self.row_dtype) if self.shared == "rows" else x

    def back(self, out: torch.Tensor) -> torch.Tensor:
        """Expert outputs after combine / E2A brought them home."""
        return on_wire(out, self.row_dtype)

    def shared_back(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.shared == "local" else self.back(out)


def combine(
    expert_out: torch.Tensor, topk_weight: torch.Tensor, shared_out: torch.Tensor
) -> torch.Tensor:
    """expert_out: [rows, top_k, hidden] (row r's k-th routed expert's output), topk_weight:
    [rows, top_k], shared_out: [rows, hidden] -> [rows, hidden]. Summed in top-k order."""
    return shared_out + (topk_weight[..., None] * expert_out).sum(1)


NO_WIRE = Wire()  # one process, no XCCL: the rows stay as they are


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(
            SwiGLU(cfg.hidden, cfg.moe_intermediate) for _ in range(cfg.num_routed_experts)
        )
        self.shared_experts = nn.ModuleList(
            SwiGLU(cfg.hidden, cfg.moe_intermediate) for _ in range(cfg.num_shared_experts)
        )

    def expert_forward(self, expert_idx: int, x: torch.Tensor) -> torch.Tensor:
        """One routed expert over the rows routed to it: x [n, hidden] -> [n, hidden]"""
        return self.experts[expert_idx](x)

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every shared expert over every row, summed: x [rows, hidden] -> [rows, hidden]"""
        out = torch.zeros_like(x)
        for expert in self.shared_experts:
            out = out + expert(x)
        return out

    def run_routed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every routed expert in this process: x [rows, hidden] -> [rows, top_k, hidden]"""
        expert_out = x.new_zeros(*routing.topk_idx.shape, x.shape[1])
        for expert_idx in routing.topk_idx.unique().tolist():
            row_idx, k_idx = (routing.topk_idx == expert_idx).nonzero(as_tuple=True)
            expert_out[row_idx, k_idx] = self.expert_forward(expert_idx, x[row_idx])
        return expert_out

    def forward(self, x: torch.Tensor, *, wire: Wire = NO_WIRE) -> torch.Tensor:
        """x: [rows, hidden] normalized hidden rows -> [rows, hidden] MoE output, the rows and
        outputs making the trip `wire` describes."""
        routing = self.gate(x)
        expert_out = wire.back(self.run_routed(wire.routed_in(x), routing))
        shared_out = wire.shared_back(self.shared_forward(wire.shared_in(x)))
        return combine(expert_out, routing.topk_weight, shared_out)
