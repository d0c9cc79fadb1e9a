"""Vertical scaling with EPLB on colocated dies (xDeepServe §6.2 stage 2, "EPLB removes its
slots"): a dead die is scaled away, EPLB's newest placement loses its slots, EPLB goes on
rebalancing over the survivors, and every token equals the reference; what stays refused is
refused before launch."""

from __future__ import annotations

import numpy as np
import pytest
from test_decode_failover import assert_scaled, served

from xds_mpi.config.schema import ConfigError, config_from_dict
from xds_mpi.eplb.placement import Placement, from_topology, remove_die
from xds_mpi.eplb.policy import rebalance
from xds_mpi.eplb.ring import ring_placement
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.plan.topology import Topology

# The ring's 4 replicas per die stay put (every expert survives one lost die); EPLB fills the
# fifth slot of every die, rebalancing after every 2-iteration slice.
EPLB = [
    "deployment.redundant_slots_per_die=5",
    "health.replicas=ring",
    "eplb.enabled=true",
    "eplb.interval=2",
    "eplb.slices=1",
    "eplb.load_slots_per_iteration=4",
    "workload.output_len=20",
    "workload.prompt_len=12",
    "workload.ignore_eos=true",
]


@pytest.mark.failure_matrix  # the colocated stop runs by default (test_decode_failover.py)
def test_a_dead_die_with_eplb_and_no_replica_left_stops_the_run_naming_die_and_experts(
    tmp_path,
):
    """EPLB without ring replicas (health.on_expert_lost stop): die rank 2 dies at iteration 3,
    before EPLB's first rebalance (its first slice ends at iteration 8) could have copied one
    of its experts into a redundant slot, so removing it leaves experts 4-7 without a replica
    in every MoE layer and the run stops, naming die and experts."""
    eplb = ["deployment.redundant_slots_per_die=1", "eplb.enabled=true", "eplb.interval=8"]
    result, run_file, records = served(tmp_path, ["{kind: dead, die: 2, iteration: 3}"], *eplb)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert run_file.attrs["status"].startswith("failed: die rank 2 (dead) silent")
    [record] = records
    assert (record.die, record.verdict, record.detected_by) == (2, "dead", "heartbeat")
    lost = "; ".join(f"layer {layer}: experts [4, 5, 6, 7]" for layer in range(3))
    stop = "health.on_expert_lost=stop: die rank 2: removing die 1 leaves no replica of: "
    assert stop + lost in out


def _slot_die(redundant: int = 5) -> tuple[int, ...]:
    cfg = config_from_dict({"deployment": {"redundant_slots_per_die": redundant}})
    return from_topology(Topology.from_config(cfg), 1).slot_die


def test_a_dead_die_with_eplb_is_scaled_away_and_eplb_rebalances_the_survivors(tmp_path):
    rows = ["{kind: dead, die: 2, iteration: 6}"]
    result, run_file, records = served(tmp_path, rows, *EPLB)
    served_line = "check: 8 requests, 160 tokens, 0 mismatches"
    record = assert_scaled(result, records, 2, "dead", "vertical scaling: 4 -> 3", served_line)
    assert record.requests_affected and record.tokens_per_s_before > 0
    eplb = run_file["eplb"]
    [scaled] = eplb["scaling_version"][()]  # the newest placement without die 2's slots
    versions = list(eplb["reconfig_version"][()])
    phy2log = eplb["reconfig_phy2log"][()]  # [reconfigs, layers, slots]
    lost_slots = [s for s, d in enumerate(_slot_die()) if d == 1]  # die rank 2 = die index 1
    for version, rows_ in zip(versions, phy2log):
        if version >= scaled:  # planned over the survivors only
            assert (rows_[:, lost_slots] == -1).all(), (version, rows_)
    # EPLB kept working: a placement it planned after the scaling was enabled on the survivors.
    assert eplb.attrs["num_reconfigs"] > scaled, (versions, scaled)
    after = eplb["slice_version_end"][()] > scaled
    die_rows = eplb["slice_die_rows"][()][after]  # [slices, layers, dies]: die 2 (column 1) gone
    assert np.isnan(die_rows[:, :, 1]).all() and (die_rows[:, :, [0, 2, 3]] >= 0).all()
    print(record.describe(), "| EPLB versions", versions, "scaled", scaled)


def test_a_stuck_die_back_within_the_grace_keeps_eplb_on_all_dies(tmp_path, request):
    if not request.config.getoption("--failure-matrix"):
        pytest.skip("the stuck-and-back case with EPLB runs with --failure-matrix")
    rows = ["{kind: stuck, die: 3, iteration: 6, duration_s: 5}"]
    result, run_file, records = served(tmp_path, rows, *EPLB)
    served_line = "check: 8 requests, 160 tokens, 0 mismatches"
    assert_scaled(result, records, 3, "stuck", "buffers rebuilt on all 4", served_line)
    [scaled] = run_file["eplb"]["scaling_version"][()]
    assert run_file["eplb"].attrs["num_reconfigs"] > scaled


def test_eplb_with_the_ring_needs_a_redundant_slot_beyond_it():
    sections = {"health": {"replicas": "ring"}, "eplb": {"enabled": True}}
    with pytest.raises(ConfigError, match="4 of them the ring's .*; set it to 5 or more"):
        DeploymentPlan.build(
            config_from_dict({"deployment": {"redundant_slots_per_die": 4}, **sections})
        )
    plan = DeploymentPlan.build(
        config_from_dict({"deployment": {"redundant_slots_per_die": 5}, **sections})
    )
    assert plan.cfg.eplb.enabled


@pytest.mark.parametrize("policy", ["flowserve", "deepseek"])
def test_rebalancing_after_a_loss_plans_over_the_survivors_and_keeps_every_expert(policy):
    cfg = config_from_dict({"deployment": {"redundant_slots_per_die": 5}})
    ring = ring_placement(Topology.from_config(cfg), 3, fixed=True)
    left = remove_die(ring, 1)
    assert left.live_dies == (0, 2, 3) and not left.redundant_slots(1)
    # One hot expert per layer; without the ring's fixed slots die 1's experts would be gone.
    counts = np.ones((3, 2, 16))
    counts[:, :, 5] = 50
    new = rebalance(policy, left, counts, 16, dies_per_node=8)
    lost = [s for s, d in enumerate(new.slot_die) if d == 1]
    for layer in range(3):
        assert all(new.phy2log[layer][s] == -1 for s in lost)
        assert all(new.log2phy(layer)), new.phy2log[layer]
        assert new.phy2log[layer].count(5) >= 2  # the hot expert got the survivors' slots


@pytest.mark.parametrize("policy", ["flowserve", "deepseek"])
def test_a_lost_dies_experts_left_in_redundant_slots_only_keep_a_slot(policy):
    """Without the ring, a lost die's experts live on in EPLB's redundant slots only; the
    policies start from empty redundant slots, and every expert must keep one (policy.cover)."""
    routed = (0, 1, -1, 2, 3, -1, 4, 5, -1)  # 3 dies: 2 routed slots and 1 redundant each
    p = Placement.static(routed, (0, 0, 0, 1, 1, 1, 2, 2, 2), 1)
    left = remove_die(p.with_layer(0, (0, 1, 2, 2, 3, 0, 4, 5, 3)), 1)
    counts = np.ones((1, 2, 6))
    counts[0, :, 0] = 100  # expert 0 is hot: alone, the policies would give it both slots
    new = rebalance(policy, left, counts, 3, dies_per_node=8)
    assert new.phy2log[0][3:6] == (-1, -1, -1)
    assert sorted(e for e in new.phy2log[0] if e >= 0) == [0, 1, 2, 3, 4, 5]
