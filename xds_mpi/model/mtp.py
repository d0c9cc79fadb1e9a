"""DeepSeek-V3 multi-token prediction module (DeepSeek-V3 report §2.2; xDeepServe §4.6).

Module k at position i combines the previous depth's hidden state h^{k-1}_i (the main model's
last-layer output for k = 1) with the embedding of token t_{i+k}:
    h'_i = W_proj [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]      (2 hidden -> hidden)
    h^k_i = Block(h'_i)                                            (one transformer block)
    logits = Head(RMSNorm_k(h^k_i))   -> predicts t_{i+k+1}
The embedding and output head are shared with the main model; each module has its own norms.
"""

from __future__ import annotations

import numpy as np

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.block import Block
from xds_mpi.model.layers import Linear, RMSNorm, Rotary
from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.moe import NO_WIRE, Wire


class MTPModule:
    def __init__(self, cfg: ModelConfig, rotary: Rotary, params: dict, prefix: str) -> None:
        self.hnorm = RMSNorm(params[prefix + "hnorm.weight"])
        self.enorm = RMSNorm(params[prefix + "enorm.weight"])
        self.eh_proj = Linear.of(params, prefix + "eh_proj.weight")
        # DeepSeek-V3's MTP block is an MoE layer like the main model's last layer.
        self.block = Block(cfg, rotary, params, prefix + "block.", is_moe=True)
        self.norm = RMSNorm(params[prefix + "norm.weight"])

    def __call__(
        self,
        prev_hidden: np.ndarray,
        next_embedding: np.ndarray,
        positions: np.ndarray,
        chunks: list[AttnChunk],
        cache: LatentCache,
        cache_layer_idx: int,
        *,
        wire: Wire = NO_WIRE,
    ) -> np.ndarray:
        """prev_hidden: [n, hidden] h^{k-1}_i, next_embedding: [n, hidden] Emb(t_{i+k}) -> h^k_i"""
        x = self.project(prev_hidden, next_embedding)
        return self.block(x, positions, chunks, cache, cache_layer_idx, wire=wire)

    def project(self, prev_hidden: np.ndarray, next_embedding: np.ndarray) -> np.ndarray:
        """The block's input h'_i: [n, hidden] (the distributed engine runs the block in pieces)."""
        return self.eh_proj(
            np.concatenate([self.hnorm(prev_hidden), self.enorm(next_embedding)], axis=-1)
        )
