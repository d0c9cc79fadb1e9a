"""What a die must hold (weights, KV for the workload's lengths, a reserve for windows and
workspace) at the cost shape, against its HBM; the reason when it does not fit.

Weights are INT8 (the profile's serving.weight_bytes, [001] §4), the latent KV BF16 or INT8
(xds_mpi/plan/kv_memory.py); the reserve is an assumption (docs/planning.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from xds_mpi.config.schema import ModelConfig
from xds_mpi.plan.kv_memory import token_layer_bytes

RESERVE_BYTES = 4e9  # assumption: XCCL windows, activations and workspace per die


@dataclass(frozen=True, kw_only=True)
class ModelBytes:
    """Per-die parameter counts of the cost shape, split by where they live."""

    attention: float  # MLA of every layer, embedding, head, MTP module, gates
    dense_ffn: float  # the dense layers' FFNs
    expert: float  # one routed (or shared) expert over every MoE layer
    kv_token_bf16: float  # one token's latent KV over every cache layer
    kv_token_int8: float

    @classmethod
    def of(cls, m: ModelConfig) -> ModelBytes:
        h, heads = m.hidden, m.num_heads
        mla = (
            h * m.q_lora_rank
            + m.q_lora_rank * heads * (m.qk_nope_dim + m.qk_rope_dim)
            + h * (m.kv_lora_rank + m.qk_rope_dim)
            + m.kv_lora_rank * heads * (m.qk_nope_dim + m.v_head_dim)
            + heads * m.v_head_dim * h
        )
        num_moe = m.num_layers - m.num_dense_layers
        layers = m.num_layers + m.num_mtp_modules
        gates = h * m.num_routed_experts * num_moe
        mtp = m.num_mtp_modules * 2 * h * h  # eh_proj
        cache_layers = m.num_layers + m.num_mtp_modules
        return cls(
            attention=mla * layers + 2 * m.vocab_size * h + gates + mtp,
            dense_ffn=3 * h * m.intermediate * m.num_dense_layers,
            expert=3 * h * m.moe_intermediate * (num_moe + m.num_mtp_modules),
            kv_token_bf16=cache_layers * token_layer_bytes(m, itemsize=2, kv_int8=False),
            kv_token_int8=cache_layers * token_layer_bytes(m, itemsize=2, kv_int8=True),
        )


@dataclass(frozen=True, kw_only=True)
class DieMemory:
    """One die's bytes: weights, KV, the reserve; hbm the die's capacity."""

    role: str
    weights: float
    kv: float
    hbm: float

    @property
    def total(self) -> float:
        return self.weights + self.kv + RESERVE_BYTES

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm

    def why_not(self) -> str:
        gb = 1e9
        return (
            f"{self.role} die memory: weights {self.weights / gb:.1f} GB + KV {self.kv / gb:.1f}"
            f" GB + reserve {RESERVE_BYTES / gb:.0f} GB = {self.total / gb:.1f} GB > HBM "
            f"{self.hbm / gb:.0f} GB"
        )


def die_memory(
    mb: ModelBytes,
    *,
    role: str,
    hbm: float,
    weight_bytes: float,
    has_attention: bool,
    experts: float,
    kv_tokens: float,
    kv_int8: bool,
) -> DieMemory:
    """experts: expert slots on the die (routed + shared + redundant); kv_tokens: tokens of
    latent KV it holds (batch x context)."""
    params = experts * mb.expert + (mb.attention + mb.dense_ffn if has_attention else 0.0)
    per_token = mb.kv_token_int8 if kv_int8 else mb.kv_token_bf16
    return DieMemory(role=role, weights=params * weight_bytes, kv=kv_tokens * per_token, hbm=hbm)


def experts_per_die(num_experts: int, num_dies: int) -> int:
    return math.ceil(num_experts / num_dies)
