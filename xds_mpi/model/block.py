"""One transformer block: pre-norm MLA, then a pre-norm dense SwiGLU FFN or MoE, each residual.

The distributed engine calls `attention_part` on the attention die, then the FFN in pieces
(`ffn_norm`, then the MoE's gate / experts / combine), then adds the residual itself.
"""

from __future__ import annotations

import numpy as np

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.layers import RMSNorm, Rotary, SwiGLU
from xds_mpi.model.mla import MLA, AttnChunk, LatentCache
from xds_mpi.model.moe import NO_WIRE, MoE, Wire


class Block:
    def __init__(
        self, cfg: ModelConfig, rotary: Rotary, params: dict, prefix: str, *, is_moe: bool
    ) -> None:
        self.is_moe = is_moe
        self.attn_norm = RMSNorm(params[prefix + "attn_norm.weight"])
        self.attn = MLA(cfg, rotary, params, prefix + "attn.")
        self.ffn_norm = RMSNorm(params[prefix + "ffn_norm.weight"])
        self.ffn = MoE(cfg, params, prefix + "ffn.") if is_moe else SwiGLU(params, prefix + "ffn.")

    def attention_part(
        self,
        x: np.ndarray,
        positions: np.ndarray,
        chunks: list[AttnChunk],
        cache: LatentCache,
        cache_layer_idx: int,
    ) -> np.ndarray:
        """x: [n, hidden] residual stream -> [n, hidden] after the attention residual."""
        return x + self.attn(self.attn_norm(x), positions, chunks, cache, cache_layer_idx)

    def ffn_part(self, x: np.ndarray, *, wire: Wire = NO_WIRE) -> np.ndarray:
        """x: [n, hidden] residual stream -> [n, hidden] after the FFN / MoE residual."""
        h = self.ffn_norm(x)
        return x + (self.ffn(h, wire=wire) if self.is_moe else self.ffn(h))

    def __call__(
        self,
        x: np.ndarray,
        positions: np.ndarray,
        chunks: list[AttnChunk],
        cache: LatentCache,
        cache_layer_idx: int,
        *,
        wire: Wire = NO_WIRE,
    ) -> np.ndarray:
        x = self.attention_part(x, positions, chunks, cache, cache_layer_idx)
        return self.ffn_part(x, wire=wire)
