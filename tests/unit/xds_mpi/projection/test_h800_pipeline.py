"""The H800 harness's layer is DeepSeek's five-stage decoding pipeline (h800_harness.py): each
block recomputed from the cost model's operations, the layer from the blocks, and its direction
against the free overlap it replaced (a call that may hide only under the block beside it can
never make the layer shorter)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from xds_mpi.projection import h800_harness as h


def test_each_block_is_the_models_operations():
    cost = h.h800_cost()
    m, rows = cost.m, 128
    layer = h.decode_layer(cost)
    seqs = [(4096, 2)] * 64
    per_head = m.qk_nope_dim * m.kv_lora_rank
    o_part = (
        cost.bf16_gemm(rows, per_head, n=m.v_head_dim, groups=m.num_heads)
        + cost.gemm(rows, m.num_heads * m.v_head_dim * m.hidden, n=m.hidden)
        + cost.fixed("o_proj")
    )
    assert layer["ATTN-0"] == pytest.approx(cost.mla_prolog(rows) - o_part)
    assert layer["ATTN-1"] == pytest.approx(cost.attention(seqs) + o_part + cost.gate(rows))
    assert layer["SHARED"] == cost.experts([rows])
    assert layer["MLP"] == cost.routed(rows * m.top_k, 2)
    assert layer["dispatch"] == cost.dispatch(rows * m.top_k, peers=128)
    assert layer["combine"] == cost.combine(rows * m.top_k, peers=128)
    # ATTN-0 + ATTN-1 is the whole attention side and the gate, split where the core starts
    assert layer["ATTN-0"] + layer["ATTN-1"] == pytest.approx(
        layer["attention side"] + layer["gate"]
    )


def test_the_layer_is_two_microbatches_of_three_blocks():
    layer = h.decode_layer(h.h800_cost())
    first = max(layer["SHARED"] + layer["ATTN-0"], layer["dispatch"])
    last = max(layer["ATTN-1"], layer["combine"])
    assert layer["moe layer"] == 2 * (first + layer["MLP"] + last)
    # at DeepSeek's decode shape both calls outlast the block they run under
    assert layer["dispatch"] > layer["SHARED"] + layer["ATTN-0"]
    assert layer["combine"] > layer["ATTN-1"]


@pytest.mark.parametrize("link_scale", [0.25, 1.0, 4.0])
def test_the_pipeline_is_never_shorter_than_the_free_overlap(link_scale):
    """Direction: with links slower or faster, the five-stage layer is at least max(2 C, C + M)
    (each block is at least its compute and at least the call under it), and equal to 2 C once
    the calls fit under their blocks."""
    cost = h.h800_cost()
    hw = replace(cost.hw, read_bytes_per_s=cost.hw.read_bytes_per_s / link_scale)
    hw = replace(
        hw,
        dispatch_start_s=hw.dispatch_start_s * link_scale,
        combine_start_s=hw.combine_start_s * link_scale,
        jitter_s=hw.jitter_s * link_scale,
        write_latency_s=hw.write_latency_s * link_scale,
        read_latency_s=hw.read_latency_s * link_scale,
    )
    layer = h.decode_layer(h.h800_cost(hw))
    assert layer["moe layer"] >= layer["free overlap"] * (1 - 1e-12)
    hidden = (
        layer["dispatch"] <= layer["SHARED"] + layer["ATTN-0"]
        and layer["combine"] <= layer["ATTN-1"]
    )
    assert hidden == (link_scale < 1)  # 4x faster links fit under their blocks
    if hidden:
        assert layer["moe layer"] == pytest.approx(2 * layer["compute"])
    else:
        assert layer["moe layer"] > layer["free overlap"]


def test_the_layer_row_is_the_pipelines():
    """The layer row is the pipeline's, with the kernels measured at their shape in their
    blocks (the fit alone with at_shape=False)."""
    cost = h.h800_cost()
    m = cost.m
    fit_layer = h.decode_layer(cost)
    fit_mean = (58 * fit_layer["moe layer"] + 3 * fit_layer["dense layer"]) / 61
    fit_rows = {r.what: r for r in h.harness_rows(at_shape=False)}
    assert fit_rows["61 layers / 61"].projected == pytest.approx(fit_mean * 1e6)
    layer = h.decode_layer(cost, measured=h.at_shape_deltas(cost))
    moe = m.num_layers - m.num_dense_layers
    mean = (moe * layer["moe layer"] + m.num_dense_layers * layer["dense layer"]) / m.num_layers
    rows = {r.what: r for r in h.harness_rows()}
    assert rows["61 layers / 61"].projected == pytest.approx(mean * 1e6)
