"""MLA decoding from the paged latent cache (absorbed up-projections) against naive MLA
recomputed from scratch on the full sequence (per-head keys and values expanded, no cache)."""

from __future__ import annotations

import pytest
import torch

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.kv_blocks import BlockTable
from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.weights import build_model

torch.set_num_threads(1)
TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def mla():
    return build_model(ModelConfig(num_mtp_modules=0)).layers[1].attn


def _chunk(table: BlockTable, seq_id: int, start_pos: int, num_tokens: int) -> AttnChunk:
    return AttnChunk(
        start_pos=start_pos,
        num_tokens=num_tokens,
        slots=torch.tensor(table.slots(seq_id, 0, start_pos + num_tokens)),
    )


def _new_cache(mla, table: BlockTable) -> LatentCache:
    return LatentCache(
        num_layers=1,
        num_slots=table.num_blocks * table.block_tokens,
        kv_lora_rank=mla.kv_lora_rank,
        rope_dim=mla.qk_rope_dim,
        dtype=torch.float64,
    )


@pytest.mark.parametrize(
    "schedule",
    [[29], [1] * 29, [10, 1, 1, 3, 1, 2, 11], [5, 24]],
    ids=["prefill", "token_by_token", "prefill_decode_verify", "two_chunks"],
)
def test_paged_absorbed_decode_equals_naive_full_sequence(mla, schedule):
    """Two sequences grow side by side (their 4-token blocks interleave in the pool), in chunks
    of `schedule`; every row must equal naive attention over the whole sequence."""
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(sum(schedule), 128, generator=gen, dtype=torch.float64) for _ in range(2)]
    table = BlockTable(num_blocks=16, block_tokens=4)
    cache = _new_cache(mla, table)
    outputs: list[list[torch.Tensor]] = [[], []]
    start = 0
    for num_new in schedule:
        chunks = []
        for seq_id in (0, 1):
            if table.has(seq_id):
                table.append(seq_id, num_new)
            else:
                table.allocate(seq_id, num_new)
            chunks.append(_chunk(table, seq_id, start, num_new))
        x = torch.cat([xs[0][start : start + num_new], xs[1][start : start + num_new]])
        positions = torch.arange(start, start + num_new).repeat(2)
        out = mla(x, positions, chunks, cache, 0)
        outputs[0].append(out[:num_new])
        outputs[1].append(out[num_new:])
        start += num_new
    if len(schedule) > 1:  # the two sequences' blocks really interleave in the pool
        assert table.blocks(0) != list(range(len(table.blocks(0))))
    for seq_id in (0, 1):
        torch.testing.assert_close(torch.cat(outputs[seq_id]), mla.naive_forward(xs[seq_id]), **TOL)


def test_rolled_back_positions_are_overwritten(mla):
    """Speculative rows written then truncated (rejected drafts) must not leak into later
    attention: the result equals naive attention over the kept tokens only."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(12, 128, generator=gen, dtype=torch.float64)
    junk = torch.randn(3, 128, generator=gen, dtype=torch.float64)
    table = BlockTable(num_blocks=8, block_tokens=4)
    cache = _new_cache(mla, table)
    table.allocate(0, 8)
    mla(x[:8], torch.arange(8), [_chunk(table, 0, 0, 8)], cache, 0)
    table.append(0, 3)
    mla(junk, torch.arange(8, 11), [_chunk(table, 0, 8, 3)], cache, 0)
    table.truncate(0, 8)
    table.append(0, 4)
    out = mla(x[8:], torch.arange(8, 12), [_chunk(table, 0, 8, 4)], cache, 0)
    torch.testing.assert_close(out, mla.naive_forward(x)[8:], **TOL)


def _einsum_attention(mla, x, positions, chunks, cache):
    """MLA.forward as einsums, the form its batched matmuls replace."""
    q_nope, q_rope = mla.project_q(x, positions)
    c_kv, k_rope = mla.project_latent(x, positions)
    cache.write(0, torch.cat([c.write_slots for c in chunks]), c_kv, k_rope)
    w_uk, w_uv = mla.up_projections()
    q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
    outputs, row = [], 0
    for chunk in chunks:
        rows = slice(row, row + chunk.num_tokens)
        latent, rope_key = cache.latent[0, chunk.slots], cache.rope_key[0, chunk.slots]
        scores = (
            torch.einsum("nhc,tc->nht", q_latent[rows], latent)
            + torch.einsum("nhr,tr->nht", q_rope[rows], rope_key)
        ) * mla.scale
        query_pos = torch.arange(chunk.start_pos, chunk.start_pos + chunk.num_tokens)
        key_pos = torch.arange(chunk.start_pos + chunk.num_tokens)
        scores = scores.masked_fill(key_pos[None, None, :] > query_pos[:, None, None], -torch.inf)
        outputs.append(torch.einsum("nht,tc->nhc", scores.softmax(-1), latent))
        row += chunk.num_tokens
    o = torch.einsum("nhc,hvc->nhv", torch.cat(outputs), w_uv)
    return mla.wo(o.reshape(x.shape[0], -1))


@pytest.mark.parametrize("schedule", [[29, 1, 1, 1], [1] * 6, [3, 7, 1, 2]])
def test_forward_gives_the_einsum_forms_numbers_bit_for_bit(mla, schedule):
    """The forward calls the batched matmuls einsum makes, without einsum's planning: the
    served runs' tokens must not move, so the numbers must be the very same."""
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(sum(schedule), 128, generator=gen, dtype=torch.float64) for _ in range(2)]
    table = BlockTable(num_blocks=32, block_tokens=4)
    caches = _new_cache(mla, table), _new_cache(mla, table)
    start = 0
    for num_new in schedule:
        chunks = []
        for seq_id in (0, 1):
            table.append(seq_id, num_new) if table.has(seq_id) else table.allocate(seq_id, num_new)
            chunks.append(_chunk(table, seq_id, start, num_new))
        x = torch.cat([xs[0][start : start + num_new], xs[1][start : start + num_new]])
        positions = torch.arange(start, start + num_new).repeat(2)
        fast = mla(x, positions, chunks, caches[0], 0)
        assert torch.equal(fast, _einsum_attention(mla, x, positions, chunks, caches[1]))
        start += num_new
