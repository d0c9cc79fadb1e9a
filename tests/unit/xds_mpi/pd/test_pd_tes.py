"""Prefill TEs (xDeepServe §5.1 step 1): the JE's choice of a TE by length and load on crafted
loads, and how the plan splits the prefill dies into TEs (no MPI; the MPI run with two TEs is in
tests/e2e/pd/test_serving_pd.py)."""

from __future__ import annotations

from harness import REPO_ROOT

from xds_mpi.config.schema import load_config
from xds_mpi.pd.route import PrefillRouter, pick_prefill_te, tes_for
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.plan.pd import describe_pd, split, split_experts

LONG = 48  # pd.long_prompt_tokens


def test_two_tes_keep_long_and_short_apart_whatever_the_load():
    assert pick_prefill_te(60, [0, 500], LONG) == 1  # long: TE 1 even when far busier
    assert pick_prefill_te(48, [0, 0], LONG) == 1  # the threshold itself is long
    assert pick_prefill_te(47, [500, 0], LONG) == 0  # short: TE 0 even when far busier


def test_least_load_within_the_length_class_and_ties_to_the_lowest_te():
    # 4 TEs: 0 and 1 short, 2 and 3 long
    assert [tes_for(10, 4, LONG), tes_for(90, 4, LONG)] == [range(0, 2), range(2, 4)]
    assert pick_prefill_te(10, [7, 7, 0, 0], LONG) == 0  # tie: lowest index
    assert pick_prefill_te(10, [7, 3, 0, 0], LONG) == 1
    assert pick_prefill_te(90, [0, 0, 9, 9], LONG) == 2
    assert pick_prefill_te(90, [0, 0, 9, 4], LONG) == 3
    # 3 TEs: the last 3 // 2 = 1 is long
    assert pick_prefill_te(90, [0, 0, 99], LONG) == 2
    assert pick_prefill_te(10, [5, 5, 0], LONG) == 0


def test_one_te_or_no_threshold_serves_every_length_by_load():
    assert pick_prefill_te(90, [0], LONG) == 0
    assert pick_prefill_te(90, [4, 3], 0) == 1 and pick_prefill_te(10, [3, 3], 0) == 0


def test_all_long_requests_share_the_long_tes_by_tokens_in_flight():
    router = PrefillRouter(4, LONG)
    picks = [router.dispatch(i, n) for i, n in enumerate([60, 50, 50, 64])]
    assert picks == [2, 3, 3, 2]  # 60 -> 2 (tie), 50 -> 3, 50 -> 3 (50 < 60), 64 -> 2 (60 < 100)
    assert router.loads == [0, 0, 124, 100]
    router.prefilled(0)  # TE 2's 60 tokens are done
    assert router.loads == [0, 0, 64, 100] and router.dispatch(4, 70) == 2
    router.prefilled(0)  # counted once
    assert router.loads == [0, 0, 134, 100] and set(router.in_flight()) == {1, 2, 3, 4}


def test_prefill_dies_split_into_consecutive_tes():
    assert split((6, 7, 8, 9, 10), 2) == ((6, 7, 8), (9, 10))
    assert split((6, 7), 2) == ((6,), (7,))
    assert split_experts(5, (4, 5)) == (4, 4, 4, 5, 5)
    cfg = load_config(
        REPO_ROOT / "configs" / "pd.yaml",
        ["deployment.num_prefill_dies=3", "deployment.dp_groups_per_domain=2"]
        + ["pd.num_prefill_tes=2"],
    )
    plan = DeploymentPlan.build(cfg)
    pd = plan.pd
    assert pd.tes == ((4, 5), (6,)) and pd.leaders == (4, 6)
    assert [ep.members for ep in pd.eps] == [(4, 5), (6,)]  # each TE its own EP group
    assert pd.slot_owners == ((4,) * 8 + (5,) * 8, (6,) * 16)
    for rank in (4, 5, 6):  # each die's window holds its own TE's dispatch/combine area
        assert plan.window_bytes[rank] == plan.p2p.window_bytes(rank) + (
            pd.eps[pd.te_of(rank)].area_bytes()
        )


def test_validate_names_each_prefill_te():
    plan = DeploymentPlan.build(
        load_config(REPO_ROOT / "configs" / "pd.yaml", ["pd.num_prefill_tes=2"])
    )
    text = describe_pd(plan)
    assert "prefill DP groups 2 (ranks [6, 7], 2 prefill TEs)" in text
    assert "prefill TE 0: ranks [6], leader (its TE-shell) 6, EP1, prompts of < 48 tokens" in text
    assert "prefill TE 1: ranks [7], leader (its TE-shell) 7, EP1, prompts of >= 48 tokens" in text
