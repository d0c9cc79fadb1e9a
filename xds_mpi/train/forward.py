"""The training forward: whole sequences at once, causal, through the torch twin's modules.

Inference (the numpy model) attends from a paged latent cache with W_UK absorbed into the query;
training has no cache, so attention takes MLA's un-absorbed form (keys and values expanded per
head from the same c_kv and k_rope) over the full sequence. Everything else is the same formula:
norms, projections, rotary, the dense FFN, and the MoE (DeepSeek-V3 sigmoid gate, the routed
experts, the shared expert, combine). tests/unit/xds_mpi/model/test_model_oracle.py checks the two
models agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from xds_mpi.train.torch_model import MLA, Block, DeepSeekModel


def causal_attention(attn: MLA, x: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, hidden] normalized rows at positions 0..seq-1 -> [batch, seq, hidden]"""
    batch, seq, _ = x.shape
    rows = x.reshape(batch * seq, -1)
    positions = torch.arange(seq).repeat(batch)  # [batch * seq]
    q_nope, q_rope = attn.project_q(rows, positions)  # [b*s, heads, nope], [b*s, heads, rope]
    c_kv, k_rope = attn.project_latent(rows, positions)  # [b*s, kv_lora_rank], [b*s, rope]
    k_nope, v = (
        attn.wkv_b(c_kv)
        .view(batch * seq, attn.num_heads, -1)
        .split([attn.qk_nope_dim, attn.v_head_dim], dim=-1)
    )
    k = torch.cat([k_nope, k_rope[:, None, :].expand(-1, attn.num_heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)

    def heads_first(t: torch.Tensor) -> torch.Tensor:  # [b*s, heads, d] -> [b, heads, s, d]
        return t.view(batch, seq, attn.num_heads, -1).transpose(1, 2)

    # The fused CPU kernel (about 1.6x faster here) wants values as wide as keys: pad with zeros,
    # which only adds output columns of zeros, and cut them off again.
    pad = q.shape[-1] - attn.v_head_dim
    o = F.scaled_dot_product_attention(
        heads_first(q),
        heads_first(k),
        heads_first(F.pad(v, (0, max(0, pad)))),
        is_causal=True,
        scale=attn.scale,
    )
    o = o[..., : attn.v_head_dim]  # [b, heads, s, v_head_dim]
    return attn.wo(o.transpose(1, 2).reshape(batch, seq, -1))


def block_forward(block: Block, x: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, hidden] residual stream -> [batch, seq, hidden]"""
    x = x + causal_attention(block.attn, block.attn_norm(x))
    return block.ffn_part(x.reshape(-1, x.shape[-1])).view(x.shape)


def main_hidden(model: DeepSeekModel, tokens: torch.Tensor) -> torch.Tensor:
    """tokens: [batch, seq] int64 -> [batch, seq, hidden] h^0 (last block, before the final norm)"""
    x = model.embed(tokens)
    for layer in model.layers:
        x = block_forward(layer, x)
    return x


def mtp_hidden(
    model: DeepSeekModel, depth: int, prev_hidden: torch.Tensor, next_tokens: torch.Tensor
) -> torch.Tensor:
    """prev_hidden: [batch, n, hidden] h^{depth-1}_i, next_tokens: [batch, n] t_{i+depth}
    -> [batch, n, hidden] h^depth_i, positions i = 0..n-1 as in the MTP cache layer."""
    module = model.mtp_module(depth)
    x = module.eh_proj(
        torch.cat([module.hnorm(prev_hidden), module.enorm(model.embed(next_tokens))], dim=-1)
    )
    return block_forward(module.block, x)


@dataclass(frozen=True, kw_only=True)
class SequenceLogits:
    """Teacher-forced logits of a batch of windows tokens [batch, seq]."""

    main: torch.Tensor  # [batch, seq, vocab]: row i predicts t_{i+1}
    mtp: list[torch.Tensor]  # depth k: [batch, seq - k, vocab], row i predicts t_{i+k+1}


def sequence_logits(
    model: DeepSeekModel, tokens: torch.Tensor, mtp_depth: int | None = None
) -> SequenceLogits:
    """tokens: [batch, seq] -> main and MTP logits (depth 1..mtp_depth, default: every module).

    MTP module k at position i combines h^{k-1}_i with Emb(t_{i+k}) (DeepSeek-V3 §2.2), so depth k
    covers positions 0..seq-k-1, one fewer than depth k-1.
    """
    mtp_depth = model.cfg.num_mtp_modules if mtp_depth is None else mtp_depth
    hidden = main_hidden(model, tokens)
    main = model.logits(hidden)
    mtp, seq = [], tokens.shape[1]
    for depth in range(1, mtp_depth + 1):
        hidden = mtp_hidden(model, depth, hidden[:, : seq - depth], tokens[:, depth:])
        mtp.append(model.mtp_logits(depth, hidden))
    return SequenceLogits(main=main, mtp=mtp)


@dataclass(frozen=True, kw_only=True)
class Losses:
    main: torch.Tensor  # [] mean cross-entropy of the next token (nats)
    mtp: list[torch.Tensor]  # depth k: [] mean cross-entropy of t_{i+k+1}
    total: torch.Tensor  # [] main + mtp_weight x mean(mtp)


def sequence_losses(model: DeepSeekModel, tokens: torch.Tensor, *, mtp_weight: float) -> Losses:
    """tokens: [batch, seq]; the last token is only ever a target. DeepSeek-V3's MTP objective:
    L = L_main + lambda / D x sum_k L_MTP^k."""
    out = sequence_logits(model, tokens[:, :-1])
    main = F.cross_entropy(out.main.flatten(0, 1), tokens[:, 1:].flatten())
    mtp = [
        F.cross_entropy(logits.flatten(0, 1), tokens[:, depth + 1 :].flatten())
        for depth, logits in enumerate(out.mtp, start=1)
    ]
    total = main + mtp_weight * torch.stack(mtp).mean() if mtp else main
    return Losses(main=main, mtp=mtp, total=total)
