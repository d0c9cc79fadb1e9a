"""Where the quantizable projections sit in a built model, by checkpoint name, and a forward over
whole text windows (calibration and evaluation both run one)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.transformer import Block, DeepSeekModel


def blocks(model: DeepSeekModel) -> Iterator[tuple[str, Block]]:
    """(checkpoint prefix, block): the main layers, then each MTP module's block."""
    for i, layer in enumerate(model.layers):
        yield f"layers.{i}.", layer
    for k, module in enumerate(model.mtp):
        yield f"mtp.{k}.block.", module.block


def projection_sites(model: DeepSeekModel) -> Iterator[tuple[str, object, str]]:
    """(weight name, owner, attribute): owner.attribute is the projection that name holds."""
    for prefix, block in blocks(model):
        for attr in ("wq_a", "wq_b", "wkv_a", "wo"):
            yield f"{prefix}attn.{attr}.weight", block.attn, attr
        if block.is_moe:
            ffns = [(f"{prefix}ffn.experts.{e}.", x) for e, x in enumerate(block.ffn.experts)]
            ffns += [
                (f"{prefix}ffn.shared_experts.{e}.", x)
                for e, x in enumerate(block.ffn.shared_experts)
            ]
        else:
            ffns = [(f"{prefix}ffn.", block.ffn)]
        for ffn_prefix, ffn in ffns:
            for attr in ("w1", "w3", "w2"):
                yield f"{ffn_prefix}{attr}.weight", ffn, attr


def forward_windows(
    model: DeepSeekModel, windows: np.ndarray, *, kv_int8: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """windows: [b, t] int64 token ids, each a sequence from position 0 (kv_int8: through an
    INT8 latent cache) -> (main-model logits
    [b, t, vocab], MTP depth-1 logits [b, t - 1, vocab]: at i, fed h^0_i and token i + 1, it
    predicts token i + 2). Empty MTP logits for a model without MTP modules."""
    num_windows, num_tokens = windows.shape
    cache = LatentCache(
        num_layers=model.num_cache_layers(1 if model.mtp else 0),
        num_slots=num_windows * num_tokens,
        kv_lora_rank=model.cfg.kv_lora_rank,
        rope_dim=model.cfg.qk_rope_dim,
        dtype=model.dtype,
        latent_int8=kv_int8,
    )
    slots = np.arange(num_windows * num_tokens, dtype=np.int64).reshape(num_windows, num_tokens)
    chunks = [AttnChunk(start_pos=0, num_tokens=num_tokens, slots=s) for s in slots]
    positions = np.tile(np.arange(num_tokens), num_windows)
    hidden = model(windows.reshape(-1), positions, chunks, cache)  # [b * t, hidden]
    logits = model.logits(hidden).reshape(num_windows, num_tokens, -1)
    if not model.mtp:
        return logits, np.zeros((num_windows, num_tokens - 1, 0))
    hidden = hidden.reshape(num_windows, num_tokens, -1)
    short = num_tokens - 1
    mtp_chunks = [AttnChunk(start_pos=0, num_tokens=short, slots=s[:short]) for s in slots]
    mtp_hidden = model.mtp_forward(
        1,
        hidden[:, :short].reshape(num_windows * short, -1),
        windows[:, 1:].reshape(-1),
        np.tile(np.arange(short), num_windows),
        mtp_chunks,
        cache,
    )
    return logits, model.mtp_logits(1, mtp_hidden).reshape(num_windows, short, -1)
