"""A cluster with a pool of ranks (`cluster.pool`, `pool: true` groups; xds_mpi/plan/cluster.py):
the world's layout (a pool TE launches its TE-shell only, the pool ranks follow every TE), and
the refusals, each naming the key and the numbers."""

from __future__ import annotations

import pytest

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.deployment import DeploymentPlan

SERVING = "{count: 1, set: [deployment.dp_groups_per_domain=2]}"
POOL2 = "{count: 1, standby: true, pool: true, set: [deployment.dp_groups_per_domain=2]}"
POOL4 = "{count: 1, standby: true, pool: true, set: [deployment.dp_groups_per_domain=4]}"


def _plan(groups: str, *sets: str):
    cfg = load_config(
        "configs/colocated.yaml",
        [f"cluster.groups=[{groups}]", "autoscaler.enabled=true", *sets],
    )
    return DeploymentPlan.build(cfg, None, launcher_checks=False).cluster


def test_a_pool_te_launches_its_te_shell_only_and_the_pool_follows_the_tes():
    cluster = _plan(f"{SERVING}, {POOL2}, {POOL4}", "cluster.pool=4")
    # JE 0; TE 0: 1..3; TE 1's TE-shell 4; TE 2's TE-shell 5; the pool 6..9
    assert [(t.first_rank, t.size, t.num_launched, t.is_pool) for t in cluster.tes] == [
        (1, 3, 3, False),
        (4, 3, 1, True),
        (5, 5, 1, True),
    ]
    assert cluster.pool_ranks == (6, 7, 8, 9)
    assert cluster.world_size == 10
    assert [cluster.te_of(r) for r in (4, 5, 6)] == [(1, 0), (2, 0), (-1, 0)]
    assert cluster.is_pool_rank(6) and not cluster.is_pool_rank(5)
    # the same TEs standby and launched whole: 3 + 3 + 5 + the JE
    fixed = _plan(
        SERVING
        + ", "
        + POOL2.replace(" pool: true,", "")
        + ", "
        + POOL4.replace(" pool: true,", "")
    )
    assert fixed.world_size == 12
    assert "pool: world ranks 6..9 (4 ranks" in cluster.describe()


@pytest.mark.parametrize(
    "groups, sets, refused",
    [
        (
            f"{SERVING}, {POOL2}, {POOL4}",
            ("cluster.pool=3",),
            r"cluster.pool\(3\) is smaller than the 4 dies of cluster TE 2 .*cluster.pool >= 4",
        ),
        (
            f"{SERVING}, {POOL2}",
            (),
            r"say pool: true but cluster.pool is 0.*at least 2",
        ),
        (
            f"{SERVING}, {{count: 1, standby: true, set: [deployment.dp_groups_per_domain=2]}}",
            ("cluster.pool=2",),
            r"cluster.pool\(2\) ranks but no cluster.groups row says pool: true",
        ),
        (
            f"{SERVING}, {{count: 1, pool: true, set: [deployment.dp_groups_per_domain=2]}}",
            ("cluster.pool=2",),
            r"cluster.groups\[1\]: pool: true needs standby: true",
        ),
    ],
    ids=["pool-below-largest", "no-pool", "pool-without-group", "pool-not-standby"],
)
def test_the_plan_refuses_a_pool_that_cannot_serve_its_tes(groups, sets, refused):
    with pytest.raises(ConfigError, match=refused):
        _plan(groups, *sets)


def test_pool_tes_may_share_a_pool_below_their_total_dies():
    cluster = _plan(f"{SERVING}, {POOL2}, {POOL4}", "cluster.pool=4")  # 2 + 4 > 4: they take turns
    assert sum(t.num_dies for t in cluster.tes if t.is_pool) == 6


def test_a_pool_pd_pair_launches_its_je_and_decode_te_shell():
    """A PD pair from the pool: its two host ranks launched (its JE on the link, its decode
    TE-shell waiting for activations as a pool rank does), its prefill and decode dies pooled."""
    pair = (
        "pd.enabled=true, deployment.num_host_ranks=2, deployment.num_prefill_dies=1, "
        "deployment.dp_groups_per_domain=1, xccl.p2p_pairs=prefill_to_decode, "
        "xccl.ring_slots=8, xccl.slot_bytes=16384"
    )
    cluster = _plan(
        f"{SERVING}, {{count: 1, standby: true, pool: true, set: [{pair}]}}", "cluster.pool=2"
    )
    te = cluster.tes[1]
    assert (te.kind, te.first_rank, te.size, te.num_dies, te.num_launched) == ("pd", 4, 4, 2, 2)
    assert cluster.pool_ranks == (6, 7) and cluster.pool_hosts == (5,)
    assert [cluster.te_of(r) for r in (4, 5, 6)] == [(1, 0), (1, 1), (-1, 0)]
