"""The weight bytes a new TE's dies load, at the cost shape (DeepSeek-V3), as the projection
prices them: the GEMM weights of MLA, the dense FFNs and the experts at the hardware profile's
`serving.weight_bytes` (INT8 on the 910C, CloudMatrix-Infer §4), the router, the LM head, the
MTP projection, the embedding and the norms in BF16 (as xds_mpi/projection/cost.py reads them).
Quantization scales are not counted (one per output channel: < 0.1 % of the bytes).

A TE's dies split the weights as a colocated TE runs them: attention, dense layers, shared
experts, embedding and head on every die (DP attention), the routed experts spread over the
dies (ceil(experts / dies) each, plus the deployment's redundant slots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from xds_mpi.config.model import ModelConfig
from xds_mpi.model.shapes import cost_shape
from xds_mpi.model.transformer import param_shapes

BF16_BYTES = 2
# Weights kept in BF16 at the cost shape: the router (gate), the LM head, the MTP module's
# eh_proj, the embedding; every 1-D tensor (norms, the router's bias) is BF16 too.
BF16_NAMES = ("gate.weight", "head.weight", "eh_proj.weight", "embed.weight")


@dataclass(frozen=True, kw_only=True)
class ModelBytes:
    """A model's weight bytes in the two parts a TE's dies hold differently.

    replicated: bytes every die holds (attention, dense FFNs, shared experts, embedding, head,
    norms, routers, MTP projection).
    expert: bytes of one routed expert (of one layer set: all its MoE layers, MTP's included).
    num_experts: routed experts."""

    replicated: float
    expert: float
    num_experts: int

    @property
    def total(self) -> float:
        """The model's unique bytes (what one copy in DRAM, the pool or storage holds)."""
        return self.replicated + self.expert * self.num_experts

    def per_die(self, num_dies: int, *, redundant_slots: int = 0) -> float:
        """Bytes one die of a `num_dies`-die TE loads: the replicated part and its experts."""
        experts_per_die = math.ceil(self.num_experts / num_dies) + redundant_slots
        return self.replicated + self.expert * experts_per_die

    def scaled_to(self, total_bytes: float) -> ModelBytes:
        """The same split for a model of `total_bytes` (a published size, e.g. '671 GB')."""
        k = total_bytes / self.total
        return ModelBytes(
            replicated=self.replicated * k, expert=self.expert * k, num_experts=self.num_experts
        )


def model_bytes(m: ModelConfig, weight_bytes: int) -> ModelBytes:
    """Every tensor of `param_shapes(m)`, GEMM weights at `weight_bytes`, the rest BF16."""
    replicated = expert_total = 0.0
    for name, shape in param_shapes(m).items():
        is_bf16 = len(shape) == 1 or name.endswith(BF16_NAMES)
        nbytes = math.prod(shape) * (BF16_BYTES if is_bf16 else weight_bytes)
        if ".experts." in name and ".shared_experts." not in name:
            expert_total += nbytes
        else:
            replicated += nbytes
    return ModelBytes(
        replicated=replicated,
        expert=expert_total / m.num_routed_experts,
        num_experts=m.num_routed_experts,
    )


@cache
def cost_shape_bytes(weight_bytes: int) -> ModelBytes:
    """`model_bytes` of DeepSeek-V3 (configs/model/deepseek_v3.yaml), once per precision."""
    return model_bytes(cost_shape(), weight_bytes)
