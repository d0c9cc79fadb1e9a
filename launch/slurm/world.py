"""The job's world on nodes: one TE's ranks, laid out by servers (jobscript.py `node_layout`), or
a cluster's (docs/cluster.md: world rank 0 the JE, then each TE's ranks one TE after another),
laid out as whole TEs per node. `xds-mpi submit` and `xds-mpi run --hosts` place both alike.

A cluster's TE stays on one node: its dies' windows are one TE's (the JE talks to the TE-shells
with two-sided messages only), so the nodes meet only on the JE's link. The JE goes with TE 0,
on the first node. Among the ways to cut the TEs into contiguous runs, one per node, the layout
takes one whose largest node runs the fewest ranks, filling the first nodes first on a tie.
"""

from __future__ import annotations

from launch.slurm.jobscript import NodeLayout, World, node_layout
from xds_mpi.config.schema import ConfigError
from xds_mpi.plan.cluster import ClusterPlan
from xds_mpi.plan.deployment import DeploymentPlan


def world_of(plan: DeploymentPlan) -> World:
    """One TE's ranks as its plan has them, or a cluster's: the JE's 0 bytes, then each TE's own
    plan's (its group's shape), one TE after another."""
    topo = plan.topo
    if plan.cluster is None:
        return World(
            world_size=topo.world_size,
            num_host_ranks=topo.num_host_ranks,
            num_dies=topo.num_dies,
            summary=topo.summary(),
            window_bytes=tuple(plan.window_bytes),
        )
    cluster = plan.cluster
    te_plans = [_te_plan(plan, te) for te in range(cluster.num_tes)]
    launched = [(t, p) for t, p in zip(cluster.tes, te_plans, strict=True)]
    # a pool TE launches its TE-shell only; a pool rank may become the largest of its dies
    te_windows = tuple(n for t, p in launched for n in p.window_bytes[: t.num_launched])
    pool_die = max((max(p.window_bytes[1:]) for t, p in launched if t.is_pool), default=0)
    windows = (0,) * cluster.num_jes + te_windows + (pool_die,) * len(cluster.pool_ranks)
    assert len(windows) == cluster.world_size, (len(windows), cluster.world_size)
    return World(
        world_size=cluster.world_size,
        num_host_ranks=cluster.num_jes + sum(p.topo.num_host_ranks for p in te_plans),
        num_dies=sum(p.topo.num_dies for t, p in launched if not t.is_pool)
        + len(cluster.pool_ranks),
        summary=cluster.describe().splitlines()[0]
        + " (host ranks: the JEs, each TE-shell, each PD pair's JE and decode TE-shell)",
        window_bytes=windows,
    )


def _te_plan(plan: DeploymentPlan, te: int) -> DeploymentPlan:
    """TE `te`'s own plan (its group's config); a TE whose group's settings are TE 0's shares
    the plan already built."""
    cluster = plan.cluster
    if cluster.tes[te].overrides == cluster.tes[0].overrides:
        return plan  # the launcher's plan has TE 0's topology and windows
    return DeploymentPlan.build(plan.cfg, cluster.world_size, launcher_checks=False, te=te)


def world_layout(plan: DeploymentPlan, num_nodes: int | None = None) -> NodeLayout:
    """The job's ranks over `num_nodes` nodes (None: the default of its kind)."""
    if plan.cluster is None:
        return node_layout(plan.topo, num_nodes)
    return cluster_layout(plan.cluster, num_nodes)


def cluster_layout(cluster: ClusterPlan, num_nodes: int | None = None) -> NodeLayout:
    """Whole TEs per node, contiguous in world-rank order, the JE with TE 0 on the first node;
    by default one node per TE. More nodes than TEs are refused: a TE would span nodes."""
    num_tes = cluster.num_tes
    if num_nodes is None:
        num_nodes = 1 if cluster.pool_ranks else num_tes
    if cluster.pool_ranks and num_nodes > 1:
        raise ConfigError(
            f"{num_nodes} nodes (--nodes or --hosts) with cluster.pool({len(cluster.pool_ranks)}):"
            " a pool rank joins the TE of any pool TE-shell, so a cluster with a pool runs on one "
            "node; run it on one, or set cluster.pool=0"
        )
    if not 1 <= num_nodes <= num_tes:
        raise ConfigError(
            f"{num_nodes} nodes (--nodes or --hosts) for a cluster of {num_tes} TEs: a cluster "
            f"is placed as whole TEs per node, so it takes 1 to {num_tes} nodes (a TE spanning "
            "nodes is not supported)"
        )
    sizes = [t.num_launched for t in cluster.tes]  # [num_tes] ranks of each TE
    sizes[0] += cluster.num_jes  # the JEs, world ranks 0..J-1, run beside TE 0
    sizes[-1] += len(cluster.pool_ranks)  # after every TE (one node: refused otherwise)
    counts = _split(sizes, num_nodes, _least_largest(sizes, num_nodes))  # [num_nodes] TEs each
    tasks, names, first = [], [], 0
    for count in counts:
        tasks.append(sum(sizes[first : first + count]))
        jes = "JE + " if cluster.num_jes == 1 else f"{cluster.num_jes} JEs + "
        names.append((jes if first == 0 else "") + _te_range(first, first + count - 1))
        first += count
    why = (
        f"{num_tes} TEs, whole TEs per node in world-rank order, the JE on the first: "
        + "; ".join(f"node {i}: {name}" for i, name in enumerate(names))
    )
    return NodeLayout(tasks_per_node=tuple(tasks), why=why)


def _least_largest(sizes: list[int], num_nodes: int) -> int:
    """The fewest ranks the largest node can have when `sizes` are cut into `num_nodes`
    contiguous runs (a binary search on the largest node's ranks)."""
    low, high = max(sizes), sum(sizes)
    while low < high:
        cap = (low + high) // 2
        if _nodes_needed(sizes, cap) <= num_nodes:
            high = cap
        else:
            low = cap + 1
    return low


def _nodes_needed(sizes: list[int], cap: int) -> int:
    """Nodes of at most `cap` ranks that the runs, filled front first, take."""
    num_nodes, load = 1, 0
    for size in sizes:
        if load + size > cap:
            num_nodes, load = num_nodes + 1, 0
        load += size
    return num_nodes


def _split(sizes: list[int], num_nodes: int, cap: int) -> list[int]:
    """How many TEs each node runs: as many as fit under `cap`, front first, each node keeping
    at least one TE for every node after it."""
    counts, first = [], 0
    for node in range(num_nodes):
        last_allowed = len(sizes) - (num_nodes - node - 1)  # the later nodes' TEs stay
        end, load = first + 1, sizes[first]
        while end < last_allowed and load + sizes[end] <= cap:
            load += sizes[end]
            end += 1
        counts.append(end - first)
        first = end
    assert first == len(sizes), (sizes, num_nodes, cap, counts)
    return counts


def _te_range(first: int, last: int) -> str:
    return f"TE {first}" if first == last else f"TEs {first}-{last}"
