"""EPLB's pure pieces on crafted counts (xds_mpi/eplb): FlowServe's selection and placement
(§4.5 Step 2), the DeepSeek-style policy, the failover hook, and the rotation table (Step 4)."""

from __future__ import annotations

import numpy as np
import pytest

from xccl.routing import rotation_table, select_slots
from xds_mpi.eplb import deepseek, flowserve
from xds_mpi.eplb.placement import Placement, changed_slots, die_loads, disable, remove_die
from xds_mpi.eplb.policy import (
    keep_improvements,
    max_over_mean,
    predicted_max_over_mean,
    rebalance,
)


def placement(num_dies: int = 4, experts_per_die: int = 2, redundant: int = 1) -> Placement:
    """Die d: routed experts d*E..d*E+E-1, then `redundant` empty slots; one layer."""
    phy2log, slot_die = [], []
    for die in range(num_dies):
        for k in range(experts_per_die):
            phy2log.append(die * experts_per_die + k)
            slot_die.append(die)
        phy2log += [-1] * redundant
        slot_die += [die] * redundant
    return Placement.static(tuple(phy2log), tuple(slot_die), 1)


# -- Step 2: selection ----------------------------------------------------------------------------
def test_total_load_sums_each_slices_hottest():
    counts = np.array([[5, 1, 1], [1, 7, 1]])
    assert flowserve.total_load(counts) == 12


def test_one_hot_expert_takes_the_whole_budget():
    counts = np.array([[80, 2, 2, 2, 2, 2, 2, 2]])  # expert 0 is 40x the others
    assert flowserve.select_redundant(counts, 3) == [0, 0, 0]


def test_selection_updates_counts_after_each_pick():
    # Split 0 once (60 -> 30): expert 1 (40) is now the hottest and is split next.
    counts = np.array([[60, 40, 10, 10]])
    assert flowserve.select_redundant(counts, 2) == [0, 1]


def test_candidates_come_from_every_time_slice():
    # Expert 2 is hot only in slice 1, expert 0 only in slice 0; both get a replica.
    counts = np.array([[50, 1, 5, 1], [1, 1, 60, 1]])
    assert sorted(flowserve.select_redundant(counts, 2)) == [0, 2]


def test_ties_break_on_total_load_then_lowest_index():
    # Experts 1 and 3 tie in every slice; no split lowers L alone; equal totals -> index 1.
    counts = np.array([[1, 9, 1, 9], [1, 9, 1, 9]])
    assert flowserve.select_redundant(counts, 2) == [1, 3]


def test_all_equal_counts_pick_in_index_order():
    counts = np.full((3, 4), 10)
    assert flowserve.select_redundant(counts, 3) == [0, 1, 2]


def test_zero_budget_selects_nothing():
    assert flowserve.select_redundant(np.array([[9, 1]]), 0) == []


# -- Step 2: placement ----------------------------------------------------------------------------
def test_heaviest_replica_goes_to_least_loaded_die_without_that_expert():
    p = placement()  # dies 0..3 hold experts (0,1) (2,3) (4,5) (6,7)
    counts = np.array([[100, 10, 10, 10, 40, 10, 2, 2]])
    row = flowserve.place_redundant(p, 0, counts, [0, 4])
    # Per replica: expert 0 -> 50, expert 4 -> 20. Die loads before: 60 20 30 4.
    # Expert 0 (heavier) first -> die 3 (4): 54; expert 4 -> die 1 (20).
    assert row[p.redundant_slots(3)[0]] == 0
    assert row[p.redundant_slots(1)[0]] == 4
    assert sorted(e for s, e in enumerate(row) if p.is_redundant[s] and e >= 0) == [0, 4]


def test_placement_never_uses_more_slots_than_free():
    p = placement(num_dies=2, redundant=1)
    with pytest.raises(ValueError, match="free redundant slots"):
        flowserve.place_redundant(p, 0, np.ones((1, 4)), [0, 1, 2])


def test_rebalance_lowers_the_straggler_on_skewed_counts():
    p = placement(num_dies=4, experts_per_die=2, redundant=2)
    counts = np.array([[[200, 10, 10, 30, 5, 5, 60, 10]]]).transpose(1, 0, 2)  # [1, 1, 8]
    before = predicted_max_over_mean(p, counts)[0]
    for policy in ("flowserve", "deepseek"):
        after = predicted_max_over_mean(rebalance(policy, p, counts, 8, dies_per_node=16), counts)
        assert after[0] < before / 2, (policy, before, after)


def test_die_loads_split_each_expert_over_its_replicas():
    p = placement(num_dies=2, experts_per_die=1, redundant=1)  # slots: 0 | -1 | 1 | -1
    p = p.with_layer(0, (0, -1, 1, 0))  # expert 0 also on die 1
    assert list(die_loads(p, 0, np.array([10.0, 4.0]))) == [5.0, 9.0]
    assert max_over_mean(np.array([5.0, 9.0])) == pytest.approx(9 / 7)
    assert np.isnan(max_over_mean(np.zeros(2)))


# -- DeepSeek-style policy ------------------------------------------------------------------------
def test_deepseek_replicates_highest_load_per_replica():
    load = np.array([90.0, 50.0, 10.0])
    # 90 -> 45 per replica, then 50 is highest, then 45.
    assert deepseek.replicate(load, np.ones(3), 3) == [0, 1, 0]


def test_deepseek_hierarchical_balances_nodes_first():
    p = placement(num_dies=4, experts_per_die=1, redundant=1)  # nodes {0,1} {2,3}
    load = np.array([100.0, 100.0, 1.0, 1.0])
    row = deepseek.place(p, 0, load, [0, 1], dies_per_node=2)
    # Both replicas leave node 0 (load 100 vs 1): one on die 2, one on die 3.
    assert row[p.redundant_slots(2)[0]] in (0, 1) and row[p.redundant_slots(3)[0]] in (0, 1)


# -- Step 3 and the failover hook -----------------------------------------------------------------
def test_disable_empties_only_the_changed_redundant_slots():
    p = placement(num_dies=2, experts_per_die=1, redundant=1)
    new = p.with_layer(0, (0, 1, 1, 0))
    changed = changed_slots(p, new)
    assert changed == ((0, 1), (0, 3))
    assert disable(new, changed).phy2log[0] == (0, -1, 1, -1)


def test_remove_die_keeps_experts_with_a_replica_elsewhere():
    p = placement(num_dies=2, experts_per_die=1, redundant=1).with_layer(0, (0, 1, 1, 0))
    survived = remove_die(p, 0)
    assert survived.log2phy(0) == ((3,), (2,))


def test_remove_die_names_experts_that_would_lose_their_last_replica():
    p = placement(num_dies=2, experts_per_die=2, redundant=1).with_layer(0, (0, 1, -1, 2, 3, 0))
    with pytest.raises(ValueError, match=r"layer 0: experts \[1\]"):
        remove_die(p, 0)
    with pytest.raises(ValueError, match="not one of the 2 expert dies"):
        remove_die(p, 5)


# -- Step 4: the rotation table -------------------------------------------------------------------
def test_rotation_table_rotates_each_column_over_its_replicas():
    log2phy = [(2, 1), (0,), (3, 4, 5)]
    table = rotation_table(log2phy, 4)  # [tokens, logical experts]
    assert table.tolist() == [[2, 0, 3], [1, 0, 4], [2, 0, 5], [1, 0, 3]]
    assert rotation_table(log2phy, 2, src_rank=1).tolist() == [[1, 0, 4], [2, 0, 5]]


def test_select_slots_is_the_table_gathered_at_the_gate_choice():
    log2phy = [(2, 1), (0,), (3, 4, 5)]
    topk = np.array([[0, 2], [0, -1], [1, 2], [2, 0]])
    table = rotation_table(log2phy, 4)
    phy = select_slots(topk, log2phy, (), src_rank=0)
    expected = [[table[t, e] if e >= 0 else -1 for e in row] for t, row in enumerate(topk)]
    assert phy.tolist() == expected


def test_rotation_spreads_a_hot_expert_evenly():
    table = rotation_table([(7, 8, 9)], 300, src_rank=5)
    assert np.bincount(table[:, 0])[7:].tolist() == [100, 100, 100]


def test_a_layer_changes_only_when_the_new_placement_predicts_less_straggling():
    p = placement(num_dies=2, experts_per_die=1, redundant=1)  # slots: 0 | -1 | 1 | -1
    good = p.with_layer(0, (0, -1, 1, 0))  # hot expert 0 also on die 1
    counts = np.array([[[30, 10]]])  # [1 layer, 1 slice, 2 experts]
    assert keep_improvements(p, good, counts) == good
    assert keep_improvements(good, p, counts) == good  # p would straggle more: kept
