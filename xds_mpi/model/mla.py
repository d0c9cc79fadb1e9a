"""Multi-head Latent Attention (DeepSeek-V2/V3) decoding from a paged latent KV cache.

Per token the cache keeps only the normalized KV LoRA vector c_kv [kv_lora_rank] and the decoupled
RoPE key k_rope [qk_rope_dim] shared by all heads. Decode never expands them to per-head keys and
values: the key up-projection W_UK is absorbed into the query (q_nope W_UK scores directly against
c_kv) and the value up-projection W_UV is applied once to the attention-weighted latent.
`naive_forward` is the un-absorbed textbook form, recomputed from scratch; tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.layers import Linear, RMSNorm, Rotary, matmul, projection, softmax


@dataclass(frozen=True, kw_only=True)
class AttnChunk:
    """One sequence's consecutive new rows inside a batched forward."""

    start_pos: int  # position of the chunk's first row
    num_tokens: int  # rows of this chunk, positions start_pos .. start_pos + num_tokens - 1
    slots: np.ndarray  # [start_pos + num_tokens] int64: cache slot of every position so far

    @property
    def write_slots(self) -> np.ndarray:
        return self.slots[self.start_pos :]


class LatentCache:
    """Latent KV arrays for every attention layer (main layers, then MTP modules), indexed by the
    slots a `kv_blocks.BlockTable` hands out."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: np.dtype,
    ) -> None:
        # One array, so that a chunk gathers its keys [c_kv | k_rope] with one index.
        self.keys = np.zeros((num_layers, num_slots, kv_lora_rank + rope_dim), dtype)
        self.latent = self.keys[..., :kv_lora_rank]  # views: [num_layers, num_slots, ...]
        self.rope_key = self.keys[..., kv_lora_rank:]

    def write(
        self, layer_idx: int, slots: np.ndarray, latent: np.ndarray, rope_key: np.ndarray
    ) -> None:
        """slots: [n] int64, latent: [n, kv_lora_rank], rope_key: [n, qk_rope_dim]"""
        self.latent[layer_idx, slots] = latent
        self.rope_key[layer_idx, slots] = rope_key

    def layer(self, layer_idx: int) -> tuple[np.ndarray, np.ndarray]:
        """One layer's (latent [num_slots, kv_lora_rank], rope_key [num_slots, qk_rope_dim])."""
        return self.latent[layer_idx], self.rope_key[layer_idx]


class MLA:
    """Absorbed MLA: W_UK folded into the query projection, W_UV into the output projection, so a
    row's query is [q_latent | q_rope] scored against the cache's [c_kv | k_rope] directly.

    With an INT8 checkpoint (xDeepServe §4.7: Wq_a, Wkv_a, Wq_b and Wo quantized) W_UK and W_UV
    cannot be folded into INT8 weights: Wq_b and Wo run as INT8 projections, and W_UK / W_UV as
    float per-head products after / before them, as a quantized MLA operator does.
    """

    def __init__(self, cfg: ModelConfig, rotary: Rotary, params: dict, prefix: str) -> None:
        heads, nope, rope = cfg.num_heads, cfg.qk_nope_dim, cfg.qk_rope_dim
        self.num_heads, self.qk_nope_dim, self.qk_rope_dim = heads, nope, rope
        self.v_head_dim, self.kv_lora_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.rotary = rotary
        self.scale = (nope + rope) ** -0.5
        self.wq_a = projection(params, prefix + "wq_a.weight")
        self.q_norm = RMSNorm(params[prefix + "q_norm.weight"])
        self.wq_b = projection(params, prefix + "wq_b.weight")
        self.wkv_a = projection(params, prefix + "wkv_a.weight")
        self.kv_norm = RMSNorm(params[prefix + "kv_norm.weight"])
        self.wkv_b = Linear.of(params, prefix + "wkv_b.weight")
        self.wo = projection(params, prefix + "wo.weight")
        w_uk, w_uv = self.up_projections()
        self.wq_absorbed = self.wo_absorbed = None
        if isinstance(self.wq_b, Linear):
            wq = self.wq_b.weight.reshape(heads, nope + rope, -1)  # [heads, nope + rope, q_lora]
            # [q_lora, heads, c + rope]: per head, q_nope W_UK's columns, then q_rope's.
            self.wq_absorbed = np.ascontiguousarray(
                np.concatenate(
                    [
                        np.einsum("hdq,hdc->qhc", wq[:, :nope], w_uk),
                        wq[:, nope:].transpose(2, 0, 1),
                    ],
                    axis=-1,
                ).reshape(wq.shape[-1], -1)
            )
        if isinstance(self.wo, Linear):
            wo = self.wo.weight.reshape(-1, heads, self.v_head_dim)  # [hidden, heads, v]
            # [heads x c, hidden]: o_latent W_UV^T, then wo, as one product.
            self.wo_absorbed = np.einsum("hvc,dhv->hcd", w_uv, wo).reshape(-1, wo.shape[0])
        # Per head, contiguous for the INT8 path: W_UK [nope, c] and W_UV^T [c, v].
        self.w_uk = [np.ascontiguousarray(w) for w in w_uk]
        self.w_uv_t = [np.ascontiguousarray(w.T) for w in w_uv]

    def use_projections(self) -> None:
        """Run Wq_b and Wo as projections of their own, not folded with W_UK / W_UV (what
        the INT8 path does; calibration records their inputs this way)."""
        self.wq_absorbed = self.wo_absorbed = None

    def project_q(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x: [n, hidden] -> [n, heads, kv_lora_rank + qk_rope_dim]: q_nope W_UK, rotated q_rope"""
        q_lora = self.q_norm(self.wq_a(x))
        if self.wq_absorbed is not None:
            q = matmul(q_lora, self.wq_absorbed)
            q = q.reshape(x.shape[0], self.num_heads, q.shape[1] // self.num_heads)  # 0 rows too
        else:
            q_heads = self.wq_b(q_lora).reshape(x.shape[0], self.num_heads, -1)
            q_nope = q_heads[..., : self.qk_nope_dim]  # [n, heads, nope]
            q_latent = np.stack(
                [matmul(q_nope[:, h], w) for h, w in enumerate(self.w_uk)], axis=1
            )  # [n, heads, c]
            q = np.concatenate([q_latent, q_heads[..., self.qk_nope_dim :]], axis=-1)
        q[..., self.kv_lora_rank :] = self.rotary(q[..., self.kv_lora_rank :], positions)
        return q

    def project_out(self, o_latent: np.ndarray) -> np.ndarray:
        """o_latent: [n, heads, kv_lora_rank] attention-weighted latents -> [n, hidden]"""
        num_rows = o_latent.shape[0]
        if self.wo_absorbed is not None:
            return matmul(o_latent.reshape(num_rows, -1), self.wo_absorbed)
        o = np.stack(
            [matmul(o_latent[:, h], w) for h, w in enumerate(self.w_uv_t)], axis=1
        )  # [n, heads, v]
        return self.wo(o.reshape(num_rows, -1))

    def project_latent(self, x: np.ndarray, positions: np.ndarray):
        """x: [n, hidden] -> what the cache keeps: (c_kv [n, kv_lora_rank], k_rope [n, rope])"""
        kv = self.wkv_a(x)
        c_kv, k_rope = kv[:, : self.kv_lora_rank], kv[:, self.kv_lora_rank :]
        return self.kv_norm(c_kv), self.rotary(k_rope, positions)

    def up_projections(self) -> tuple[np.ndarray, np.ndarray]:
        """(W_UK [heads, qk_nope_dim, kv_lora_rank], W_UV [heads, v_head_dim, kv_lora_rank])"""
        w = self.wkv_b.weight.reshape(self.num_heads, self.qk_nope_dim + self.v_head_dim, -1)
        return w[:, : self.qk_nope_dim], w[:, self.qk_nope_dim :]

    def __call__(
        self,
        x: np.ndarray,
        positions: np.ndarray,
        chunks: list[AttnChunk],
        cache: LatentCache,
        layer_idx: int,
    ) -> np.ndarray:
        """x: [n, hidden] rows of all chunks in order, positions: [n] -> [n, hidden].

        Writes the rows' latents into `cache` layer `layer_idx`, then each row attends causally
        to its own sequence's cached positions.
        """
        q = self.project_q(x, positions)  # [n, heads, c + rope]
        c_kv, k_rope = self.project_latent(x, positions)
        slots = [c.write_slots for c in chunks]
        cache.write(layer_idx, slots[0] if len(slots) == 1 else np.concatenate(slots), c_kv, k_rope)
        keys = cache.keys[layer_idx]  # [num_slots, c + rope]
        num_heads, lora = self.num_heads, self.kv_lora_rank
        o_latent = np.empty((x.shape[0], num_heads, lora), x.dtype)
        row = 0
        for chunk in chunks:
            num = chunk.num_tokens
            cached = keys[chunk.slots]  # [t, c + rope]
            scores = matmul(q[row : row + num].reshape(num * num_heads, -1), cached.T)
            scores = scores.reshape(num, num_heads, -1) * self.scale  # [rows, heads, t]
            if num > 1:  # a single new row sees no future position
                scores = np.where(_future_mask(chunk.start_pos, num), -np.inf, scores)
            probs = softmax(scores).reshape(num * num_heads, -1)
            o_latent[row : row + num] = matmul(probs, cached[:, :lora]).reshape(num, num_heads, -1)
            row += num
        return self.project_out(o_latent)

    def naive_forward(self, x: np.ndarray) -> np.ndarray:
        """Un-absorbed MLA over one whole sequence x: [t, hidden] at positions 0..t-1 ->
        [t, hidden]; keys and values expanded per head, no cache."""
        num_tokens, heads, nope = x.shape[0], self.num_heads, self.qk_nope_dim
        positions = np.arange(num_tokens)
        q = self.wq_b(self.q_norm(self.wq_a(x))).reshape(num_tokens, heads, -1)
        q = np.concatenate([q[..., :nope], self.rotary(q[..., nope:], positions)], axis=-1)
        c_kv, k_rope = self.project_latent(x, positions)
        kv = self.wkv_b(c_kv).reshape(num_tokens, heads, -1)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k_rope = np.broadcast_to(k_rope[:, None, :], (num_tokens, heads, k_rope.shape[-1]))
        k = np.concatenate([k_nope, k_rope], axis=-1)
        scores = np.einsum("thd,shd->ths", q, k) * self.scale
        scores = np.where(_future_mask(0, num_tokens), -np.inf, scores)
        o = np.einsum("ths,shv->thv", softmax(scores), v)
        return self.wo(o.reshape(num_tokens, -1))


def _future_mask(start_pos: int, num_tokens: int) -> np.ndarray:
    """[num_tokens, 1, start_pos + num_tokens] bool: True where the key lies after the query."""
    query_pos = np.arange(start_pos, start_pos + num_tokens)[:, None, None]
    key_pos = np.arange(start_pos + num_tokens)[None, None, :]
    return key_pos > query_pos
