"""The measurement behind xds_mpi/planning/routing_skew.py's table: the tiny checkpoint's gate
over decoded and prompt rows, counted per MoE layer (how: routing_skew's docstring).

`python -m xds_mpi.planning.routing_measure` prints the table to paste into routing_skew.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xds_mpi.config.model import ModelConfig
from xds_mpi.model.checkpoint import weights_path
from xds_mpi.model.kv_blocks import BlockTable
from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
from xds_mpi.model.transformer import DeepSeekModel
from xds_mpi.model.weights import load_model
from xds_mpi.planning.routing_skew import (
    MEASURED_WEIGHTS,
    NUM_REQUESTS,
    OUTPUT_LEN,
    SEED,
    TwoDieSplit,
)

MIN_PROMPT, MAX_PROMPT = 20, 300
BLOCK_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class Measured:
    """Per main MoE layer, then the MTP module's block: the decode rows' and the prompt rows'
    split over two dies, and their share of each expert."""

    decode: tuple[TwoDieSplit, ...]
    prefill: tuple[TwoDieSplit, ...]
    expert_shares: tuple[tuple[float, ...], ...]
    prefill_expert_shares: tuple[tuple[float, ...], ...]


def measure(
    num_requests: int = NUM_REQUESTS, output_len: int = OUTPUT_LEN, seed: int = SEED
) -> Measured:
    """The tiny checkpoint's routing over generated and prompt rows (routing_skew's docstring)."""
    model = load_model(weights_path(MEASURED_WEIGHTS))
    vocab = model.cfg.vocab_size
    rng = np.random.default_rng(seed)
    lengths = rng.integers(MIN_PROMPT, MAX_PROMPT, num_requests)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in lengths]
    options = GenerateOptions(max_new_tokens=output_len, ignore_eos=True)
    outputs = ReferenceGenerator(model, options).generate(prompts)
    decode, prefill = [], []
    for prompt, out in zip(prompts, outputs):
        topk = routed_experts(model, [*prompt, *out.tokens])  # [layers, positions, top_k]
        # the MTP block's row i drafts from position i + 1: rows < len(prompt) - 1 are prefill
        mtp_cut = len(prompt) - 1
        prefill.append(
            [t[: len(prompt) if i < len(topk) - 1 else mtp_cut] for i, t in enumerate(topk)]
        )
        decode.append(
            [t[len(prompt) if i < len(topk) - 1 else mtp_cut :] for i, t in enumerate(topk)]
        )
    return Measured(
        decode=_splits(decode, model.cfg),
        prefill=_splits(prefill, model.cfg),
        expert_shares=_expert_shares(decode, model.cfg),
        prefill_expert_shares=_expert_shares(prefill, model.cfg),
    )


def routed_experts(model: DeepSeekModel, tokens: list[int]) -> list[np.ndarray]:
    """The gate's top-k experts of every position of one causal pass over `tokens`: one
    [len(tokens), top_k] array per main MoE layer, then [len(tokens) - 1, top_k] of the MTP
    module's block (its row i: h^0_i with token i + 1)."""
    cfg, n = model.cfg, len(tokens)
    cache, chunk = _cache(model, n)
    positions = np.arange(n)
    x = model.embed(np.array(tokens))  # [n, hidden]
    topk = []
    for layer_idx, layer in enumerate(model.layers):
        x = layer.attention_part(x, positions, [chunk], cache, layer_idx)
        if layer.is_moe:
            topk.append(layer.ffn.gate(layer.ffn_norm(x)).topk_idx)
        x = layer.ffn_part(x)
    mtp = model.mtp_module(1)
    h = mtp.project(x[:-1], model.embed(np.array(tokens[1:])))  # [n - 1, hidden]
    short = AttnChunk(start_pos=0, num_tokens=n - 1, slots=chunk.slots[: n - 1])
    h = mtp.block.attention_part(h, positions[:-1], [short], cache, cfg.num_layers)
    topk.append(mtp.block.ffn.gate(mtp.block.ffn_norm(h)).topk_idx)
    return topk


def _cache(model: DeepSeekModel, n: int) -> tuple[LatentCache, AttnChunk]:
    cfg = model.cfg
    num_blocks = -(-n // BLOCK_TOKENS)
    table = BlockTable(num_blocks=num_blocks, block_tokens=BLOCK_TOKENS)
    table.allocate(0, n)
    cache = LatentCache(
        num_layers=model.num_cache_layers(1),
        num_slots=num_blocks * BLOCK_TOKENS,
        kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.qk_rope_dim,
        dtype=model.dtype,
    )
    slots = np.array(table.slots(0, 0, n), dtype=np.int64)
    return cache, AttnChunk(start_pos=0, num_tokens=n, slots=slots)


def _splits(per_request: list[list[np.ndarray]], cfg: ModelConfig) -> tuple[TwoDieSplit, ...]:
    """Per layer: tokens by how many top-k rows reach the first die (experts below half)."""
    half = cfg.num_routed_experts // 2
    splits = []
    for layer in zip(*per_request):
        on_first = (np.concatenate(layer) < half).sum(axis=1)  # [tokens] 0..top_k
        counts = np.bincount(on_first, minlength=3) / len(on_first)
        splits.append(TwoDieSplit(share=tuple(round(float(c), 4) for c in counts)))
    return tuple(splits)


def _expert_shares(per_request: list[list[np.ndarray]], cfg: ModelConfig) -> tuple:
    """Per layer: [experts] the share of tokens sending a row to each expert (sums to top_k)."""
    shares = []
    for layer in zip(*per_request):
        topk = np.concatenate(layer)  # [tokens, top_k]
        counts = np.bincount(topk.ravel(), minlength=cfg.num_routed_experts) / len(topk)
        shares.append(tuple(round(float(c), 4) for c in counts))
    return tuple(shares)


if __name__ == "__main__":
    m = measure()
    for name, splits in (("DECODE_SPLITS", m.decode), ("PREFILL_SPLITS", m.prefill)):
        print(f"{name} = (")
        for s in splits:
            print(f"    TwoDieSplit(share={s.share}),")
        print(")")
    for name, table in (
        ("EXPERT_SHARES", m.expert_shares),
        ("PREFILL_EXPERT_SHARES", m.prefill_expert_shares),
    ):
        print(f"{name} = (")
        for shares in table:
            print(f"    {shares},")
        print(")")
