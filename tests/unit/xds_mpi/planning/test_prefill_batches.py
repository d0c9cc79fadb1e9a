"""The prefill dies' batching replayed (xds_mpi/planning/prefill_batches.py) on crafted arrivals
with a pass that costs 0.1 s + 1 ms a token, so every prefill end is computed by hand; the pass
as the dies' pricer prices it (xds_mpi/planning/prefill_cost.py), at an even spread and with
the tiny checkpoint's hottest prefill die, against an emulated pass."""

from __future__ import annotations

import numpy as np
import pytest

from xds_mpi.config.model import ModelConfig
from xds_mpi.planning.prefill_batches import PrefillRule, prefill_batches
from xds_mpi.planning.prefill_cost import prefill_curve, prefill_pass
from xds_mpi.planning.routing_skew import prefill_skew
from xds_mpi.results.request_pricing import causal_chunks


def linear_pass(pieces, num_sampled):
    return 0.1 + 0.001 * sum(end - start for start, end in pieces)


def replay(arrival, prompt, *, groups=1, tes=1, long_prompt_tokens=0, passes=None):
    def cost(pieces, num_sampled):
        if passes is not None:
            passes.append(pieces)
        return linear_pass(pieces, num_sampled)

    rule = PrefillRule(
        step_tokens=100, chunk_tokens=100, long_prompt_tokens=long_prompt_tokens, max_batch=8
    )
    return prefill_batches(
        np.array(arrival, float),
        np.array(prompt),
        num_tes=tes,
        groups_per_te=groups,
        rule=rule,
        pass_cost=cost,
    )


def test_prompts_that_arrive_during_a_pass_share_the_next_within_the_budget():
    # 0: 60 tokens alone, 0.16 s. Requests 1-3 arrive during it; at 0.16 the idle group takes
    # 1 (30) and 2 (30 more: 60 <= 100), not 3 (110 > 100): one 60-token pass, 0.16 s -> 0.32;
    # then 3 alone, 0.15 s -> 0.47. (One prompt at a time would end them at 0.29, 0.42, 0.57.)
    passes = []
    ends = replay([0.0, 0.05, 0.06, 0.07], [60, 30, 30, 50], passes=passes)
    np.testing.assert_allclose(ends, [0.16, 0.32, 0.32, 0.47])
    assert passes == [((0, 60),), ((0, 30), (0, 30)), ((0, 50),)]


def test_a_long_prompt_is_chunked_and_a_te_waits_for_its_costliest_group():
    # two groups in lockstep: 0 (250 tokens) on group 0 in chunks of 100, 100, 50; 1 (20) on
    # group 1 ends with the TE's first iteration, which lasts as group 0's 100-token pass
    passes = []
    ends = replay([0.0, 0.0], [250, 20], groups=2, passes=passes)
    np.testing.assert_allclose(ends, [0.2 + 0.2 + 0.15, 0.2])
    assert passes == [((0, 100),), ((0, 20),), ((100, 200),), ((200, 250),)]


def test_long_and_short_prompts_never_share_a_group():
    # at 0.16 the group takes 1 (30: short, under 40) and not 2 (50: long), which waits a pass
    ends = replay([0.0, 0.05, 0.06], [60, 30, 50], long_prompt_tokens=40)
    np.testing.assert_allclose(ends, [0.16, 0.16 + 0.13, 0.29 + 0.15])


def test_two_tes_split_long_and_short_prompts_and_run_side_by_side():
    # the JE sends short prompts to TE 0 and long ones to TE 1 (xds_mpi/pd/route.py), so the
    # long prompt does not delay the short one behind it
    ends = replay([0.0, 0.0, 0.01], [90, 80, 30], tes=2, long_prompt_tokens=40)
    np.testing.assert_allclose(ends, [0.19, 0.19 + 0.18, 0.01 + 0.13])


@pytest.mark.parametrize("tp", [1, 4])
def test_one_prompt_in_one_pass_is_priced_as_the_prefill_curve(tp):
    # a pass over one whole prompt is the curve's point (the same pricer); two prompts in one
    # pass share its fixed costs, so cost less than two passes and more than the longer one
    one = prefill_pass(32, tp, "ascend910c")
    curve = prefill_curve(32, tp, "ascend910c", 2048)
    assert one(((0, 2048),), 1) == pytest.approx(curve(2048))
    both = one(((0, 2048), (0, 1024)), 2)
    assert one(((0, 2048),), 1) < both < one(((0, 2048),), 1) + one(((0, 1024),), 1)


@pytest.mark.parametrize("tp", [1, 4])
def test_a_pass_at_an_even_spread_is_the_request_pricers_own(tp):
    # a skew of 1 at every MoE layer is the even spread
    pass_ = prefill_pass(8, tp, "ascend910c")
    seqs = causal_chunks(1500) + causal_chunks(300)
    even = pass_.pricer.pass_s(seqs, 8, sampled=2, tp=tp, skew=(1.0,) * 4)
    assert even == pytest.approx(pass_.pricer.pass_s(seqs, 8, sampled=2, tp=tp), rel=1e-12)


def test_a_long_prompt_on_eight_prefill_dies_costs_what_the_emulated_pass_took():
    # the 96-chip verification's TTFT p99 request (docs/planning.md): a 2,429-token prompt on
    # 8 prefill dies at TP4 (2D + 8P TP4 on configs/pd.yaml), its pass 0.445-0.458 s on the
    # emulated prefill dies' clocks; at an even spread the planner priced 0.356 s
    skew = prefill_skew(ModelConfig(weights="tiny"), 8)
    assert skew is not None and max(skew) > 3  # one die hosts the expert ~40 % of rows take
    even = prefill_pass(8, 4, "ascend910c")(((0, 2429),), 1)
    skewed = prefill_pass(8, 4, "ascend910c", 0, skew)(((0, 2429),), 1)
    assert even == pytest.approx(0.356, abs=0.001)
    assert skewed == pytest.approx(0.450, rel=0.03)
