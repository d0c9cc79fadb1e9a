"""The source's slowdown during a fork (xds_mpi/scaling/contention.py) with known answers: an
iteration starting inside a fork's TE-Load window [start, end) has its dispatch and combine
slowed by 1 / (1 - share), one starting at the end or outside is not, unused (0, 0) slots are
none; charged on a priced iteration the factor is `steps.source_slowdown`'s (the x1.072 of
docs/scaling.md for 13.1 of 181.3 ms); the pricer's dispatch and combine carry it, nothing else;
and the scale-out plan's TE-Load window is the one the JE writes into a source die's table."""

from __future__ import annotations

import numpy as np
import pytest

from ranks.core.die_parts import make_pricer
from xccl.vclock import VirtualClock
from xds_mpi.cluster.scale_out import load_window
from xds_mpi.config.schema import load_config
from xds_mpi.execution.slots import ExpertSlots
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.scaling.contention import factor_at, is_forking, link_factor
from xds_mpi.scaling.steps import source_slowdown

TABLE = np.array([[3.0, 3.5], [7.25, 7.75], [0.0, 0.0], [0.0, 0.0]])  # two forks, two unused


@pytest.mark.parametrize(
    "start_s, expected",
    [
        (2.999, False),
        (3.0, True),  # TE-Load's first instant
        (3.4999, True),
        (3.5, False),  # its end: the fork is done
        (7.5, True),
        (0.0, False),  # an unused (0, 0) slot is no window
        (8.0, False),
    ],
)
def test_an_iteration_is_charged_when_it_starts_inside_a_fork_s_te_load(start_s, expected):
    assert is_forking(TABLE, start_s) is expected
    assert factor_at(TABLE, start_s, 0.5) == (2.0 if expected else 1.0)


def test_the_factor_on_an_iteration_is_source_slowdown_s():
    cfg = load_config("configs/colocated.yaml", [])
    share = cfg.scaling.fork_link_share
    iteration_ms, link_ms = 181.3, 13.1  # docs/scaling.md: the projection's colocated iteration
    charged = iteration_ms - link_ms + link_ms * link_factor(share)
    slowdown = source_slowdown(cfg, iteration_s=iteration_ms / 1e3, link_s=link_ms / 1e3)
    assert charged / iteration_ms == pytest.approx(slowdown)
    assert slowdown == pytest.approx(1.072, abs=5e-4)


@pytest.mark.parametrize("share", [-0.1, 1.0])
def test_a_share_outside_0_to_1_is_refused_with_its_value(share):
    with pytest.raises(ValueError, match=str(share)):
        link_factor(share)


def test_the_pricer_slows_dispatch_and_combine_only():
    cfg = load_config("configs/colocated.yaml", [])
    spent = []
    for factor in (1.0, 2.0):
        pricer = _pricer(cfg)  # a colocated die's, as the die makes it
        pricer.link_factor = factor
        pricer.gate(16)
        pricer.dispatch(16)
        pricer.experts(16, 16)
        pricer.combine(16)
        spent.append(dict(pricer.spent))
    assert spent[1]["dispatch"] == pytest.approx(2 * spent[0]["dispatch"])
    assert spent[1]["combine"] == pytest.approx(2 * spent[0]["combine"])
    assert (spent[1]["gate"], spent[1]["experts"]) == (spent[0]["gate"], spent[0]["experts"])


def _pricer(cfg):
    topo = DeploymentPlan.build(cfg, None, launcher_checks=False).topo
    return make_pricer(cfg, VirtualClock(), ExpertSlots.from_topology(topo))


def test_the_te_load_window_is_after_the_steps_before_it():
    steps = (("Scaler-Pre", 1.0), ("TE-Pre-Load", 2.0), ("TE-Load", 0.5), ("Scaler-Post", 0.1))
    assert load_window(steps, 10.0) == (13.0, 13.5)
    assert load_window((("scale-out (autoscaler.scale_out_s)", 0.5),), 3.25) == (3.25, 3.75)
