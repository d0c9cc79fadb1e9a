"""A scale-out's plan (xds_mpi/cluster/scale_out.py) with known answers: a fork's source is the
least loaded serving TE of its shape (ties: the newest; a TE scaled out earlier too), a source
lost before the decision is none, and a source lost inside TE-Load makes the TE fall back: TE-Load
becomes the fork's time until the loss plus the fallback's TE-Load; a loss after TE-Load changes
nothing; with one fixed step the fallback starts it over at the loss. The priced planner of a
config: a fork TE's fallback priced by its own scaling section."""

from __future__ import annotations

import pytest

from xds_mpi.cluster.autoscaler import Autoscaler, fork_source_pool_tes, priced_paths
from xds_mpi.cluster.scale_out import PricedPaths, TeScaling
from xds_mpi.config.autoscaler import AutoscalerConfig
from xds_mpi.config.schema import load_config
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.scaling.steps import scale_out

FIVE = (("Scaler-Pre", 1.0), ("TE-Pre-Load", 2.0), ("TE-Load", 0.5), ("Scaler-Post", 0.1))
DRAM = (("Scaler-Pre", 1.0), ("TE-Pre-Load", 2.0), ("TE-Load", 3.0), ("Scaler-Post", 0.1))


def paths(lost_at=None, steps=FIVE, fallback=DRAM) -> PricedPaths:
    """TEs 0..3 of one shape: 0 serving, 1-3 standby forking, falling back to dram."""
    fork = TeScaling(
        path="fork",
        steps=steps,
        fallback_path="dram",
        fallback_steps=fallback,
        same_shape=frozenset({0, 1, 2, 3}),
    )
    tes = [TeScaling(path="dram", steps=DRAM)] + [
        TeScaling(
            path=fork.path,
            steps=fork.steps,
            fallback_path=fork.fallback_path,
            fallback_steps=fork.fallback_steps,
            same_shape=fork.same_shape - {te},
        )
        for te in (1, 2, 3)
    ]
    return PricedPaths(tes, lost_at or {})


def test_a_fork_reads_from_the_least_loaded_serving_te_of_its_shape_ties_the_newest():
    p = paths()
    assert p.plan(2, 10.0, [0, 1], [5, 2, 0, 0]).source_te == 1  # a TE scaled out earlier
    assert p.plan(2, 10.0, [0, 1], [2, 5, 0, 0]).source_te == 0
    assert p.plan(3, 10.0, [0, 1, 2], [3, 3, 3, 0]).source_te == 2  # tie: the newest
    plan = p.plan(1, 10.0, [0], [0, 0, 0, 0])
    assert (plan.path, plan.source_te, plan.fallback_from, plan.fallback_s) == ("fork", 0, "", 0)
    assert plan.steps == FIVE


@pytest.mark.parametrize(
    "lost_s, te_load_s, source, fallback_s",
    [
        (13.2, 0.2 + 3.0, 0, 0.2 + 3.0 - 0.5),  # inside TE-Load [13.0, 13.5): 0.2 s forked
        (12.0, 0.0 + 3.0, 0, 3.0 - 0.5),  # after the decision, before TE-Load: nothing forked
        (13.5, 0.5, 0, 0.0),  # at TE-Load's end: the fork was done
    ],
    ids=["mid-fork", "before-te-load", "after"],
)
def test_a_source_lost_inside_te_load_makes_the_te_fall_back(lost_s, te_load_s, source, fallback_s):
    plan = paths({0: lost_s}).plan(1, 10.0, [0], [0, 0, 0, 0])
    assert dict(plan.steps)["TE-Load"] == pytest.approx(te_load_s)
    assert plan.source_te == source
    assert plan.fallback_s == pytest.approx(fallback_s)
    is_fallback = fallback_s > 0
    assert (plan.path, plan.fallback_from) == (("dram", "fork") if is_fallback else ("fork", ""))
    assert plan.total_s == pytest.approx(sum(s for _, s in FIVE) + fallback_s)


def test_a_source_lost_before_the_decision_is_none_and_with_none_left_the_te_falls_back():
    p = paths({0: 5.0})
    plan = p.plan(2, 10.0, [0, 1], [0, 9, 0, 0])  # TE 0 less loaded but lost: TE 1
    assert (plan.path, plan.source_te) == ("fork", 1)
    plan = p.plan(1, 10.0, [0], [0, 0, 0, 0])  # none alive: dram from the start
    assert (plan.path, plan.source_te, plan.fallback_from) == ("dram", -1, "fork")
    assert plan.fallback_s == pytest.approx(3.0 - 0.5)


def test_with_one_fixed_step_the_fallback_starts_it_over_at_the_loss():
    plan = paths({0: 10.3}, steps=(("scale-out", 0.5),)).plan(1, 10.0, [0], [0, 0, 0, 0])
    assert plan.steps == (("scale-out", pytest.approx(0.8)),)
    assert (plan.path, plan.fallback_s) == ("dram", pytest.approx(0.3))


def test_the_autoscaler_s_events_carry_the_plan():
    cfg = AutoscalerConfig(enabled=True, scale_out_above=2.0, scale_in_below=0.5, cooldown_s=1.0)
    s = Autoscaler(cfg, [2, 2, 2, 2], standby={1, 2, 3}, planner=paths({0: 13.2}))
    event = s.observe(10.0, [9, 0, 0, 0])
    assert (event.te, event.path, event.source_te, event.fallback_from) == (1, "dram", 0, "fork")
    assert event.serves_s == pytest.approx(10.0 + sum(s for _, s in FIVE) + 2.7)
    event = s.observe(20.0, [9, 9, 0, 0])  # TE 0 lost by now: TE 1 is the source, a chain
    assert (event.te, event.path, event.source_te) == (2, "fork", 1)


def test_the_priced_planner_prices_a_fork_te_s_fallback_by_its_own_scaling_section():
    groups = (
        "cluster.groups=[{count: 1, set: [deployment.dp_groups_per_domain=2]}, "
        "{count: 2, standby: true, set: [deployment.dp_groups_per_domain=2, scaling.path=fork]}]"
    )
    sets = [groups, "autoscaler.enabled=true", "autoscaler.fork_fallback=cold"]
    cfg = load_config("configs/colocated.yaml", sets)
    tes = DeploymentPlan.build(cfg, None, launcher_checks=False).cluster.tes
    p = priced_paths(cfg, tes)
    fork = p.tes[1]
    assert (fork.path, fork.fallback_path, fork.same_shape) == ("fork", "cold", {0, 2})
    cold = load_config("configs/colocated.yaml", ["scaling.path=cold"])
    assert fork.fallback_steps == scale_out(cold, num_dies=32, num_new_tes=1).steps
    assert p.tes[0].path == "dram"


def test_a_pool_te_of_a_fork_te_s_shape_is_a_fork_source():
    """TE 1 (pool, dram) has the fork TE 2's shape: a source, its slot reserved; TE 2 is read
    by no other fork TE, TE 3 (pool, 2 dies) has no fork TE's shape: neither is reserved (each
    is still in the planner's sources of a fork TE of its shape, none here)."""
    groups = (
        "cluster.groups=[{count: 1}, "
        "{count: 1, standby: true, pool: true, set: [scaling.path=dram]}, "
        "{count: 1, standby: true, pool: true, set: [scaling.path=fork]}, "
        "{count: 1, standby: true, pool: true, set: [deployment.dp_groups_per_domain=2]}]"
    )
    sets = [groups, "deployment.dp_groups_per_domain=1", "autoscaler.enabled=true"]
    cfg = load_config("configs/colocated.yaml", [*sets, "cluster.pool=2"])
    tes = DeploymentPlan.build(cfg, None, launcher_checks=False).cluster.tes
    assert priced_paths(cfg, tes).tes[2].same_shape == {0, 1}
    assert fork_source_pool_tes(cfg, tes) == {1}  # not TE 2: no other fork TE reads it
