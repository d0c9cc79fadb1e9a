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

from xccl.quant import dequantize_int8, quantize_int8
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
    slots a `kv_blocks.BlockTable` hands out.

    latent_int8 (xDeepServe §4.7): the non-RoPE part c_kv is kept as INT8 with one float32 scale
    per token and layer (xccl/quant.py's per-token quantizer: max|c_kv| / 127, round half to
    even), quantized when the token is written, so every reader (decode, a PD transfer's receiver)
    sees the same values; the RoPE key stays in the compute dtype.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: np.dtype,
        latent_int8: bool = False,
    ) -> None:
        self.latent_int8, self.kv_lora_rank = latent_int8, kv_lora_rank
        if latent_int8:
            self.latent = np.zeros((num_layers, num_slots, kv_lora_rank), np.int8)
            self.latent_scale = np.ones((num_layers, num_slots), np.float32)
            self.rope_key = np.zeros((num_layers, num_slots, rope_dim), dtype)
            self.keys = None
        else:
            # One array, so that a chunk gathers its keys [c_kv | k_rope] with one index.
            self.keys = np.zeros((num_layers, num_slots, kv_lora_rank + rope_dim), dtype)
            self.latent = self.keys[..., :kv_lora_rank]  # views: [num_layers, num_slots, ...]
            self.rope_key = self.keys[..., kv_lora_rank:]
            self.latent_scale = None

    @property
    def token_nbytes(self) -> int:
        """Bytes one token's KV takes over every layer: latent (+ its scale) and RoPE key."""
        num_layers, _, rope = self.rope_key.shape
        latent = self.kv_lora_rank * self.latent.itemsize + (4 if self.latent_int8 else 0)
        return num_layers * (latent + rope * self.rope_key.itemsize)

    def write(
        self, layer_idx: int, slots: np.ndarray, latent: np.ndarray, rope_key: np.ndarray
    ) -> None:
        """slots: [n] int64, latent: [n, kv_lora_rank], rope_key: [n, qk_rope_dim]"""
        if self.latent_int8:
            q, scale = quantize_int8(latent)
            self.latent[layer_idx, slots], self.latent_scale[layer_idx, slots] = q, scale
        else:
            self.latent[layer_idx, slots] = latent
        self.rope_key[layer_idx, slots] = rope_key

    def gather(self, layer_idx: int, slots: np.ndarray) -> np.ndarray:
        """slots: [t] int64 -> [t, kv_lora_rank + rope_dim] keys [c_kv | k_rope] (c_kv is also
        the value), in the compute dtype."""
        if not self.latent_int8:
            return self.keys[layer_idx][slots]
        dtype = self.rope_key.dtype
        latent = dequantize_int8(
            self.latent[layer_idx, slots], self.latent_scale[layer_idx, slots], dtype
        )
        return np.concatenate([latent, self.rope_key[layer_idx, slots]], axis=-1)

    def pack(self, slots: np.ndarray) -> list[np.ndarray]:
        """The slots' KV over every layer as byte arrays (copies; a PD transfer's message)."""
        parts = [self.latent[:, slots], self.rope_key[:, slots]]
        if self.latent_int8:
            parts.insert(1, self.latent_scale[:, slots])
        return [np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in parts]

    def unpack(self, slots: np.ndarray, buf: np.ndarray) -> int:
        """Write `pack`'s bytes (another cache's, same shape) into `slots`; bytes consumed."""
        at = 0
        arrays = [self.latent, self.rope_key]
        if self.latent_int8:
            arrays.insert(1, self.latent_scale)
        for array in arrays:
            shape = (array.shape[0], len(slots), *array.shape[2:])
            nbytes = int(np.prod(shape)) * array.itemsize
            array[:, slots] = buf[at : at + nbytes].view(array.dtype).reshape(shape)
            at += nbytes
        return at


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

    def project_q(
        self, x: np.ndarray, positions: np.ndarray, heads: slice | None = None
    ) -> np.ndarray:
        """x: [n, hidden] -> [n, h, kv_lora_rank + qk_rope_dim]: q_nope W_UK, rotated q_rope, of
        the heads `heads` (all by default)."""
        return self.q_up(self.q_down(x), positions, heads)

    def q_down(self, x: np.ndarray) -> np.ndarray:
        """x: [n, hidden] -> the normalized query latent [n, q_lora_rank] (stage 1 of a prefill
        TP group, on its rows)."""
        return self.q_norm(self.wq_a(x))

    def q_up(self, q_lora: np.ndarray, positions: np.ndarray, heads: slice | None) -> np.ndarray:
        """q_lora: [n, q_lora_rank] -> [n, h, kv_lora_rank + qk_rope_dim] of the heads `heads`
        (all with None; a prefill TP die's share, xds_mpi/execution/prefill_tp.py). The absorbed
        query's columns are whole heads: a head's columns come out of the product bit for bit
        the same whether the others are computed or not (the dgemm accumulates each output over
        the same k in the same order; tests/e2e/pd/test_prefill_tp.py)."""
        heads = heads or slice(0, self.num_heads)
        num_rows, num_heads = q_lora.shape[0], heads.stop - heads.start
        if self.wq_absorbed is not None:
            width = self.wq_absorbed.shape[1] // self.num_heads
            q = matmul(q_lora, self.wq_absorbed[:, heads.start * width : heads.stop * width])
            q = q.reshape(num_rows, num_heads, width)  # 0 rows too
        else:  # INT8 Wq_b: one projection over every head, this die keeps its own
            q_heads = self.wq_b(q_lora).reshape(num_rows, self.num_heads, -1)[:, heads]
            q_nope = q_heads[..., : self.qk_nope_dim]  # [n, h, nope]
            w_uk = self.w_uk[heads]
            q_latent = np.stack(
                [matmul(q_nope[:, i], w) for i, w in enumerate(w_uk)], axis=1
            )  # [n, h, c]
            q = np.concatenate([q_latent, q_heads[..., self.qk_nope_dim :]], axis=-1)
        q[..., self.kv_lora_rank :] = self.rotary(q[..., self.kv_lora_rank :], positions)
        return q

    def project_out(self, o_latent: np.ndarray) -> np.ndarray:
        """o_latent: [n, heads, kv_lora_rank] attention-weighted latents -> [n, hidden]"""
        num_rows, width = o_latent.shape[0], o_latent.shape[1] * o_latent.shape[2]
        if self.wo_absorbed is not None:
            return matmul(o_latent.reshape(num_rows, width), self.wo_absorbed)  # 0 rows too
        o = np.stack(
            [matmul(o_latent[:, h], w) for h, w in enumerate(self.w_uv_t)], axis=1
        )  # [n, heads, v]
        return self.wo(o.reshape(num_rows, self.num_heads * self.v_head_dim))

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
        return self.project_out(self.attend_heads(x, positions, chunks, cache, layer_idx))

    def attend_heads(
        self,
        x: np.ndarray,
        positions: np.ndarray,
        chunks: list[AttnChunk],
        cache: LatentCache,
        layer_idx: int,
        heads: slice | None = None,
    ) -> np.ndarray:
        """`__call__` up to the output projection, for the heads `heads` (all by default): the
        rows' latents written into `cache`, then [n, h, kv_lora_rank] attention-weighted latents."""
        c_kv, k_rope = self.project_latent(x, positions)
        return self.attend_latents(
            self.q_down(x), c_kv, k_rope, positions, chunks, cache, layer_idx, heads
        )

    def attend_latents(
        self,
        q_lora: np.ndarray,
        c_kv: np.ndarray,
        k_rope: np.ndarray,
        positions: np.ndarray,
        chunks: list[AttnChunk],
        cache: LatentCache,
        layer_idx: int,
        heads: slice | None = None,
    ) -> np.ndarray:
        """From the rows' down-projections (`q_down`, `project_latent`): their latents written
        into `cache`, then each row attends causally to its sequence's cached positions ->
        [n, h, kv_lora_rank] attention-weighted latents of the heads `heads`. A head's rows are
        rows of the batched score and value products (token x head), so a subset of heads gives
        those heads' values bit for bit (the batch-invariant matmul)."""
        q = self.q_up(q_lora, positions, heads)  # [n, h, c + rope]
        slots = [c.write_slots for c in chunks]
        cache.write(layer_idx, slots[0] if len(slots) == 1 else np.concatenate(slots), c_kv, k_rope)
        num_rows, num_heads, lora = q.shape[0], q.shape[1], self.kv_lora_rank
        o_latent = np.empty((num_rows, num_heads, lora), q.dtype)
        row = 0
        for chunk in chunks:
            num = chunk.num_tokens
            cached = cache.gather(layer_idx, chunk.slots)  # [t, c + rope]
            scores = matmul(q[row : row + num].reshape(num * num_heads, -1), cached.T)
            scores = scores.reshape(num, num_heads, -1) * self.scale  # [rows, heads, t]
            if num > 1:  # a single new row sees no future position
                scores = np.where(_future_mask(chunk.start_pos, num), -np.inf, scores)
            probs = softmax(scores).reshape(num * num_heads, -1)
            o_latent[row : row + num] = matmul(probs, cached[:, :lora]).reshape(num, num_heads, -1)
            row += num
        return o_latent

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
