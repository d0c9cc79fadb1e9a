"""EPLB's pieces around the algorithm: a die's expert map (replica weights, counts), the skew of
Figure 11a at pod scale, and the MoE time a die load implies."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import ModelConfig, load_config
from xds_mpi.eplb.expert_map import ExpertMap
from xds_mpi.eplb.placement import Placement
from xds_mpi.eplb.skew import Skew, skew_loads, skew_slices
from xds_mpi.model.shapes import load_model_preset
from xds_mpi.model.transformer import DeepSeekModel
from xds_mpi.model.weights import init_state
from xds_mpi.projection.cost import Hardware
from xds_mpi.projection.eplb_pod import compare
from xds_mpi.projection.moe_time import MoePricing

TINY = ModelConfig(hidden=32, num_routed_experts=4, num_shared_experts=1, top_k=2)


def two_die_map() -> ExpertMap:
    """Slots: die 0 = expert 0, expert 1, redundant; die 1 = expert 2, expert 3, redundant."""
    placement = Placement.static((0, 1, -1, 2, 3, -1), (0, 0, 0, 1, 1, 1), 2)
    return ExpertMap(placement, moe_layers=(1, 2))


def test_a_replica_computes_what_the_expert_computes_once_loaded():
    moe, expert_map = DeepSeekModel(TINY, init_state(TINY, 0)).moe_of(1), two_die_map()
    new = expert_map.placement.with_layer(0, (0, 1, 3, 2, 3, -1))  # expert 3 also on die 0
    x = np.random.default_rng(0).standard_normal((5, TINY.hidden))
    expert_map.install(new)
    with pytest.raises(RuntimeError, match="holding the weights of expert -1"):
        expert_map.expert_forward(moe, 1, 2, x)
    expert_map.load(0, 2, 3, copy.deepcopy(moe.experts[3]))
    assert np.array_equal(expert_map.expert_forward(moe, 1, 2, x), moe.expert_forward(3, x))
    assert expert_map.log2phy(1)[3] == (2, 4) and expert_map.log2phy(2)[3] == (4,)


def test_counts_are_per_layer_and_restart_with_each_iteration():
    expert_map = two_die_map()
    expert_map.start_iteration(has_prefill=False)
    expert_map.collect(1, np.array([[0, 3], [3, -1]]), 7)
    expert_map.collect(2, np.array([[1, 2]]), 2)
    assert expert_map.counts.tolist() == [[1, 0, 0, 2], [0, 1, 1, 0]]
    assert expert_map.rows_in.tolist() == [7, 2]
    expert_map.start_iteration(has_prefill=True)
    assert expert_map.counts.sum() == 0 and expert_map.has_prefill


@pytest.mark.parametrize("hottest, share", [(30.0, 0.2), (5.0, 0.1), (12.0, 0.3)])
def test_skew_has_the_asked_hottest_and_share_above_the_mean(hottest, share):
    loads = skew_loads(256, Skew(hottest_over_mean=hottest, share_above_mean=share))
    assert loads.mean() == pytest.approx(1.0)
    assert loads.max() / loads.mean() == pytest.approx(hottest)
    assert np.mean(loads > loads.mean()) == pytest.approx(round(share * 256) / 256)


def test_an_impossible_skew_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match="hot experts alone take"):
        skew_loads(256, Skew(hottest_over_mean=300.0))


def test_skew_slices_drift_but_keep_the_shape():
    slices = skew_slices(64, Skew(hottest_over_mean=8.0, num_slices=3, drift_sigma=0.3, seed=1))
    assert slices.shape == (4, 64)
    assert all(np.allclose(np.sort(s), np.sort(slices[0])) for s in slices)
    assert not np.array_equal(slices[0], slices[-1])


def test_pod_projection_orders_native_balanced_uniform():
    cfg = load_config("configs/ep288.yaml")
    hw = Hardware.from_profile(load_profile(cfg.hardware.profile))
    m = load_model_preset("deepseek_v3")
    results = compare(cfg, m, hw, Skew(), batch_per_die=60, kv_len=1024, mtp_depth=1)
    by_name = {r.name.split(",")[-1].strip(): r for r in results}
    uniform, native = by_name["MoE-Avg-Routing (uniform)"], by_name["MoE-Native (no EPLB)"]
    assert native.max_over_mean == pytest.approx(30.0)
    assert uniform.max_over_mean == pytest.approx(1.0)
    for policy in ("flowserve", "deepseek"):
        assert uniform.forward_s <= by_name[policy].forward_s < native.forward_s


def test_moe_time_grows_with_the_busiest_die_only():
    cfg = load_config("configs/eplb.yaml")
    pricing = MoePricing.from_config(cfg, num_routed_dies=8)
    layers = len(pricing.layer_scales)
    even = np.full((layers, 8), 400.0)
    skewed = even.copy()
    skewed[:, 0], skewed[:, 1] = 1200.0, 0.0  # one die 3x the mean, another idle
    assert pricing.ms(skewed, 4.0) > pricing.ms(even, 4.0)
    assert pricing.ms(even) == pytest.approx(pricing.ms(even[:, ::-1]))


def test_a_die_builds_the_experts_its_routed_slots_hold_not_its_redundant_ones():
    # Slots 0-3 routed (experts 2, 0, 3, 1), slot 4 redundant holding a copy of expert 2 in layer
    # 7 only, slot 5 a removed die's (empty).
    placement = Placement(
        phy2log=((2, 0, 3, 1, -1, -1), (2, 0, 3, 1, 2, -1)),
        slot_die=(0, 0, 1, 1, 1, 2),
        is_redundant=(False, False, False, False, True, False),
        num_experts=4,
    )
    expert_map = ExpertMap(placement, moe_layers=(5, 7))
    assert expert_map.hosted(5, [2, 3, 4]) == [3, 1]
    assert expert_map.hosted(7, [2, 3, 4, 5]) == [3, 1]  # the copy is loaded, not built
    assert expert_map.hosted(7, [0]) == [2]
