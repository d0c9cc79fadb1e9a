"""The planner's decode iteration against the dies' own pricing: for a batch every die holds
alike, `DieStep` and the step table price what a die's `Pricer` prices when the executor runs
that batch (one die's iteration, layer by layer, as xds_mpi/execution/executor.py calls it);
an uneven batch costs the fullest group's rows plus the routed rows the mean batch sends; the
hottest die's received rows are the tiny checkpoint's measured split on its 2 dies
(routing_skew.py), the multinomial's expected maximum for other weights. An afd iteration
(`AfdStep`) against the emulated afd dies' virtual time and, with one microbatch, the serial
sum of the afd pricer's pieces."""

from __future__ import annotations

import itertools
import math

import pytest

from xccl.vclock import VirtualClock
from xds_mpi.config.hardware import load_profile
from xds_mpi.execution.pricing import Pricer
from xds_mpi.model.shapes import cost_shape
from xds_mpi.planning.afd_step import AfdStep
from xds_mpi.planning.costs import base_config, step_table
from xds_mpi.planning.die_step import DieStep, hottest_rows, routed_dies
from xds_mpi.planning.routing_skew import DECODE_SPLITS, EXPERT_SHARES, expected_over_experts
from xds_mpi.projection.cost import CostModel, Hardware

SETS = ("deployment.dp_groups_per_domain=2", "scheduler.mtp_depth=0")


def die_pricer_iteration(cfg, batch: int, kv_len: int, rows_in: list[float]) -> float:
    """One decode iteration of `batch` requests on a die, priced by the dies' Pricer the way
    the executor calls it (no MTP): every layer's attention, dense FFN or gate / dispatch /
    routed + shared experts / combine, then head, sampling, graph launch and bubble.
    rows_in: the rows the die receives at each MoE layer."""
    rows_in = iter(rows_in)
    hw = Hardware.from_profile(load_profile(cfg.hardware.profile))
    cost = CostModel(cost_shape(), hw, kv_int8=cfg.scheduler.kv_int8)
    pricer = Pricer(cost, cfg.model, VirtualClock(), num_routed_dies=2, use_int8=True)
    for layer_idx in range(cfg.model.num_layers):
        is_moe = layer_idx >= cfg.model.num_dense_layers
        pricer.attention_rows([(kv_len + 1, 1)] * batch, is_moe=is_moe)
        if not is_moe:
            pricer.dense_ffn(batch)
            continue
        pricer.gate(batch)
        received = next(rows_in)
        pricer.dispatch(received)
        pricer.experts(received, batch)
        pricer.combine(batch)
    pricer.finish(batch)
    return pricer.clock.now_ns / 1e9


@pytest.mark.parametrize("weights", ["tiny", "random"])
@pytest.mark.parametrize("batch", [1, 2, 8])
def test_even_batch_costs_what_the_die_pricer_prices(batch, weights):
    sets = (*SETS, f"model.weights={weights}")
    cfg = base_config(sets, "ascend910c", "colocated")
    assert routed_dies(cfg) == 2
    die = DieStep(cfg=cfg, mtp_depth=0, accepted=0.0)
    # both dies hold `batch` requests: a die receives the hottest share of 2 x batch tokens'
    # top-k rows, by the tiny checkpoint's measured split per layer, or at random
    if weights == "tiny":
        rows_in = [split.hottest_rows(2 * batch) for split in DECODE_SPLITS[:-1]]
    else:
        rows_in = [hottest_rows(2 * batch * cfg.model.top_k, 2)] * 3
    expected = die_pricer_iteration(cfg, batch, 1024, rows_in)
    assert die.own_s(batch, 1024) + die.received_s(batch) == pytest.approx(expected, rel=1e-12)
    # the step table holds those points exactly (BATCH_GRID and MEAN_GRID hold 1, 2, 8)
    table = step_table(sets, "ascend910c", 0, 0.9, "colocated")
    assert table(batch, 1024, batch) == pytest.approx(expected, rel=1e-12)


def test_one_request_on_two_dies_pays_half_the_routed_rows_of_two():
    # the verify miss's mechanism: one request on 2 DP groups sends its rows to fewer experts
    # than one request on each group; the planner priced both as the fullest group's batch
    table = step_table(SETS, "ascend910c", 0, 0.9, "colocated")
    one, both = table(1, 1024, 0.5), table(1, 1024, 1.0)
    die = DieStep(cfg=base_config(SETS, "ascend910c", "colocated"), mtp_depth=0, accepted=0.0)
    assert both - one == pytest.approx(die.received_s(1.0) - die.received_s(0.5), rel=1e-12)
    assert one < 0.8 * both


@pytest.mark.parametrize("num_rows,num_dies", [(1, 2), (2, 2), (5, 3), (8, 4)])
def test_hottest_rows_is_the_multinomial_expected_maximum(num_rows, num_dies):
    # every assignment of the rows to dies, equally likely
    outcomes = list(itertools.product(range(num_dies), repeat=num_rows))
    expected = sum(max(o.count(d) for d in range(num_dies)) for o in outcomes) / len(outcomes)
    assert hottest_rows(num_rows, num_dies) == pytest.approx(expected, rel=1e-9)


def test_hottest_rows_interpolates_and_approaches_the_mean_at_scale():
    assert hottest_rows(1.5, 2) == pytest.approx(0.5 * 1.0 + 0.5 * 1.5)
    many = hottest_rows(16384, 32)
    assert 512 < many < 512 + 3 * math.sqrt(16384 / 32)


# The reduced afd deployment of `xds-mpi plan --verify` (1 attention die, 1 expert die, 2
# microbatches, configs/pd_afd.yaml) and its emulated attention die's virtual time per decode
# iteration, by requests in the batch: the mean over a 100-request verification's iterations
# (its run file's dies/<rank>/vtime_s; mean KV length 276 tokens), docs/planning.md.
AFD_SETS = (
    "deployment.num_dp_domains=1",
    "deployment.dp_groups_per_domain=1",
    "deployment.num_expert_dies=1",
    "deployment.num_prefill_dies=1",
    "deployment.prefill_tp=1",
    "scheduler.mtp_depth=0",
)
AFD_EMULATED_MS = {1: 33.7, 2: 42.3, 3: 54.8, 4: 66.7, 5: 78.3, 6: 88.7, 7: 98.6, 8: 108.3}


@pytest.mark.parametrize("batch", sorted(AFD_EMULATED_MS))
def test_afd_step_prices_what_the_emulated_afd_dies_took(batch):
    cfg = base_config(AFD_SETS, "ascend910c", "pd_afd")
    planned = AfdStep(cfg=cfg, mtp_depth=0, accepted=0.0).iteration_s(batch, 276)
    assert planned * 1e3 == pytest.approx(AFD_EMULATED_MS[batch], rel=0.03)


def test_afd_step_with_one_microbatch_is_the_serial_sum():
    # one microbatch: nothing overlaps; each MoE layer is attention, gate, A2E, the expert
    # die's slots and shared expert, E2A, one after another on the die's pricer
    cfg = base_config((*AFD_SETS, "deployment.num_microbatches=1"), "ascend910c", "pd_afd")
    step = AfdStep(cfg=cfg, mtp_depth=0, accepted=0.0)
    p = step._pricer()
    tiny, batch, kv = cfg.model, 3, 500
    before = p.clock.now_ns
    expert_s = 0.0
    for layer_idx in range(tiny.num_layers):
        is_moe = layer_idx >= tiny.num_dense_layers
        p.attention_rows([(kv + 1, 1)] * batch, is_moe=is_moe)
        if not is_moe:
            p.dense_ffn(batch)
            continue
        p.gate(batch)
        expert_s += p.moe_scale * p.hops.a2e(p.cost, batch, int8=p.use_int8)
        shares = EXPERT_SHARES[layer_idx - tiny.num_dense_layers]
        expert_s += expected_over_experts(
            shares, batch, lambda r: p.moe_scale * p.cost.routed(r * p.topk_scale, 16)
        )
        expert_s += p.moe_scale * p.cost.experts([batch])
        p.e2a(batch)
    p.finish(batch)
    serial = (p.clock.now_ns - before) / 1e9 + expert_s
    assert step.iteration_s(batch, kv) == pytest.approx(serial, rel=1e-9)
