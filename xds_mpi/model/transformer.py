"""The tiny DeepSeek-style model: embedding, dense then MoE blocks, final norm, output head, MTP.

Plain numpy arrays named as the checkpoint names them (`param_shapes`); the dies and the
single-process reference run this one model, so their tokens agree bit for bit.

One transformer block: pre-norm MLA, then a pre-norm dense SwiGLU FFN or MoE, each residual.

The distributed engine calls `attention_part` on the attention die, then the FFN in pieces
(`ffn_norm`, then the MoE's gate / experts / combine), then adds the residual itself.

DeepSeek-V3 multi-token prediction module (DeepSeek-V3 report §2.2; xDeepServe §4.6).

Module k at position i combines the previous depth's hidden state h^{k-1}_i (the main model's
last-layer output for k = 1) with the embedding of token t_{i+k}:
    h'_i = W_proj [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]      (2 hidden -> hidden)
    h^k_i = Block(h'_i)                                            (one transformer block)
    logits = Head(RMSNorm_k(h^k_i))   -> predicts t_{i+k+1}
The embedding and output head are shared with the main model; each module has its own norms."""

from __future__ import annotations

import numpy as np

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.layers import Linear, RMSNorm, Rotary, SwiGLU
from xds_mpi.model.mla import MLA, AttnChunk, LatentCache
from xds_mpi.model.moe import NO_WIRE, MoE, Wire
from xds_mpi.model.params import LazyParams


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape (the checkpoint's names; [out, in] for a projection)."""
    hidden, heads = cfg.hidden, cfg.num_heads

    def swiglu(prefix: str, inner: int) -> dict:
        return {
            f"{prefix}w1.weight": (inner, hidden),
            f"{prefix}w3.weight": (inner, hidden),
            f"{prefix}w2.weight": (hidden, inner),
        }

    def block(prefix: str, is_moe: bool) -> dict:
        attn = f"{prefix}attn."
        shapes = {
            f"{prefix}attn_norm.weight": (hidden,),
            f"{attn}wq_a.weight": (cfg.q_lora_rank, hidden),
            f"{attn}q_norm.weight": (cfg.q_lora_rank,),
            f"{attn}wq_b.weight": (heads * (cfg.qk_nope_dim + cfg.qk_rope_dim), cfg.q_lora_rank),
            f"{attn}wkv_a.weight": (cfg.kv_lora_rank + cfg.qk_rope_dim, hidden),
            f"{attn}kv_norm.weight": (cfg.kv_lora_rank,),
            f"{attn}wkv_b.weight": (heads * (cfg.qk_nope_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            f"{attn}wo.weight": (hidden, heads * cfg.v_head_dim),
            f"{prefix}ffn_norm.weight": (hidden,),
        }
        if not is_moe:
            return shapes | swiglu(f"{prefix}ffn.", cfg.intermediate)
        shapes[f"{prefix}ffn.gate.weight"] = (cfg.num_routed_experts, hidden)
        shapes[f"{prefix}ffn.gate.bias"] = (cfg.num_routed_experts,)
        for e in range(cfg.num_routed_experts):
            shapes |= swiglu(f"{prefix}ffn.experts.{e}.", cfg.moe_intermediate)
        for e in range(cfg.num_shared_experts):
            shapes |= swiglu(f"{prefix}ffn.shared_experts.{e}.", cfg.moe_intermediate)
        return shapes

    shapes = {"embed.weight": (cfg.vocab_size, hidden)}
    for i in range(cfg.num_layers):
        shapes |= block(f"layers.{i}.", i >= cfg.num_dense_layers)
    shapes |= {"norm.weight": (hidden,), "head.weight": (cfg.vocab_size, hidden)}
    for k in range(cfg.num_mtp_modules):
        shapes |= {
            f"mtp.{k}.hnorm.weight": (hidden,),
            f"mtp.{k}.enorm.weight": (hidden,),
            f"mtp.{k}.eh_proj.weight": (hidden, 2 * hidden),
            f"mtp.{k}.norm.weight": (hidden,),
        }
        shapes |= block(f"mtp.{k}.block.", True)
    return shapes


class DeepSeekModel:
    """Cache layers: 0..num_layers-1 are the main blocks, num_layers + k - 1 is MTP depth k."""

    def __init__(
        self, cfg: ModelConfig, params: dict[str, np.ndarray], *, dtype=np.float64
    ) -> None:
        """params: every name of `param_shapes(cfg)` -> its array: a LazyParams (made when first
        used, in `dtype`), or plain arrays (cast to `dtype` as they are used)."""
        self.cfg, self.dtype = cfg, np.dtype(dtype)
        if not isinstance(params, LazyParams):
            params = LazyParams.of_arrays(params, self.dtype)
        self.params = params
        self.rotary = Rotary(
            dim=cfg.qk_rope_dim, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta, dtype=dtype
        )
        self.embed_weight = params["embed.weight"]  # [vocab_size, hidden]
        self.layers = [
            Block(cfg, self.rotary, params, f"layers.{i}.", is_moe=i >= cfg.num_dense_layers)
            for i in range(cfg.num_layers)
        ]
        self.norm = RMSNorm(params["norm.weight"])
        self.head = Linear.of(params, "head.weight")
        self.mtp = [
            MTPModule(cfg, self.rotary, params, f"mtp.{k}.") for k in range(cfg.num_mtp_modules)
        ]

    def state_dict(self) -> dict[str, np.ndarray]:
        return dict(self.params)

    def num_cache_layers(self, mtp_depth: int) -> int:
        return self.cfg.num_layers + mtp_depth

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """tokens: [n] int64 -> [n, hidden]"""
        return self.embed_weight[tokens]

    def __call__(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        chunks: list[AttnChunk],
        cache: LatentCache,
        *,
        wire: Wire = NO_WIRE,
    ) -> np.ndarray:
        """tokens, positions: [n] int64 -> [n, hidden] last block's output (before the final norm;
        the MTP module takes this as h^0)."""
        x = self.embed(tokens)
        for layer_idx, layer in enumerate(self.layers):
            x = layer(x, positions, chunks, cache, layer_idx, wire=wire)
        return x

    def logits(self, hidden: np.ndarray) -> np.ndarray:
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
        prev_hidden: np.ndarray,
        next_tokens: np.ndarray,
        positions: np.ndarray,
        chunks: list[AttnChunk],
        cache: LatentCache,
        *,
        wire: Wire = NO_WIRE,
    ) -> np.ndarray:
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

    def mtp_logits(self, depth: int, hidden: np.ndarray) -> np.ndarray:
        """hidden: [n, hidden] h^depth_i -> [n, vocab_size] predicting t_{i+depth+1}"""
        return self.head(self.mtp_module(depth).norm(hidden))


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
