"""One transformer block: pre-norm MLA, then a pre-norm dense SwiGLU FFN or MoE, each residual.

The distributed engine calls `attention_part` on the attention die, then the FFN in pieces
(`ffn_norm`, then the MoE's gate / experts / combine), then adds the residual itself.
"""

from __future__ import annotations

import torch
from torch import nn

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.layers import RMSNorm, Rotary, SwiGLU
from xds_mpi.model.mla import MLA, AttnChunk, LatentCache
from xds_mpi.model.moe import NO_WIRE, MoE, Wire


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, *, is_moe: bool) -> None:
        super().__init__()
        self.is_moe = is_moe
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = MLA(cfg, rotary)
        self.ffn_norm = RMSNorm(cfg.hidden)
        self.ffn = MoE(cfg) if is_moe else SwiGLU(cfg.hidden, cfg.intermediate)

    def attention_part(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        chunks: list[AttnChunk],
        cache: LatentCache,
        cache_layer_idx: int,
    ) -> torch.Tensor:
        """x: [n, hidden] residual stream -> [n, hidden] after the attention residual."""
        return x + self.attn(self.attn_norm(x), positions, chunks, cache, cache_layer_idx)

    def ffn_part(self, x: torch.Tensor, *, wire: Wire = NO_WIRE) -> torch.Tensor:
        """x: [n, hidden] residual stream -> [n, hidden] after the FFN / MoE residual."""
        h = self.ffn_norm(x)
        return x + (self.ffn(h, wire=wire) if self.is_moe else self.ffn(h))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        chunks: list[AttnChunk],
        cache: LatentCache,
        cache_layer_idx: int,
        *,
        wire: Wire = NO_WIRE,
    ):
        x = self.attention_part(x, positions, chunks, cache, cache_layer_idx)
        return self.ffn_part(x, wire=wire)
