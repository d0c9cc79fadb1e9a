"""The planner's decode iteration against the dies' own pricing: for a batch every die holds
alike, `DieStep` and the step table price what a die's `Pricer` prices when the executor runs
that batch (one die's iteration, layer by layer, as xds_mpi/execution/executor.py calls it);
an uneven batch costs the fullest group's rows plus the routed rows the mean batch sends; the
hottest die's received rows are the tiny checkpoint's measured split on its 2 dies
(routing_skew.py), the multinomial's expected maximum for other weights."""

from __future__ import annotations

import itertools
import math

import pytest

from xccl.vclock import VirtualClock
from xds_mpi.config.hardware import load_profile
from xds_mpi.execution.pricing import Pricer
from xds_mpi.model.shapes import cost_shape
from xds_mpi.planning.costs import base_config, step_table
from xds_mpi.planning.die_step import DieStep, hottest_rows, routed_dies
from xds_mpi.planning.routing_skew import DECODE_SPLITS
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
