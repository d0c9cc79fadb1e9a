"""A cluster with a pool of ranks on nodes (launch/slurm/world.py): one node with every rank
(the pool ranks after the TEs), the pool ranks' window bytes the largest pool die's, and more
nodes refused, naming the key and the counts."""

from __future__ import annotations

import pytest

from launch.slurm.world import world_layout, world_of
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.deployment import DeploymentPlan

SETS = [
    "deployment.dp_groups_per_domain=1",
    "autoscaler.enabled=true",
    "cluster.pool=2",
    "cluster.groups=[{count: 1}, {count: 1, standby: true, pool: true}, "
    "{count: 1, standby: true, pool: true, set: [deployment.dp_groups_per_domain=2]}]",
]


def _plan():
    return DeploymentPlan.build(load_config("configs/colocated.yaml", SETS), None)


def test_a_pool_runs_on_one_node_with_every_rank():
    plan = _plan()
    assert world_layout(plan).tasks_per_node == (7,)
    windows = world_of(plan).window_bytes
    two_die = DeploymentPlan.build(plan.cfg, 7, launcher_checks=False, te=2).window_bytes
    # JE, TE 0's shell and die, TE 1's and TE 2's shells, then the pool: the 2-die TE's die
    assert windows[:5] == (0, 0, plan.window_bytes[1], 0, 0)
    assert windows[5:] == (max(two_die[1:]),) * 2


def test_more_nodes_with_a_pool_are_refused():
    with pytest.raises(ConfigError, match=r"2 nodes .* with cluster.pool\(2\)"):
        world_layout(_plan(), 2)
