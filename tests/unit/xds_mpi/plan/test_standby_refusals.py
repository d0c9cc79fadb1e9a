"""A standby TE's dies load their weights at scale-out (docs/scaling.md, "Weights at
scale-out"): the plan refuses what is not built (a standby afd TE, a standby PD pair with
prefill TP, ring replicas, NPU-fork
without a TE of the same shape serving from the start), naming the TE and the key, and NPU-fork's
source is the first such TE."""

from __future__ import annotations

import pytest

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.cluster import fork_source
from xds_mpi.plan.deployment import DeploymentPlan

SERVING = "{count: 1, set: [deployment.dp_groups_per_domain=2]}"


def _plan(config: str, groups: str, *sets: str):
    cfg = load_config(config, [f"cluster.groups=[{groups}]", "autoscaler.enabled=true", *sets])
    return cfg, DeploymentPlan.build(cfg, None, launcher_checks=False)


@pytest.mark.parametrize(
    "config, groups, refused",
    [
        ("configs/afd.yaml", "{count: 1}, {count: 1, standby: true}", "its kind is afd"),
        (
            "configs/cluster.yaml",
            SERVING + ", {count: 1, standby: true, set: [pd.enabled=true, "
            "deployment.num_host_ranks=2, deployment.num_prefill_dies=2, "
            "deployment.prefill_tp=2, "
            "deployment.dp_groups_per_domain=2, xccl.p2p_pairs=prefill_to_decode, "
            "xccl.ring_slots=8, xccl.slot_bytes=16384]}",
            "deployment.prefill_tp=2",
        ),
        (
            "configs/colocated.yaml",
            SERVING + ", {count: 1, standby: true, set: [deployment.dp_groups_per_domain=2, "
            "health.replicas=ring]}",
            "health.replicas=ring",
        ),
        (
            "configs/colocated.yaml",
            SERVING + ", {count: 1, standby: true, set: [deployment.dp_groups_per_domain=4, "
            "scaling.path=fork]}",
            "no TE serving from the start has its shape",
        ),
    ],
    ids=["afd", "pd-prefill-tp", "ring", "fork-without-source"],
)
def test_the_plan_refuses_a_standby_te_whose_weights_it_cannot_load(config, groups, refused):
    with pytest.raises(ConfigError, match=f"cluster TE 1 .*standby.*{refused}"):
        _plan(config, groups)


def test_fork_takes_the_first_serving_te_of_the_same_shape():
    groups = (
        "{count: 1, set: [deployment.dp_groups_per_domain=4]}, "
        + SERVING
        + ", {count: 2, standby: true, set: [deployment.dp_groups_per_domain=2, scaling.path=fork]}"
    )
    cfg, plan = _plan("configs/colocated.yaml", groups)
    tes = plan.cluster.tes
    assert [fork_source(cfg, tes, te) for te in (2, 3)] == [1, 1]  # not TE 0: 4 dies
    assert fork_source(cfg, tes, 0) == 0  # a serving TE is its own shape's first
