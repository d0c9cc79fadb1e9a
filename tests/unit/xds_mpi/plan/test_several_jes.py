"""Several JEs (`cluster.num_jes`, docs/cluster.md "Several JEs"): the plan puts them first (world
ranks 0..J-1) and the TEs after them, the link ranks follow, the nodes' layout carries them on the
first node, the frontend deals requests in arrival order, and what is not built with several JEs
is refused naming the key. No MPI."""

from __future__ import annotations

import pytest

from launch.slurm.world import world_layout, world_of
from ranks.cluster.je import deal
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.workload.requests import Request


def _plan(*sets: str) -> DeploymentPlan:
    return DeploymentPlan.build(load_config("configs/cluster.yaml", list(sets)), None)


def test_the_jes_come_first_and_every_te_after_them():
    one, three = _plan().cluster, _plan("cluster.num_jes=3").cluster
    assert three.world_size == one.world_size + 2 == 14
    assert [t.first_rank for t in three.tes] == [t.first_rank + 2 for t in one.tes] == [3, 6, 9]
    assert [three.shell(te) for te in range(3)] == [3, 4, 5]  # on the link, after the JEs
    assert three.te_of(1) == (-1, 0) and three.te_of(3) == (0, 0) and three.te_of(13) == (2, 4)
    plan = _plan("cluster.num_jes=3")
    world = world_of(plan)
    assert world.world_size == 14 and world.window_bytes[:3] == (0, 0, 0)
    layout = world_layout(plan, 2)
    assert sum(layout.tasks_per_node) == 14 and "3 JEs + TE" in layout.why


def test_the_frontend_deals_in_arrival_order():
    arrivals = [0.3, 0.1, 0.2, 0.1, 0.0]
    requests = [
        Request(req_id=i, prompt=(1, 2), max_new_tokens=2, arrival_s=t)
        for i, t in enumerate(arrivals)
    ]
    # arrival order: 4 (0.0), 1 (0.1), 3 (0.1), 2 (0.2), 0 (0.3)
    assert deal(requests, 2) == {4: 0, 1: 1, 3: 0, 2: 1, 0: 0}
    assert set(deal(requests, 1).values()) == {0}


@pytest.mark.parametrize(
    "sets, refused",
    [
        (("cluster.num_tes=1", "cluster.groups=[]"), "needs a cluster of TEs"),
        (("cluster.num_jes=0",), "cluster.num_jes must be > 0"),
        (("serve.enabled=true",), "cluster.num_jes > 1 (the endpoint runs on one JE)"),
    ],
)
def test_what_is_not_built_with_several_jes_is_refused_naming_the_key(sets, refused):
    with pytest.raises(ConfigError, match=refused.replace("(", r"\(").replace(")", r"\)")):
        _plan("cluster.num_jes=2", *sets)


def test_the_autoscaler_with_several_jes_is_refused():
    groups = (
        "cluster.groups=[{count: 1, set: [deployment.dp_groups_per_domain=2]}, "
        "{count: 1, standby: true, set: [deployment.dp_groups_per_domain=2]}]"
    )
    with pytest.raises(ConfigError, match="autoscaler.enabled with cluster.num_jes"):
        _plan(groups, "autoscaler.enabled=true", "cluster.num_jes=2")
