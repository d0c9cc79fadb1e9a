"""The tiny checkpoint's measured routing (its split over two dies, each expert's share) against
a direct count from the checkpoint; the hottest die's expected rows and an expert die's
expected slot costs against every outcome enumerated."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from xds_mpi.config.model import ModelConfig
from xds_mpi.model.checkpoint import weights_path
from xds_mpi.model.weights import load_model
from xds_mpi.planning.routing_measure import measure, routed_experts
from xds_mpi.planning.routing_skew import (
    DECODE_SPLITS,
    EXACT_TOKENS,
    EXPERT_SHARES,
    PREFILL_EXPERT_SHARES,
    PREFILL_SPLITS,
    TwoDieSplit,
    expected_over_experts,
    measured_splits,
    prefill_skew,
)


def test_table_is_the_count_from_the_checkpoint():
    m = measure()
    assert m.decode == DECODE_SPLITS
    assert m.prefill == PREFILL_SPLITS
    assert m.expert_shares == EXPERT_SHARES
    assert m.prefill_expert_shares == PREFILL_EXPERT_SHARES
    assert [sum(s) for s in EXPERT_SHARES] == pytest.approx([2.0] * 4, abs=1e-3)


def test_routed_experts_are_the_models_own_routing():
    # the measurement's pass against the model's own forward: the gate's rows of one MoE
    # layer, counted by hand from the model's layers, give the same top-k per position
    model = load_model(weights_path("tiny"))
    tokens = list(np.random.default_rng(3).integers(0, model.cfg.vocab_size, 40))
    topk = routed_experts(model, tokens)
    assert len(topk) == model.cfg.num_layers - model.cfg.num_dense_layers + 1
    assert [t.shape for t in topk] == [(40, 2)] * 3 + [(39, 2)]
    # a prefix's routing is the same (causal): the pass over the first 25 tokens
    prefix = routed_experts(model, tokens[:25])
    for whole, part in zip(topk[:-1], prefix[:-1]):
        assert np.array_equal(whole[:25], part)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5])
@pytest.mark.parametrize("split", [DECODE_SPLITS[0], DECODE_SPLITS[2], PREFILL_SPLITS[3]])
def test_hottest_rows_enumerated(split, num_tokens):
    # every token's rows on the first die (0, 1 or 2), with its probability
    expected = 0.0
    for outcome in itertools.product(range(3), repeat=num_tokens):
        p = float(np.prod([split.share[j] for j in outcome]))
        first = sum(outcome)
        expected += p * max(first, 2 * num_tokens - first)
    assert split.hottest_rows(num_tokens) == pytest.approx(expected, rel=1e-9)


def test_hottest_rows_interpolates_and_stays_continuous_beyond_the_exact_range():
    split = DECODE_SPLITS[1]
    assert split.hottest_rows(1.5) == pytest.approx(
        0.5 * split.hottest_rows(1) + 0.5 * split.hottest_rows(2)
    )
    exact, approx = split.hottest_rows(EXACT_TOKENS), split.hottest_rows(EXACT_TOKENS + 1)
    assert exact < approx < exact + 2 * 1.01
    # an even split's hottest die: half the rows and the fluctuation, as the uniform case
    even = TwoDieSplit(share=(0.25, 0.5, 0.25))
    assert even.hottest_rows(1) == pytest.approx(0.5 * 1 + 0.5 * 2)


def test_the_table_applies_to_the_tiny_checkpoint_on_two_dies_only():
    tiny = ModelConfig(weights="tiny")
    assert measured_splits(tiny, 2) == DECODE_SPLITS
    assert measured_splits(tiny, 2, is_prefill=True) == PREFILL_SPLITS
    assert measured_splits(tiny, 4) is None
    assert measured_splits(ModelConfig(weights="random"), 2) is None


@pytest.mark.parametrize("num_tokens", [1, 2, 4])
def test_expected_over_experts_enumerated(num_tokens):
    # each token's top-2: experts (0, 1) or (0, 2), as likely; shares (1, 0.5, 0.5). Every
    # outcome enumerated, a slot's cost a fixed part and one per row (as a slot's kernel)
    def cost_of_rows(rows: int) -> float:
        return 3.0 + rows

    expected = 0.0
    for outcome in itertools.product((1, 2), repeat=num_tokens):
        rows = [num_tokens, outcome.count(1), outcome.count(2)]
        expected += sum(cost_of_rows(r) for r in rows if r) / 2**num_tokens
    got = expected_over_experts((1.0, 0.5, 0.5, 0.0), num_tokens, cost_of_rows)
    assert got == pytest.approx(expected, rel=1e-12)


def test_prefill_skew_at_two_dies_agrees_with_the_two_die_split():
    # two tables counted apart: the experts' shares summed per die, and the tokens' split
    # between the dies; the first die's mean rows per token are the same either way
    skew = prefill_skew(ModelConfig(weights="tiny"), 2)
    for factor, split in zip(skew, PREFILL_SPLITS):
        first = split.share[1] + 2 * split.share[2]
        assert factor == pytest.approx(max(first, 2 - first), abs=2e-3)
    assert prefill_skew(ModelConfig(weights="random"), 8) is None
    assert prefill_skew(ModelConfig(weights="tiny"), 3) is None  # 16 experts do not divide
