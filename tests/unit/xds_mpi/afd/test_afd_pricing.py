"""The disaggregated dies' pricer: A2E in flight (records stamped at their landing, the die's
clock untouched), E2A on the die's clock, expert slots as their share of the cost experts."""

from __future__ import annotations

import pytest
from harness import REPO_ROOT

from xccl.vclock import VirtualClock
from xds_mpi.afd.pricing import AfdPricer
from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import load_config
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.topology import Topology
from xds_mpi.projection.cost import CostModel, Hardware
from xds_mpi.projection.layers import AfdHops, counts


def _pricer(slots_here: int):
    cfg = load_config(REPO_ROOT / "configs" / "afd.yaml")
    cost = CostModel(cost_shape(), Hardware.from_profile(load_profile("ascend910c")))
    hops = AfdHops.of(cfg, counts(cfg, Topology.from_config(cfg)))
    clock = VirtualClock()
    pricer = AfdPricer(
        cost, cfg.model, clock, hops=hops, num_routed_slots_here=slots_here,
        num_routed_dies=3, use_int8=True,
    )  # fmt: skip
    return cfg, cost, hops, clock, pricer


def test_a2e_is_in_flight_and_e2a_on_the_clock():
    cfg, cost, hops, clock, pricer = _pricer(6)
    clock.advance(1000.0)
    a2e = hops.a2e(cost, 3, int8=True)
    with pricer.a2e_in_flight(3):
        assert clock.now_ns == pytest.approx(1000.0 + pricer.moe_scale * a2e * 1e9)
    assert clock.now_ns == 1000.0  # the die goes on with its next microbatch
    pricer.e2a(3)
    assert clock.now_ns == pytest.approx(1000.0 + pricer.moe_scale * hops.e2a(cost, 3) * 1e9)
    # A2E: to the die's trampoline (the domain has 2, one per attention die), then an expert
    # die pulls its rows from the 2 trampolines in its persistent kernel (no kernel start).
    assert (hops.trampolines, hops.domain_trampolines, hops.expert_dies) == (1, 2, 3)
    expert_rows = 3 * 2 * 8 / 3
    stage2 = cost.dispatch(expert_rows, peers=2) - cost.hw.dispatch_start_s
    assert a2e == pytest.approx(cost.dispatch(3, peers=1) + stage2)
    # E2A: a trampoline takes its attention die's 3 rows x (top-8 + shared) from the 3 expert
    # dies (persistent), then the die its 3 rows from its trampoline.
    stage1 = cost.combine(3 * 9, peers=3) - cost.hw.combine_start_s
    assert hops.e2a(cost, 3) == pytest.approx(stage1 + cost.combine(3, peers=1))


def test_an_expert_slot_stands_for_its_share_of_the_dies_cost_experts():
    cfg, cost, _, clock, pricer = _pricer(6)
    per_slot = round(256 / 3) / 6
    pricer.expert_slot(2, is_shared=False)
    expected = pricer.moe_scale * cost.routed(2 * 8 / 2, per_slot)
    assert clock.now_ns == pytest.approx(expected * 1e9)
    # A few rows reach only some of the slot's experts: fewer weight reads than all of them.
    assert cost.routed(8, per_slot) < per_slot * cost.gemm(8 / per_slot, 3 * 7168 * 2048)
