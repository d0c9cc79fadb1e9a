"""DeepSeek-V3 multi-token prediction module (DeepSeek-V3 report §2.2; xDeepServe §4.6).

Module k at position i combines the previous depth's hidden state h^{k-1}_i (the main model's
last-layer output for k = 1) with the embedding of token t_{i+k}:
    h'_i = W_proj [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]      (2 hidden -> hidden)
    h^k_i = Block(h'_i)                                            (one transformer block)
    logits = Head(RMSNorm_k(h^k_i))   -> predicts t_{i+k+1}
The embedding and output head are shared with the main model; each module has its own norms.
"""

from __future__ import annotations

import torch
from torch import nn

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.block import Block
from xds_mpi.model.layers import RMSNorm, Rotary, linear
from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.moe import NO_WIRE, Wire


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary) -> None:
        super().__init__()
        self.hnorm = RMSNorm(cfg.hidden)
        self.enorm = RMSNorm(cfg.hidden)
        self.eh_proj = linear(2 * cfg.hidden, cfg.hidden)
        # DeepSeek-V3's MTP block is an MoE layer like the main model's last layer.
        self.block = Block(cfg, rotary, is_moe=True)
        self.norm = RMSNorm(cfg.hidden)

    def forward(
        self,
        prev_hidden: torch.Tensor,
        next_embedding: torch.Tensor,
        positions: torch.Tensor,
        chunks: list[AttnChunk],
        cache: LatentCache,
        cache_layer_idx: int,
        *,
        wire: Wire = NO_WIRE,
    ) -> torch.Tensor:
        """prev_hidden: [n, hidden] h^{k-1}_i, next_embedding: [n, hidden] Emb(t_{i+k}) -> h^k_i"""
        x = self.project(prev_hidden, next_embedding)
        return self.block(x, positions, chunks, cache, cache_layer_idx, wire=wire)

    def project(self, prev_hidden: torch.Tensor, next_embedding: torch.Tensor) -> torch.Tensor:
        """The block's input h'_i: [n, hidden] (the distributed engine runs the block in pieces)."""
        return self.eh_proj(
            torch.cat([self.hnorm(prev_hidden), self.enorm(next_embedding)], dim=-1)
        )
