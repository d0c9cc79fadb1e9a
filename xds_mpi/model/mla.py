"""Multi-head Latent Attention (DeepSeek-V2/V3) decoding from a paged latent KV cache.

Per token the cache keeps only the normalized KV LoRA vector c_kv [kv_lora_rank] and the decoupled
RoPE key k_rope [qk_rope_dim] shared by all heads. Decode never expands them to per-head keys and
values: the key up-projection W_UK is absorbed into the query (q_nope W_UK scores directly against
c_kv) and the value up-projection W_UV is applied once to the attention-weighted latent.
`naive_forward` is the un-absorbed textbook form, recomputed from scratch; tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.layers import RMSNorm, Rotary, linear


@dataclass(frozen=True, kw_only=True)
class AttnChunk:
    """One sequence's consecutive new rows inside a batched forward."""

    start_pos: int  # position of the chunk's first row
    num_tokens: int  # rows of this chunk, positions start_pos .. start_pos + num_tokens - 1
    slots: torch.Tensor  # [start_pos + num_tokens] int64: cache slot of every position so far

    @property
    def write_slots(self) -> torch.Tensor:
        return self.slots[self.start_pos :]


class LatentCache:
    """Latent KV tensors for every attention layer (main layers, then MTP modules), indexed by the
    slots a `kv_blocks.BlockTable` hands out."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.latent = torch.zeros(num_layers, num_slots, kv_lora_rank, dtype=dtype)
        self.rope_key = torch.zeros(num_layers, num_slots, rope_dim, dtype=dtype)

    def write(
        self, layer_idx: int, slots: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor
    ) -> None:
        """slots: [n] int64, latent: [n, kv_lora_rank], rope_key: [n, qk_rope_dim]"""
        self.latent[layer_idx, slots] = latent
        self.rope_key[layer_idx, slots] = rope_key

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's (latent [num_slots, kv_lora_rank], rope_key [num_slots, qk_rope_dim])."""
        return self.latent[layer_idx], self.rope_key[layer_idx]


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qk_nope_dim, self.qk_rope_dim = cfg.qk_nope_dim, cfg.qk_rope_dim
        self.v_head_dim, self.kv_lora_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.rotary = rotary
        self.scale = (cfg.qk_nope_dim + cfg.qk_rope_dim) ** -0.5
        qk_head_dim = cfg.qk_nope_dim + cfg.qk_rope_dim
        self.wq_a = linear(cfg.hidden, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank)
        self.wq_b = linear(cfg.q_lora_rank, cfg.num_heads * qk_head_dim)
        self.wkv_a = linear(cfg.hidden, cfg.kv_lora_rank + cfg.qk_rope_dim)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank)
        self.wkv_b = linear(cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_dim + cfg.v_head_dim))
        self.wo = linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden)

    def project_q(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [n, hidden] -> (q_nope [n, heads, qk_nope_dim], q_rope [n, heads, qk_rope_dim])"""
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(x.shape[0], self.num_heads, -1)
        q_nope, q_rope = q.split([self.qk_nope_dim, self.qk_rope_dim], dim=-1)
        return q_nope, self.rotary(q_rope, positions)

    def project_latent(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [n, hidden] -> what the cache keeps: (c_kv [n, kv_lora_rank], k_rope [n, rope])"""
        c_kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_dim], dim=-1)
        return self.kv_norm(c_kv), self.rotary(k_rope, positions)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, qk_nope_dim, kv_lora_rank], W_UV [heads, v_head_dim, kv_lora_rank])"""
        w = self.wkv_b.weight.view(self.num_heads, self.qk_nope_dim + self.v_head_dim, -1)
        return w[:, : self.qk_nope_dim], w[:, self.qk_nope_dim :]

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        chunks: list[AttnChunk],
        cache: LatentCache,
        layer_idx: int,
    ) -> torch.Tensor:
        """x: [n, hidden] rows of all chunks in order, positions: [n] -> [n, hidden].

        Writes the rows' latents into `cache` layer `layer_idx`, then each row attends causally
        to its own sequence's cached positions.
        """
        q_nope, q_rope = self.project_q(x, positions)
        c_kv, k_rope = self.project_latent(x, positions)
        cache.write(layer_idx, torch.cat([c.write_slots for c in chunks]), c_kv, k_rope)
        w_uk, w_uv = self.up_projections()
        # The products are the batched matmuls einsum itself makes ("nhd,hdc->nhc" and so on),
        # called directly: the same numbers (tests/test_model_mla.py) for a third of the time.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, heads, c]
        latent, rope_key = cache.layer(layer_idx)
        outputs, row = [], 0
        for chunk in chunks:
            rows = slice(row, row + chunk.num_tokens)
            cached_c_kv = latent[chunk.slots]  # [t, kv_lora_rank]
            cached_k_rope = rope_key[chunk.slots]  # [t, qk_rope_dim]
            scores = (
                _heads_by(q_latent[rows], cached_c_kv.T) + _heads_by(q_rope[rows], cached_k_rope.T)
            ) * self.scale  # [rows, heads, t]
            if chunk.num_tokens > 1:  # a single new row sees no future position
                scores = scores.masked_fill(
                    _future_mask(chunk.start_pos, chunk.num_tokens), -torch.inf
                )
            outputs.append(_heads_by(scores.softmax(-1), cached_c_kv))  # [rows, heads, c]
            row += chunk.num_tokens
        o = torch.bmm(torch.cat(outputs).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return self.wo(o.reshape(x.shape[0], -1))  # o: [n, heads, v_head_dim]

    def naive_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Un-absorbed MLA over one whole sequence x: [t, hidden] at positions 0..t-1 ->
        [t, hidden]; keys and values expanded per head, no cache."""
        num_tokens = x.shape[0]
        positions = torch.arange(num_tokens)
        q_nope, q_rope = self.project_q(x, positions)
        c_kv, k_rope = self.project_latent(x, positions)
        kv = self.wkv_b(c_kv).view(num_tokens, self.num_heads, -1)
        k_nope, v = kv.split([self.qk_nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)  # [t, heads, qk_head_dim]
        scores = torch.einsum("thd,shd->ths", q, k) * self.scale
        scores = scores.masked_fill(_future_mask(0, num_tokens), -torch.inf)
        o = torch.einsum("ths,shv->thv", scores.softmax(-1), v)
        return self.wo(o.reshape(num_tokens, -1))


def _heads_by(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a: [rows, heads, k] times b: [k, m] -> [rows, heads, m], as one batch of one matmul."""
    return torch.bmm(a.reshape(1, -1, a.shape[-1]), b[None]).view(a.shape[0], a.shape[1], -1)


def _future_mask(start_pos: int, num_tokens: int) -> torch.Tensor:
    """[num_tokens, 1, start_pos + num_tokens] bool: True where the key lies after the query."""
    query_pos = torch.arange(start_pos, start_pos + num_tokens)[:, None, None]
    key_pos = torch.arange(start_pos + num_tokens)[None, None, :]
    return key_pos > query_pos
