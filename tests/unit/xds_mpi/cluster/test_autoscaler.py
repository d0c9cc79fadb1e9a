"""The JE's autoscaler (xds_mpi/cluster/autoscaler.py) on crafted loads with known answers: it
scales out above the threshold (the new TE serving scale_out_s later), waits out the cooldown,
stays within max_tes and min_tes, drains the least loaded TE below the threshold, and a drained
TE is standby again once its last request finished; the plan's refusals (max_tes or min_tes
above the TEs there are); the SLO metric's TTFT and TPOT misses; a lost TE."""

from __future__ import annotations

import pytest

from xds_mpi.cluster.autoscaler import Autoscaler, scale_out_s, scale_out_steps
from xds_mpi.config.autoscaler import AutoscalerConfig
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.scaling.steps import scale_out

INF = float("inf")


def scaler(**kw) -> Autoscaler:
    cfg = AutoscalerConfig(
        enabled=True,
        window_s=1.0,
        scale_out_above=2.0,
        scale_in_below=0.5,
        cooldown_s=3.0,
        scale_out_s=2.0,
        **kw,
    )
    return Autoscaler(cfg, [2, 2, 2], standby={1, 2}, planner=[(("load", 1.5), ("post", 0.5))] * 3)


def test_it_scales_out_above_the_threshold_and_the_new_te_serves_later():
    s = scaler()
    assert s.serving(0.0) == [0]
    assert s.observe(0.5, [3, 0, 0]) is None  # 1.5 per die: below 2
    event = s.observe(0.6, [6, 0, 0])  # window mean (1.5 + 3) / 2 = 2.25 > 2
    assert (event.kind, event.te, event.decided_s, event.serves_s) == ("out", 1, 0.6, 2.6)
    assert event.steps == (("load", 1.5), ("post", 0.5))
    assert s.serving(2.5) == [0] and s.serving(2.6) == [0, 1]
    assert s.observe(2.0, [9, 0, 0]) is None  # cooldown until 3.6
    event = s.observe(3.6, [9, 0, 0])
    assert (event.kind, event.te, event.serves_s) == ("out", 2, 5.6)
    assert s.observe(7.0, [9, 9, 9]) is None  # no standby TE left


def test_max_tes_caps_the_serving_tes_and_those_scaling_out_count():
    s = scaler(max_tes=2)
    assert s.observe(0.0, [9, 0, 0]).te == 1
    assert s.observe(3.0, [9, 0, 0]) is None  # TE 1 is still coming: 1 + 1 = max_tes
    assert s.observe(4.0, [9, 9, 0]) is None  # both serve: max_tes


def test_it_drains_the_least_loaded_te_below_the_threshold_and_it_is_standby_again():
    s = scaler()
    s.observe(0.0, [9, 0, 0])  # TE 1 out, serving from 2.0
    event = s.observe(10.0, [1, 0, 0])  # 0.25 per die over the serving TEs 0 and 1
    assert (event.kind, event.te) == ("in", 1)  # the least loaded (ties: the higher index)
    assert s.serving(10.0) == [0]
    assert s.observe(20.0, [0, 0, 0]) is None  # min_tes 1: TE 0 stays
    s.drained(1)
    assert s.serves_from[1] == INF  # standby: the next scale-out may take it again
    assert s.observe(30.0, [9, 0, 0]).te == 1


def test_a_te_drained_with_nothing_unfinished_is_standby_at_once():
    s = scaler()
    s.observe(0.0, [9, 0, 0])  # TE 1 out, serving from 2.0
    event = s.observe(10.0, [1, 0, 0])  # TE 1 drained with no request: no finish will come
    assert (event.kind, event.te) == ("in", 1) and s.serves_from[1] == INF
    assert s.observe(20.0, [9, 0, 0]).te == 1  # the next scale-out takes it again


def test_the_plan_refuses_standby_without_the_autoscaler_and_the_reverse():
    groups = (
        "cluster.groups=[{count: 1, set: [deployment.dp_groups_per_domain=2]}, "
        "{count: 1, standby: true, set: [deployment.dp_groups_per_domain=2]}]"
    )
    for sets, refused in [
        ([groups], "standby .* autoscaler.enabled is false"),
        (["autoscaler.enabled=true"], "autoscaler.enabled needs a cluster"),
        (
            [groups, "autoscaler.enabled=true", "autoscaler.max_tes=3"],
            r"max_tes\(3\) / min_tes\(1\) asks more TEs than the cluster has: 2 \(1 serving "
            r"from the start \+ 1 standby\).* max_tes at most 2",
        ),
        (
            [groups, "autoscaler.enabled=true", "autoscaler.min_tes=3", "autoscaler.max_tes=3"],
            r"min_tes\(3\) asks more TEs than the cluster has: 2",
        ),
        (["autoscaler.enabled=true", "autoscaler.scale_in_below=5"], "must be below"),
    ]:
        with pytest.raises(ConfigError, match=refused):
            DeploymentPlan.build(
                load_config("configs/colocated.yaml", sets), None, launcher_checks=False
            )
    plan = DeploymentPlan.build(
        load_config("configs/colocated.yaml", [groups, "autoscaler.enabled=true"]),
        None,
        launcher_checks=False,
    )
    assert [t.standby for t in plan.cluster.tes] == [False, True]
    assert "TE 1 (colocated, standby, 2 dies)" in plan.cluster.describe()


def test_the_scale_out_time_is_the_config_s_or_the_priced_steps_of_the_te_s_own_path():
    groups = (
        "cluster.groups=[{count: 1, set: [deployment.dp_groups_per_domain=2]}, "
        "{count: 1, standby: true, set: [deployment.dp_groups_per_domain=2, scaling.path=cold]}]"
    )
    cfg = load_config("configs/colocated.yaml", [groups, "autoscaler.enabled=true"])
    te = DeploymentPlan.build(cfg, None, launcher_checks=False).cluster.tes[1]
    cold = load_config("configs/colocated.yaml", ["scaling.path=cold"])
    priced = scale_out(cold, num_dies=32, num_new_tes=1).total_s
    assert scale_out_s(cfg, te) == priced > 100  # the group's own path: from storage
    steps = scale_out_steps(cfg, te)
    assert [name for name, _ in steps] == [
        name for name, _ in scale_out(cold, num_dies=32, num_new_tes=1).steps
    ] and len(steps) == 5
    dram = scale_out(cfg, num_dies=32, num_new_tes=1).total_s
    assert 1 < dram < 10 and dram != priced
    fixed = load_config(
        "configs/colocated.yaml", [groups, "autoscaler.enabled=true", "autoscaler.scale_out_s=1.5"]
    )
    assert scale_out_s(fixed, te) == 1.5


def test_the_slo_metric_is_the_share_of_ttft_misses_finished_in_the_window():
    cfg = AutoscalerConfig(
        enabled=True,
        metric="slo",
        window_s=1.0,
        scale_out_above=0.5,
        scale_in_below=0.1,
        cooldown_s=3.0,
        scale_out_s=2.0,
    )
    s = Autoscaler(cfg, [2, 2], standby={1}, planner=[(("load", 2.0),)] * 2, slo_ttft_s=1.0)
    assert s.observe(0.5, [9, 0]) is None  # no finish yet: no information, no event
    s.finished(1.2, 2.0)  # TTFT 2 s: missed
    s.finished(1.4, 0.3)
    s.finished(5.0, 3.0)  # known early (a TE ahead), counts only from 5.0 on
    event = s.observe(1.3, [9, 0])  # one finish by 1.3, missed: share 1.0 > 0.5
    assert (event.kind, event.te, event.load) == ("out", 1, 1.0)
    s2 = Autoscaler(cfg, [2, 2], standby={1}, planner=[(("load", 2.0),)] * 2, slo_ttft_s=1.0)
    for finish_s, ttft_s in ((1.2, 2.0), (1.4, 0.3), (1.45, 0.2), (5.0, 3.0)):
        s2.finished(finish_s, ttft_s)
    assert s2.observe(1.5, [9, 0]) is None  # 1 of 3 missed: 0.33, between the thresholds
    event = s2.observe(5.0, [9, 0])  # only the 5.0 finish in (4.0, 5.0]: 1 of 1
    assert (event.kind, event.te, event.load) == ("out", 1, 1.0)
    with pytest.raises(ConfigError, match="at most 1"):
        AutoscalerConfig(enabled=True, metric="slo", scale_out_above=2.0, scale_in_below=0.1)


def slo_scaler() -> Autoscaler:
    cfg = AutoscalerConfig(
        enabled=True,
        metric="slo",
        window_s=10.0,
        scale_out_above=0.4,
        scale_in_below=0.1,
        cooldown_s=3.0,
        scale_out_s=2.0,
    )
    planner = [(("load", 2.0),)] * 2
    return Autoscaler(cfg, [2, 2], standby={1}, planner=planner, slo_ttft_s=1.0, slo_tpot_s=0.05)


@pytest.mark.parametrize(
    "ttft_s, tpot_s, is_missed",
    [
        (0.5, 0.02, False),  # both met
        (1.5, 0.02, True),  # TTFT missed
        (0.5, 0.08, True),  # TPOT missed
        (1.5, 0.08, True),  # both missed
        (0.5, float("nan"), False),  # one token: no TPOT to miss
        (1.0, 0.05, False),  # at the SLOs: met (a miss is above them)
    ],
    ids=["met", "ttft", "tpot", "both", "one-token", "at-slo"],
)
def test_the_slo_metric_counts_a_finish_missed_if_its_ttft_or_its_tpot_missed(
    ttft_s, tpot_s, is_missed
):
    s = slo_scaler()
    s.finished(1.0, 0.1, 0.01)  # one met finish beside it: the share is 1/2 or 0
    s.finished(2.0, ttft_s, tpot_s)
    event = s.observe(3.0, [0, 0])
    if is_missed:  # 1 of 2: 0.5 > 0.4, out
        assert (event.kind, event.te, event.load) == ("out", 1, 0.5)
    else:  # 0 of 2: below scale_in_below, but min_tes 1 keeps TE 0
        assert event is None and s.finishes == [(1.0, False), (2.0, False)]


def test_a_lost_te_serves_no_more_is_no_standby_te_and_no_drain():
    s = scaler()
    s.observe(0.0, [9, 0, 0])  # TE 1 out, serving from 2.0
    s.lose(2)  # a standby TE lost: the next scale-out has none
    assert s.observe(5.0, [9, 9, 0]) is None
    s.lose(1)
    assert s.serving(10.0) == [0]
    assert s.observe(10.0, [0, 0, 0]) is None  # min_tes 1: TE 0 stays, TE 1 is no drain
