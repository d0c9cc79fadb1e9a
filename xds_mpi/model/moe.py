"""DeepSeek-V3 MoE: sigmoid gate with selection bias and group-limited routing, SwiGLU experts.

The distributed engine runs exactly these pieces on different dies, so they stay separate:
`Gate.__call__` (attention die), `dispatch_input` (what leaves the attention die, optionally
INT8), `MoE.expert_forward` (one expert over the rows it received), `MoE.shared_forward` and
`combine`. `MoE.__call__` chains them in one process for the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from xccl.quant import quant_dequant
from xds_mpi.config.schema import Config, ModelConfig
from xds_mpi.model.layers import SwiGLU, matmul
from xds_mpi.model.params import LazyList


@dataclass(frozen=True, kw_only=True)
class Routing:
    """The gate's decision for a batch of rows."""

    topk_idx: np.ndarray  # [rows, top_k] int64: routed expert ids, highest biased score first
    topk_weight: np.ndarray  # [rows, top_k] float: unbiased scores normalized, x routed_scaling


def select_experts(
    scores: np.ndarray,
    bias: np.ndarray,
    *,
    top_k: int,
    num_expert_groups: int,
    topk_groups: int,
    routed_scaling: float,
) -> Routing:
    """DeepSeek-V3 routing from sigmoid scores: [rows, num_experts] (bias: [num_experts]).

    The bias only steers which experts are chosen; the weights use the unbiased scores. Ties go
    to the lower expert id.
    """
    num_rows, num_experts = scores.shape
    biased = scores + bias  # [rows, experts]
    if num_expert_groups > 1:
        # Step 1: a group's score is the sum of its two best biased scores.
        per_group = num_experts // num_expert_groups  # spelled out: a die may have 0 rows
        grouped = biased.reshape(
            num_rows, num_expert_groups, per_group
        )  # [rows, groups, per_group]
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)  # [rows, groups]
        # Step 2: keep the topk_groups best groups, hide every other group's experts.
        group_idx = _topk_indices(group_scores, topk_groups)  # [rows, topk_groups]
        is_kept = np.zeros(group_scores.shape, bool)
        np.put_along_axis(is_kept, group_idx, True, axis=1)
        biased = np.where(is_kept[..., None], grouped, -np.inf).reshape(num_rows, num_experts)
    # Step 3: top-k experts by biased score; weights from the unbiased scores.
    topk_idx = _topk_indices(biased, top_k)  # [rows, top_k]
    weight = np.take_along_axis(scores, topk_idx, axis=1)
    weight = weight / weight.sum(-1, keepdims=True) * routed_scaling
    return Routing(topk_idx=topk_idx, topk_weight=weight)


def _topk_indices(values: np.ndarray, k: int) -> np.ndarray:
    """[rows, n] -> [rows, k] int64: the k largest per row, largest first, ties to the lower
    index."""
    return np.argsort(-values, axis=-1, kind="stable")[:, :k].astype(np.int64)


class Gate:
    def __init__(self, cfg: ModelConfig, params: dict, prefix: str) -> None:
        self.cfg = cfg
        self.weight = params[prefix + "weight"]  # [num_routed_experts, hidden]
        self.wt = np.ascontiguousarray(self.weight.T)
        # DeepSeek-V3's e_score_correction_bias (auxiliary-loss-free load balancing).
        self.bias = params[prefix + "bias"]

    def __call__(self, x: np.ndarray) -> Routing:
        """x: [rows, hidden] normalized hidden rows -> Routing"""
        scores = 1.0 / (1.0 + np.exp(-matmul(x, self.wt)))  # [rows, num_routed_experts]
        return select_experts(
            scores,
            self.bias,
            top_k=self.cfg.top_k,
            num_expert_groups=self.cfg.num_expert_groups,
            topk_groups=self.cfg.topk_groups,
            routed_scaling=self.cfg.routed_scaling,
        )


ROW_DTYPES = {"float64": np.dtype(np.float64), "float32": np.dtype(np.float32)}


def dispatch_input(x: np.ndarray, *, use_int8: bool, row_dtype: str = "float64") -> np.ndarray:
    """The rows as the routed experts receive them: after the INT8 per-token trip that xccl's
    dispatch makes (the very same function, so INT8 runs compare token for token), or rounded
    to the wire's row dtype (x itself when that is x's own dtype)."""
    if use_int8:
        return quant_dequant(x).astype(x.dtype, copy=False)
    return on_wire(x, row_dtype)


def on_wire(x: np.ndarray, row_dtype: str) -> np.ndarray:
    """x after a trip through XCCL rows of `row_dtype` (float64 or float32), back in x's dtype:
    x itself when the wire is as wide as x."""
    wire_dtype = ROW_DTYPES[row_dtype]
    if wire_dtype.itemsize >= x.dtype.itemsize:
        return x
    return x.astype(wire_dtype).astype(x.dtype)


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

    def routed_in(self, x: np.ndarray) -> np.ndarray:
        return dispatch_input(x, use_int8=self.use_int8, row_dtype=self.row_dtype)

    def shared_in(self, x: np.ndarray) -> np.ndarray:
        if self.shared == "routed":
            return self.routed_in(x)
        return on_wire(x, self.row_dtype) if self.shared == "rows" else x

    def back(self, out: np.ndarray) -> np.ndarray:
        """Expert outputs after combine / E2A brought them home."""
        return on_wire(out, self.row_dtype)

    def shared_back(self, out: np.ndarray) -> np.ndarray:
        return out if self.shared == "local" else self.back(out)


def combine(expert_out: np.ndarray, topk_weight: np.ndarray, shared_out: np.ndarray) -> np.ndarray:
    """expert_out: [rows, top_k, hidden] (row r's k-th routed expert's output), topk_weight:
    [rows, top_k], shared_out: [rows, hidden] -> [rows, hidden]. Summed in top-k order."""
    return shared_out + (topk_weight[..., None] * expert_out).sum(1)


NO_WIRE = Wire()  # one process, no XCCL: the rows stay as they are


class MoE:
    def __init__(self, cfg: ModelConfig, params: dict, prefix: str) -> None:
        self.gate = Gate(cfg, params, prefix + "gate.")
        self.params, self.prefix = params, prefix
        # Built when first used: a die uses only the experts its slots host.
        self.experts = LazyList(cfg.num_routed_experts, self._expert)
        self.shared_experts = [
            SwiGLU(params, f"{prefix}shared_experts.{e}.") for e in range(cfg.num_shared_experts)
        ]

    def _expert(self, expert_idx: int) -> SwiGLU:
        return SwiGLU(self.params, f"{self.prefix}experts.{expert_idx}.")

    def expert_forward(self, expert_idx: int, x: np.ndarray) -> np.ndarray:
        """One routed expert over the rows routed to it: x [n, hidden] -> [n, hidden]"""
        return self.experts[expert_idx](x)

    def shared_forward(self, x: np.ndarray) -> np.ndarray:
        """Every shared expert over every row, summed: x [rows, hidden] -> [rows, hidden]"""
        out = np.zeros_like(x)
        for expert in self.shared_experts:
            out = out + expert(x)
        return out

    def run_routed(self, x: np.ndarray, routing: Routing) -> np.ndarray:
        """Every routed expert in this process: x [rows, hidden] -> [rows, top_k, hidden]"""
        expert_out = np.zeros((*routing.topk_idx.shape, x.shape[1]), x.dtype)
        for expert_idx in np.unique(routing.topk_idx).tolist():
            row_idx, k_idx = np.nonzero(routing.topk_idx == expert_idx)
            expert_out[row_idx, k_idx] = self.expert_forward(expert_idx, x[row_idx])
        return expert_out

    def __call__(self, x: np.ndarray, *, wire: Wire = NO_WIRE) -> np.ndarray:
        """x: [rows, hidden] normalized hidden rows -> [rows, hidden] MoE output, the rows and
        outputs making the trip `wire` describes."""
        routing = self.gate(x)
        expert_out = wire.back(self.run_routed(wire.routed_in(x), routing))
        shared_out = wire.shared_back(self.shared_forward(wire.shared_in(x)))
        return combine(expert_out, routing.topk_weight, shared_out)
