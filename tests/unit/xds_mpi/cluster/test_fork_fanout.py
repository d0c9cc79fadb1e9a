"""Fork groups (xds_mpi/cluster/fork_fanout.py) with known answers: forks decided while an earlier
fork of their shape is in TE-Load share its source and are priced as its 2nd, 3rd ... receiver;
a fork after the group's TE-Load opens a new group (its source may be a TE of the old group: the
chain); a group whose source is no candidate any more takes no joiner; the priced planner's
k-th receiver is `scale_out(num_new_tes=k)`'s TE-Load (1, 8 and 32 TEs)."""

from __future__ import annotations

import pytest

from xds_mpi.cluster.autoscaler import Autoscaler, priced_paths
from xds_mpi.cluster.scale_out import PricedPaths, TeScaling
from xds_mpi.config.autoscaler import AutoscalerConfig
from xds_mpi.config.schema import load_config
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.scaling.steps import scale_out


def steps(k: int) -> tuple[tuple[str, float], ...]:
    """The k-th receiver's steps: TE-Load 0.5 s + 0.01 s per receiver before it."""
    return (("Scaler-Pre", 0.0), ("TE-Load", 0.5 + 0.01 * (k - 1)), ("Scaler-Post", 0.1))


def planner(num_tes: int = 5, fanout: int = 1) -> PricedPaths:
    """TE 0 serving (dram), TEs 1.. standby forking, all of one shape; a source feeds `fanout`
    at once."""
    every = frozenset(range(num_tes))
    fork = [
        TeScaling(
            path="fork",
            steps=steps(1),
            fallback_path="dram",
            fallback_steps=steps(1),
            same_shape=every - {te},
            fanout_steps=tuple(steps(k) for k in range(1, num_tes)),
            fanout=fanout,
        )
        for te in range(1, num_tes)
    ]
    return PricedPaths([TeScaling(path="dram", steps=steps(1)), *fork], {})


def decide(p: PricedPaths, te: int, now_s: float, serving: list[int]):
    plan = p.plan(te, now_s, serving, [0] * len(p.tes))
    p.taken(te, now_s, plan)
    return plan


def test_forks_inside_one_te_load_share_the_source_and_are_priced_as_its_receivers():
    p = planner()
    first = decide(p, 1, 10.0, [0])  # TE-Load [10.0, 10.5)
    second = decide(p, 2, 10.2, [0])  # inside it: the same source, the 2nd receiver
    third = decide(p, 3, 10.2, [0])  # the same decision time: the 3rd
    assert [(x.source_te, x.fork_group, x.fork_receivers) for x in (first, second, third)] == [
        (0, 1, 1),
        (0, 1, 2),
        (0, 1, 3),
    ]
    assert (second.steps, third.steps) == (steps(2), steps(3))
    # after the group's last TE-Load (10.2 + 0.52 = 10.72): a new group, TE 1 now a source
    late = decide(p, 4, 10.8, [0, 1, 2, 3])
    assert (late.fork_group, late.fork_receivers, late.steps) == (4, 1, steps(1))
    assert late.source_te == 3  # least loaded, ties: the newest (the chain)
    assert [[m.te for m in g.members] for g in p.forks.groups] == [[1, 2, 3], [4]]


def test_with_a_fan_out_a_join_slows_the_members_still_loading():
    """fork_fanout 4: the source feeds the group's first 4 at once, so each join prices the
    members still in TE-Load as the group's k-th receiver; one whose TE-Load ended keeps it."""
    p = planner(fanout=4)
    decide(p, 1, 10.0, [0])  # TE-Load [10.0, 10.5)
    assert [r.te for r in p.taken(2, 10.2, p.plan(2, 10.2, [0], [0] * 5))] == [1]
    third = p.plan(3, 10.2, [0], [0] * 5)
    repriced = p.taken(3, 10.2, third)
    assert [(r.te, r.steps) for r in repriced] == [(1, steps(3)), (2, steps(3))]
    ends = [m.load_end_s for m in p.forks.groups[0].members]
    assert ends == pytest.approx([10.52, 10.72, 10.72])
    # TE 1's TE-Load ended (10.52) before this join at 10.6: it keeps its times
    assert [r.te for r in p.taken(4, 10.6, p.plan(4, 10.6, [0], [0] * 5))] == [2, 3]
    ends = [m.load_end_s for m in p.forks.groups[0].members]
    assert ends == pytest.approx([10.52, 10.73, 10.73, 11.13])


def test_with_the_chain_a_join_slows_none_before_it():
    p = planner(fanout=1)
    decide(p, 1, 10.0, [0])
    assert p.taken(2, 10.2, p.plan(2, 10.2, [0], [0] * 5)) == []


def test_the_autoscaler_moves_a_repriced_member_s_serving_time():
    cfg = AutoscalerConfig(
        enabled=True, window_s=0.1, scale_out_above=1, scale_in_below=0.5, cooldown_s=0
    )
    scaler = Autoscaler(cfg, [2] * 4, {1, 2, 3}, planner(4, fanout=4))
    for now_s in (1.0, 1.1, 1.2):
        scaler.observe(now_s, [10, 0, 0, 0])
    # each priced as the 3rd receiver from its decision (the chain: 1.6, 1.71, 1.82)
    assert [e.serves_s for e in scaler.events] == pytest.approx([1.62, 1.72, 1.82])
    assert [dict(e.steps)["TE-Load"] for e in scaler.events] == pytest.approx([0.52] * 3)
    assert scaler.serving(1.61) == [0] and scaler.serving(1.62) == [0, 1]


def test_a_group_whose_source_is_no_candidate_takes_no_joiner():
    p = planner()
    decide(p, 1, 10.0, [0, 2])  # TE 2 serving too; the least loaded newest: 2
    assert p.forks.groups[0].source_te == 2
    plan = decide(p, 3, 10.1, [0])  # TE 2 drained meanwhile: a group of its own from TE 0
    assert (plan.source_te, plan.fork_group, plan.fork_receivers) == (0, 3, 1)


def test_the_autoscaler_writes_each_fork_s_group_in_its_events():
    cfg = AutoscalerConfig(
        enabled=True, window_s=0.1, scale_out_above=1, scale_in_below=0.5, cooldown_s=0
    )
    scaler = Autoscaler(cfg, [2] * 4, {1, 2, 3}, planner(4))
    for now_s in (1.0, 1.1, 1.2):
        scaler.observe(now_s, [10, 0, 0, 0])
    assert [(e.te, e.fork_group, e.fork_receivers) for e in scaler.events] == [
        (1, 1, 1),
        (2, 1, 2),
        (3, 1, 3),
    ]
    assert [e.serves_s for e in scaler.events] == pytest.approx([1.6, 1.71, 1.82])


@pytest.mark.parametrize("num_new_tes", [1, 8, 32])
def test_the_k_th_receiver_is_priced_by_the_fan_out_model(num_new_tes):
    num_tes = num_new_tes + 1
    groups = (
        f"cluster.groups=[{{count: 1}}, {{count: {num_new_tes}, standby: true, "
        "set: [scaling.path=fork]}]"
    )
    sets = [f"cluster.num_tes={num_tes}", "autoscaler.enabled=true", groups]
    cfg = load_config("configs/colocated.yaml", sets)
    tes = DeploymentPlan.build(cfg, None, launcher_checks=False).cluster.tes
    paths = priced_paths(cfg, tes)
    fork_cfg = load_config("configs/colocated.yaml", ["scaling.path=fork"])
    expected = scale_out(fork_cfg, num_dies=cfg.autoscaler.pod_dies, num_new_tes=num_new_tes)
    assert paths.tes[1].steps_for(num_new_tes) == expected.steps
    # docs/scaling.md: the chain's TE-Load grows little, 0.599 / 0.602 / 0.614 s
    te_load = {1: 0.599, 8: 0.602, 32: 0.614}[num_new_tes]
    assert dict(paths.tes[1].steps_for(num_new_tes))["TE-Load"] == pytest.approx(te_load, abs=5e-4)
