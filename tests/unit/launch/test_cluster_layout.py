"""A cluster's ranks on nodes (launch/slurm/world.py): whole TEs per node in world-rank order, the
JE on the first, the largest node as small as such a cut allows; the world's windows rank by rank
(the JE's, then each TE's own plan's); the hostfile `--hosts` writes from that layout. No MPI."""

from __future__ import annotations

import itertools

import pytest
from harness import REPO_ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from launch.job.hosts import hostfile_text
from launch.slurm.jobscript import window_mib_per_node
from launch.slurm.world import cluster_layout, world_layout, world_of
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.cluster import ClusterPlan, TeInfo
from xds_mpi.plan.deployment import DeploymentPlan

CLUSTER = REPO_ROOT / "configs" / "cluster.yaml"  # JE + 3 + 3 + 5 ranks


@pytest.fixture(scope="module")
def cluster_plan() -> DeploymentPlan:
    return DeploymentPlan.build(load_config(CLUSTER), launcher_checks=False)


def crafted(*sizes: int) -> ClusterPlan:
    """A cluster of TEs of these sizes (colocated: a TE-shell and size - 1 dies)."""
    tes, first = [], 1
    for te, size in enumerate(sizes):
        tes.append(
            TeInfo(
                te=te, first_rank=first, size=size, kind="colocated", num_dies=size - 1, group="g"
            )
        )
        first += size
    return ClusterPlan(tes=tuple(tes), policy="round_robin")


@pytest.mark.parametrize(
    "num_nodes, expected",
    [
        (None, (4, 3, 5)),  # one node per TE, the JE beside TE 0
        (3, (4, 3, 5)),
        # [JE + TE 0 + TE 1, TE 2] = [7, 5] against [JE + TE 0, TE 1 + TE 2] = [4, 8]: the
        # largest node runs 7 ranks, not 8.
        (2, (7, 5)),
        (1, (12,)),
    ],
)
def test_cluster_yaml_is_cut_into_whole_tes_with_the_smallest_largest_node(
    cluster_plan, num_nodes, expected
):
    assert [t.size for t in cluster_plan.cluster.tes] == [3, 3, 5]
    layout = world_layout(cluster_plan, num_nodes)
    assert layout.tasks_per_node == expected
    assert sum(layout.tasks_per_node) == cluster_plan.world_size == 12


def test_the_layout_says_which_tes_run_on_which_node(cluster_plan):
    assert world_layout(cluster_plan, 2).why.endswith("node 0: JE + TEs 0-1; node 1: TE 2")
    assert world_layout(cluster_plan).why.endswith("node 0: JE + TE 0; node 1: TE 1; node 2: TE 2")


@pytest.mark.parametrize("num_nodes", [0, 4, 12])
def test_more_nodes_than_tes_or_none_are_refused(cluster_plan, num_nodes):
    message = f"{num_nodes} nodes .* cluster of 3 TEs: .* 1 to 3 nodes .* spanning nodes"
    with pytest.raises(ConfigError, match=message):
        world_layout(cluster_plan, num_nodes)


def reference_layout(sizes: list[int], num_nodes: int) -> tuple[int, ...]:
    """Every contiguous cut of JE + the TEs into num_nodes runs: the smallest largest node, and
    among those the cut whose nodes, first to last, are fullest (lexicographically largest)."""
    units = [sizes[0] + 1, *sizes[1:]]
    cuts = []
    for inner in itertools.combinations(range(1, len(units)), num_nodes - 1):
        bounds = (0, *inner, len(units))
        cuts.append(tuple(sum(units[a:b]) for a, b in itertools.pairwise(bounds)))
    least = min(max(cut) for cut in cuts)
    return max(cut for cut in cuts if max(cut) == least)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.data())
def test_the_layout_equals_a_search_of_every_cut(sizes, data):
    num_nodes = data.draw(st.integers(1, len(sizes)))
    layout = cluster_layout(crafted(*sizes), num_nodes)
    assert layout.tasks_per_node == reference_layout(sizes, num_nodes)


@pytest.mark.parametrize(
    "sizes, num_nodes, expected",
    [
        ((17, 17, 17, 17), 2, (35, 34)),  # four 16-die TEs, two per node
        ((5, 1, 1, 1, 5), 2, (7, 7)),  # [JE + 5 + 1, 1 + 1 + 5]
        ((3, 4, 4), 2, (8, 4)),  # [4, 8] and [8, 4] tie at 8: the first node fuller
        ((1, 9, 1), 2, (2, 10)),  # the large middle TE goes with the last: [2, 10] < [11, 1]
        ((3, 3, 3), 3, (4, 3, 3)),
    ],
)
def test_crafted_clusters(sizes, num_nodes, expected):
    assert cluster_layout(crafted(*sizes), num_nodes).tasks_per_node == expected


def test_the_worlds_windows_are_the_jes_then_each_tes_own(cluster_plan):
    """The colocated TEs' windows are TE 0's plan's; the PD pair's are its own, not TE 0's."""
    cfg = cluster_plan.cfg
    world = world_of(cluster_plan)
    te_windows = [
        DeploymentPlan.build(cfg, 12, launcher_checks=False, te=te).window_bytes for te in range(3)
    ]
    assert world.window_bytes == (0, *te_windows[0], *te_windows[1], *te_windows[2])
    assert te_windows[0] == te_windows[1] == cluster_plan.window_bytes
    assert len(te_windows[2]) == 5 and te_windows[2][:2] == (0, 0)  # the pair's JE, decode shell
    assert sum(te_windows[2]) != sum(te_windows[0])  # the old 3 x TE 0's would be wrong
    assert (world.world_size, world.num_host_ranks, world.num_dies) == (12, 5, 7)
    host_ranks = [r for r, n in enumerate(world.window_bytes) if n == 0]
    assert host_ranks == [0, 1, 4, 7, 8]  # the JE, two TE-shells, the pair's JE and decode shell


def test_each_nodes_windows_are_the_windows_of_its_tes(cluster_plan):
    world = world_of(cluster_plan)
    layout = world_layout(cluster_plan, 2)
    mib = 1 << 20
    node0, node1 = world.window_bytes[:7], world.window_bytes[7:]
    assert window_mib_per_node(layout, world.window_bytes) == (
        -(-sum(node0) // mib),
        -(-sum(node1) // mib),
    )


def test_a_single_te_is_laid_out_by_servers_as_before():
    plan = DeploymentPlan.build(
        load_config(REPO_ROOT / "configs" / "colocated.yaml"), launcher_checks=False
    )
    world = world_of(plan)
    assert world.window_bytes == plan.window_bytes
    assert world.summary == plan.topo.summary()
    assert world_layout(plan).tasks_per_node == (plan.topo.world_size,)


@pytest.mark.parametrize(
    "flavor, text",
    [("mpich", "h0:7\nh1:5\n"), ("openmpi", "h0 slots=7\nh1 slots=5\n")],
)
def test_the_hostfile_runs_whole_tes_on_each_host(cluster_plan, flavor, text):
    assert hostfile_text(world_layout(cluster_plan, 2), ("h0", "h1"), flavor) == text
