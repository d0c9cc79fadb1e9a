"""MLA decoding from the paged latent cache (absorbed up-projections) against naive MLA
recomputed from scratch on the full sequence (per-head keys and values expanded, no cache), and
a sequence's rows against the same rows batched with another sequence."""

from __future__ import annotations

import numpy as np
import pytest

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.kv_blocks import BlockTable
from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.weights import build_model

TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def mla():
    return build_model(ModelConfig(num_mtp_modules=0)).layers[1].attn


def _chunk(table: BlockTable, seq_id: int, start_pos: int, num_tokens: int) -> AttnChunk:
    return AttnChunk(
        start_pos=start_pos,
        num_tokens=num_tokens,
        slots=np.array(table.slots(seq_id, 0, start_pos + num_tokens)),
    )


def _new_cache(mla, table: BlockTable) -> LatentCache:
    return LatentCache(
        num_layers=1,
        num_slots=table.num_blocks * table.block_tokens,
        kv_lora_rank=mla.kv_lora_rank,
        rope_dim=mla.qk_rope_dim,
        dtype=np.float64,
    )


def _grow(mla, xs, schedule, seq_ids, table, cache):
    """Sequences seq_ids grow side by side in chunks of `schedule`; returns each one's rows."""
    outputs = {seq_id: [] for seq_id in seq_ids}
    start = 0
    for num_new in schedule:
        chunks = []
        for seq_id in seq_ids:
            table.append(seq_id, num_new) if table.has(seq_id) else table.allocate(seq_id, num_new)
            chunks.append(_chunk(table, seq_id, start, num_new))
        x = np.concatenate([xs[seq_id][start : start + num_new] for seq_id in seq_ids])
        positions = np.tile(np.arange(start, start + num_new), len(seq_ids))
        out = mla(x, positions, chunks, cache, 0)
        for i, seq_id in enumerate(seq_ids):
            outputs[seq_id].append(out[i * num_new : (i + 1) * num_new])
        start += num_new
    return {seq_id: np.concatenate(rows) for seq_id, rows in outputs.items()}


@pytest.mark.parametrize(
    "schedule",
    [[29], [1] * 29, [10, 1, 1, 3, 1, 2, 11], [5, 24]],
    ids=["prefill", "token_by_token", "prefill_decode_verify", "two_chunks"],
)
def test_paged_absorbed_decode_equals_naive_full_sequence(mla, schedule):
    """Two sequences grow side by side (their 4-token blocks interleave in the pool), in chunks
    of `schedule`; every row must equal naive attention over the whole sequence."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((sum(schedule), 128)) for _ in range(2)]
    table = BlockTable(num_blocks=16, block_tokens=4)
    out = _grow(mla, xs, schedule, (0, 1), table, _new_cache(mla, table))
    if len(schedule) > 1:  # the two sequences' blocks really interleave in the pool
        assert table.blocks(0) != list(range(len(table.blocks(0))))
    for seq_id in (0, 1):
        np.testing.assert_allclose(out[seq_id], mla.naive_forward(xs[seq_id]), **TOL)


def test_rolled_back_positions_are_overwritten(mla):
    """Speculative rows written then truncated (rejected drafts) must not leak into later
    attention: the result equals naive attention over the kept tokens only."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((12, 128))
    junk = rng.standard_normal((3, 128))
    table = BlockTable(num_blocks=8, block_tokens=4)
    cache = _new_cache(mla, table)
    table.allocate(0, 8)
    mla(x[:8], np.arange(8), [_chunk(table, 0, 0, 8)], cache, 0)
    table.append(0, 3)
    mla(junk, np.arange(8, 11), [_chunk(table, 0, 8, 3)], cache, 0)
    table.truncate(0, 8)
    table.append(0, 4)
    out = mla(x[8:], np.arange(8, 12), [_chunk(table, 0, 8, 4)], cache, 0)
    np.testing.assert_allclose(out, mla.naive_forward(x)[8:], **TOL)


@pytest.mark.parametrize("schedule", [[29, 1, 1, 1], [1] * 6, [3, 7, 1, 2]])
def test_a_sequences_rows_do_not_depend_on_the_batch(mla, schedule):
    """The served runs' tokens must not depend on batch composition: a sequence's rows are bit
    for bit the same batched with two others as alone."""
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((sum(schedule), 128)) for _ in range(3)]
    outs = []
    for seq_ids in ((0, 1, 2), (1,)):
        table = BlockTable(num_blocks=32, block_tokens=4)
        outs.append(_grow(mla, xs, schedule, seq_ids, table, _new_cache(mla, table))[1])
    assert np.array_equal(outs[0], outs[1])
