"""The JE's routing policies (xds_mpi/cluster/policies/) on crafted TE states with known answers,
the JE's loads driven through `decide` without MPI (a long request then short ones: round_robin
and least_load must differ), and the cluster's plan (xds_mpi/plan/cluster.py)."""

from __future__ import annotations

from collections import deque

import pytest

from xds_mpi.cluster.loads import TeLoads
from xds_mpi.cluster.policies import TeState, check_policy, load_policy, policy_names
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.cluster import TeInfo
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.scheduling.admission import Completions, decide
from xds_mpi.workload.requests import Request

REQ = Request(req_id=0, prompt=(1, 2, 3), max_new_tokens=4)


def _states(*loads: tuple[int, int, int]) -> list[TeState]:
    """(unfinished requests, unfinished tokens, routed so far) per TE."""
    return [
        TeState(te=i, num_unfinished=n, unfinished_tokens=t, num_routed=r)
        for i, (n, t, r) in enumerate(loads)
    ]


def test_the_registry_finds_every_policy_module_by_name():
    assert {"least_load", "round_robin"} <= set(policy_names())
    with pytest.raises(ValueError, match="no routing policy 'fastest'; known: combined"):
        load_policy("fastest")


def test_round_robin_cycles_whatever_the_load():
    pick = load_policy("round_robin")
    assert pick(REQ, _states((9, 900, 0), (0, 0, 0), (0, 0, 0)), 0.0) == 0
    assert pick(REQ, _states((9, 900, 1), (0, 0, 0), (0, 0, 0)), 0.0) == 1
    assert pick(REQ, _states((9, 900, 1), (0, 0, 1), (0, 0, 0)), 0.0) == 2
    assert pick(REQ, _states((9, 900, 2), (0, 0, 2), (0, 0, 2)), 0.0) == 0  # 6 routed: 6 mod 3


def test_least_load_picks_the_fewest_unfinished_requests_then_tokens_then_the_lowest_te():
    pick = load_policy("least_load")
    assert pick(REQ, _states((3, 10, 5), (1, 900, 9), (2, 0, 0)), 0.0) == 1  # fewest requests
    assert pick(REQ, _states((2, 90, 5), (2, 40, 9), (3, 0, 0)), 0.0) == 1  # then fewest tokens
    assert pick(REQ, _states((1, 40, 5), (1, 40, 0)), 0.0) == 0  # then the lowest index


def _route(policy: str) -> list[int]:
    """A long request at 0 (finishing at 3.0 s) then short ones every 0.6 s (each finishing
    0.3 s after its arrival), routed to 2 TEs as the JE routes: each decision from the
    finishes up to its virtual time, the TEs reporting only up to `now_s`."""
    queue = deque(
        [Request(req_id=0, prompt=(1,) * 12, max_new_tokens=60, arrival_s=0.0)]
        + [
            Request(req_id=i, prompt=(1,) * 12, max_new_tokens=2, arrival_s=0.6 * i)
            for i in range(1, 5)
        ]
    )
    finish = {0: 3.0} | {i: 0.6 * i + 0.3 for i in range(1, 5)}
    loads, done, tes, after = TeLoads(2, load_policy(policy)), Completions(), [], 0.0
    now = None  # every TE idle at the start
    while queue:
        grant = decide(queue, loads, done, now_s=now, after_s=after)
        for d in grant.decisions:
            tes.append(d.group)
            done.add(d.req.req_id, finish[d.req.req_id])
            after = d.vtime_s
        now = grant.horizon_s  # the TEs reach the promise and report
    return tes


def test_a_long_request_then_short_ones_least_load_avoids_the_busy_te_round_robin_does_not():
    assert _route("round_robin") == [0, 1, 0, 1, 0]
    assert _route("least_load") == [0, 1, 1, 1, 1]


def test_the_loads_are_the_state_at_the_decision_s_virtual_time():
    loads = TeLoads(2, load_policy("least_load"))
    queue = deque(
        [
            Request(req_id=i, prompt=(1,), max_new_tokens=1, arrival_s=a)
            for i, a in enumerate((0.0, 0.0, 0.5))
        ]
    )
    done = Completions()
    decide(queue, loads, done, now_s=0.0, after_s=0.0)  # 0 -> TE 0, 1 -> TE 1
    done.add(0, 0.7)  # known by now, but at 0.5 request 0 still ran on TE 0
    done.add(1, 0.4)
    grant = decide(queue, loads, done, now_s=1.0, after_s=0.0)
    assert [(d.req.req_id, d.group, d.vtime_s) for d in grant.decisions] == [(2, 1, 0.5)]
    assert [s.num_unfinished for s in loads.states()] == [1, 1]  # 0 finishes at 0.7, not yet


def test_a_cluster_plan_is_one_te_s_plan_plus_the_je_and_every_te_s_world_ranks():
    cfg = load_config(
        "configs/colocated.yaml", ["cluster.num_tes=2", "deployment.dp_groups_per_domain=2"]
    )
    plan = DeploymentPlan.build(cfg, 7, launcher_checks=False)
    assert plan.topo.world_size == 3 and plan.world_size == 7
    assert plan.cluster.tes == tuple(
        TeInfo(te=k, first_rank=1 + 3 * k, size=3, kind="colocated", num_dies=2, group="colocated")
        for k in range(2)
    )
    assert [plan.cluster.te_of(r) for r in range(7)] == [
        (-1, 0),
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert "TE 1 (colocated, 2 dies): world ranks 4..6 (TE-shell 4;" in (plan.cluster.describe())
    with pytest.raises(ConfigError, match=r"world size 8 is not the cluster's 7"):
        DeploymentPlan.build(cfg, 8, launcher_checks=False)


def test_groups_make_tes_of_different_kinds_each_with_its_own_config():
    pd_pair = [
        "pd.enabled=true",
        "deployment.num_host_ranks=2",
        "deployment.num_prefill_dies=1",
        "deployment.dp_groups_per_domain=2",
        "xccl.p2p_pairs=prefill_to_decode",
    ]
    groups = (
        f"cluster.groups=[{{count: 2, set: [deployment.dp_groups_per_domain=2]}}, "
        f"{{count: 1, name: pair, set: [{', '.join(pd_pair)}]}}]"
    )
    cfg = load_config("configs/colocated.yaml", [groups])
    assert cfg.cluster.num_tes == 3
    plan = DeploymentPlan.build(cfg, None, launcher_checks=False)
    tes = plan.cluster.tes
    assert [(t.kind, t.size, t.num_dies, t.first_rank, t.group) for t in tes] == [
        ("colocated", 3, 2, 1, "colocated"),
        ("colocated", 3, 2, 4, "colocated"),
        ("pd", 5, 3, 7, "pair"),
    ]
    assert plan.world_size == 12 and plan.cluster.te_of(11) == (2, 4)
    pair = DeploymentPlan.build(cfg, 12, launcher_checks=False, te=2)
    assert pair.cfg.pd.enabled and pair.pd is not None and pair.topo.world_size == 5
    assert plan.cfg is cfg and not plan.cfg.pd.enabled  # the JE's: the config as given
    with pytest.raises(ConfigError, match=r"groups\[0\].set: 'model.hidden=64' sets model"):
        load_config("configs/colocated.yaml", ["cluster.groups=[{set: [model.hidden=64]}]"])
    one_host = load_config(
        "configs/colocated.yaml", ["cluster.groups=[{count: 2, set: [pd.enabled=true]}]"]
    )
    with pytest.raises(ConfigError, match=r"cluster.groups\[0\]: .*num_host_ranks other than 2"):
        DeploymentPlan.build(one_host, None, launcher_checks=False)


def test_one_te_is_today_s_plan():
    cfg = load_config("configs/colocated.yaml")
    plan = DeploymentPlan.build(cfg, None, launcher_checks=False)
    assert plan.cluster is None and plan.world_size == plan.topo.world_size == 5


@pytest.mark.parametrize(
    "config, sets, refused",
    [
        ("colocated", ["run.clock=wall"], "run.clock=wall"),
        ("pd", ["deployment.num_host_ranks=1"], "num_host_ranks other than 2"),
    ],
)
def test_what_phase_1_does_not_build_is_refused_naming_the_key(config, sets, refused):
    cfg = load_config(f"configs/{config}.yaml", ["cluster.num_tes=2", *sets])
    with pytest.raises(ConfigError, match=refused):
        DeploymentPlan.build(cfg, None, launcher_checks=False)


def test_a_lost_te_is_no_candidate_and_the_losses_are_checked():
    for policy in ("round_robin", "least_load"):
        loads = TeLoads(3, load_policy(policy))
        loads.lost.add(1)
        picked = []
        for i in range(4):
            req = Request(req_id=i, prompt=(1, 2), max_new_tokens=4, arrival_s=0.1 * i)
            te = loads.pick(req)
            loads.on_dispatch(te, req)
            picked.append(te)
        assert 1 not in picked and set(picked) == {0, 2}, policy
    cfg = load_config(
        "configs/cluster.yaml", ["cluster.te_losses=[{te: 2, at_s: 1}, {te: 0, at_s: 0.5}]"]
    )
    assert [(loss.te, loss.at_s) for loss in cfg.cluster.te_losses] == [(0, 0.5), (2, 1.0)]
    for rows, refused in [
        ("[{te: 3, at_s: 1}]", r"te must be a TE \(0..2\)"),
        ("[{te: 0, at_s: 1}, {te: 0, at_s: 2}]", "a TE is lost twice"),
        ("[{te: 0, at_s: 1}, {te: 1, at_s: 1}, {te: 2, at_s: 1}]", "every TE of 3 is lost"),
    ]:
        with pytest.raises(ConfigError, match=refused):
            load_config("configs/cluster.yaml", [f"cluster.te_losses={rows}"])


def test_an_unknown_policy_is_refused_at_validate_naming_the_known_ones():
    cfg = load_config("configs/colocated.yaml", ["cluster.num_tes=2", "cluster.policy=fastest"])
    with pytest.raises(ConfigError, match=r"cluster.policy\(fastest\) is no routing policy; known"):
        check_policy(cfg)
