"""The MoE gate against DeepSeek-V3's routing rules on hand-crafted scores (expected experts and
weights worked out by hand in each test), and the INT8 dispatch input against xccl.quant."""

from __future__ import annotations

import numpy as np
import pytest

from xccl.quant import quant_dequant
from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.moe import Gate, dispatch_input, select_experts


def _select(scores, bias=None, *, top_k=2, groups=1, topk_groups=1, scaling=2.5):
    scores = np.array([scores], dtype=np.float64)
    bias = np.zeros(scores.shape[1]) if bias is None else np.array(bias, dtype=np.float64)
    r = select_experts(
        scores,
        bias,
        top_k=top_k,
        num_expert_groups=groups,
        topk_groups=topk_groups,
        routed_scaling=scaling,
    )
    return r.topk_idx[0].tolist(), r.topk_weight[0].tolist()


def test_bias_changes_selection_but_not_weights():
    # biased = [0.9, 0.8, 0.95, 0.7]: expert 2 (raw 0.1) wins a place over expert 1 (raw 0.8).
    idx, weight = _select([0.9, 0.8, 0.1, 0.7], bias=[0, 0, 0.85, 0])
    assert idx == [2, 0]
    # Weights use the raw scores 0.1 and 0.9: normalized to sum 1, times 2.5.
    assert weight == pytest.approx([0.1 / 1.0 * 2.5, 0.9 / 1.0 * 2.5])


def test_weights_are_normalized_then_scaled():
    idx, weight = _select([0.2, 0.6, 0.3, 0.1], top_k=3, scaling=1.5)
    assert idx == [1, 2, 0]
    assert weight == pytest.approx([0.6 / 1.1 * 1.5, 0.3 / 1.1 * 1.5, 0.2 / 1.1 * 1.5])
    assert sum(weight) == pytest.approx(1.5)


def test_group_limited_routing_excludes_the_best_expert_of_a_weak_group():
    # 4 groups of 2. Group sums of the top-2: g0 0.95, g1 1.18, g2 1.05, g3 0.30 -> keep g1, g2.
    scores = [0.95, 0.0, 0.6, 0.58, 0.5, 0.55, 0.1, 0.2]
    idx, weight = _select(scores, groups=4, topk_groups=2)
    assert idx == [2, 3]
    assert weight == pytest.approx([0.6 / 1.18 * 2.5, 0.58 / 1.18 * 2.5])
    assert _select(scores)[0] == [0, 2]  # without group limits expert 0 wins


def test_group_score_is_the_sum_of_the_top_two_not_the_max():
    # g0 has the best single expert (max 0.9, top-2 sum 1.0); g1 sums 0.6 + 0.6 -> 1.2 wins.
    scores = [0.9, 0.1, 0.05, 0.05, 0.6, 0.6, 0.0, 0.0]
    idx, _ = _select(scores, groups=2, topk_groups=1)
    assert sorted(idx) == [4, 5]


def test_bias_also_steers_group_choice():
    scores = [0.9, 0.1, 0.05, 0.05, 0.6, 0.6, 0.0, 0.0]
    idx, weight = _select(scores, bias=[0, 0.5, 0, 0, 0, 0, 0, 0], groups=2, topk_groups=1)
    assert idx == [0, 1]  # g0's biased top-2 sum 1.5 beats g1's 1.2
    assert weight == pytest.approx([0.9 / 1.0 * 2.5, 0.1 / 1.0 * 2.5])


def test_gate_scores_are_sigmoids_of_the_router_logits():
    cfg = ModelConfig(hidden=4, num_routed_experts=4, top_k=2)
    gate = Gate(cfg, {"weight": np.eye(4), "bias": np.zeros(4)}, "")
    logits = np.array([[1.0, -2.0, 3.0, 0.5]])
    routing = gate(logits)
    sig = 1 / (1 + np.exp(-logits[0]))
    assert routing.topk_idx[0].tolist() == [2, 0]
    np.testing.assert_allclose(
        routing.topk_weight[0],
        [sig[2] / (sig[2] + sig[0]) * 2.5, sig[0] / (sig[2] + sig[0]) * 2.5],
    )


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_int8_dispatch_input_is_xccl_quant_dequant(dtype):
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(dtype)
    expected = quant_dequant(x)
    assert np.array_equal(dispatch_input(x, use_int8=True), expected)
    assert dispatch_input(x, use_int8=True).dtype == dtype
    assert dispatch_input(x, use_int8=False) is x


def test_group_limited_routing_takes_a_die_with_no_rows():
    # An idle die still runs the gate of every MoE layer on its 0 rows (ep288 found it).
    routing = select_experts(
        np.zeros((0, 8)),
        np.zeros(8),
        top_k=4,
        num_expert_groups=4,
        topk_groups=2,
        routed_scaling=2.5,
    )
    assert routing.topk_idx.shape == (0, 4) and routing.topk_weight.shape == (0, 4)
