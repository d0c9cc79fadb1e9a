"""The tiny DeepSeek-style model: embedding, dense then MoE blocks, final norm, output head, MTP."""

from __future__ import annotations

import torch
from torch import nn

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.block import Block
from xds_mpi.model.layers import RMSNorm, Rotary, linear
from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.moe import NO_WIRE, Wire
from xds_mpi.model.mtp import MTPModule


class DeepSeekModel(nn.Module):
    """Cache layers: 0..num_layers-1 are the main blocks, num_layers + k - 1 is MTP depth k."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = Rotary(
            dim=cfg.qk_rope_dim, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta, dtype=dtype
        )
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(
            Block(cfg, self.rotary, is_moe=i >= cfg.num_dense_layers) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden)
        self.head = linear(cfg.hidden, cfg.vocab_size)
        self.mtp = nn.ModuleList(MTPModule(cfg, self.rotary) for _ in range(cfg.num_mtp_modules))
        self.to(dtype)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    def num_cache_layers(self, mtp_depth: int) -> int:
        return self.cfg.num_layers + mtp_depth

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        chunks: list[AttnChunk],
        cache: LatentCache,
        *,
        wire: Wire = NO_WIRE,
    ) -> torch.Tensor:
        """tokens, positions: [n] int64 -> [n, hidden] last block's output (before the final norm;
        the MTP module takes this as h^0)."""
        x = self.embed(tokens)
        for layer_idx, layer in enumerate(self.layers):
            x = layer(x, positions, chunks, cache, layer_idx, wire=wire)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> [n, vocab_size]"""
        return self.head(self.norm(hidden))

    def mtp_module(self, depth: int) -> MTPModule:
        """Depth k uses module k; deeper than the trained modules reuses the last one (as FlowServe
        first did for its second MTP step, xDeepServe §4.6)."""
        if not self.mtp:
            raise ValueError(f"MTP depth {depth} needs model.num_mtp_modules >= 1, got 0")
        return self.mtp[min(depth, len(self.mtp)) - 1]

    def moe_of(self, layer_idx: int):
        """The MoE of main layer `layer_idx`, or of MTP depth k at layer_idx = num_layers + k - 1
        (the cache layer numbering)."""
        if layer_idx < self.cfg.num_layers:
            return self.layers[layer_idx].ffn
        return self.mtp_module(layer_idx - self.cfg.num_layers + 1).block.ffn

    def mtp_forward(
        self,
        depth: int,
        prev_hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        chunks: list[AttnChunk],
        cache: LatentCache,
        *,
        wire: Wire = NO_WIRE,
    ) -> torch.Tensor:
        """prev_hidden: [n, hidden] h^{depth-1}_i, next_tokens: [n] t_{i+depth} -> [n, hidden]"""
        return self.mtp_module(depth)(
            prev_hidden,
            self.embed(next_tokens),
            positions,
            chunks,
            cache,
            self.cfg.num_layers + depth - 1,
            wire=wire,
        )

    def mtp_logits(self, depth: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] h^depth_i -> [n, vocab_size] predicting t_{i+depth+1}"""
        return self.head(self.mtp_module(depth).norm(hidden))
