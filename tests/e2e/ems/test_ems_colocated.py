"""The EMS context cache on the colocated deployment (docs/ems.md#colocated-dies): the colocated
dies are the pool's clients (no PD), the plan places the pool ranks after them, and the crafted
trace of tests/e2e/ems/test_ems.py gives the same hits, blocks moved and tokens as on PD."""

from __future__ import annotations

import pytest
from harness import REPO_ROOT
from test_ems import BT, assert_pool_within_the_what_if, expected, serve_crafted

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.deployment import DeploymentPlan


def test_colocated_dies_are_the_pools_clients():
    cfg = load_config(
        REPO_ROOT / "configs" / "colocated.yaml",
        ["ems.enabled=true", "ems.servers=2", "deployment.dp_groups_per_domain=2"],
    )
    plan = DeploymentPlan.build(cfg)
    assert plan.ems.clients == (1, 2) and plan.ems.pool == (3, 4)
    assert [plan.topo.ranks[r].role for r in (1, 2, 3, 4)] == ["colocated"] * 2 + ["pool"] * 2


@pytest.mark.parametrize(
    ("config", "sets", "match"),
    [
        ("afd.yaml", [], r"ems.enabled needs pd.enabled or deployment.kind colocated"),
        (
            "colocated.yaml",
            ["ems.faults=[{kind: evict, die: 3}]", "deployment.dp_groups_per_domain=2"],
            r"ems.faults\[0\].die\(3\) is not a colocated die \(the dies that use the pool\)",
        ),
    ],
)
def test_refused_with_the_reason(config, sets, match):
    with pytest.raises(ConfigError, match=match):
        cfg = load_config(REPO_ROOT / "configs" / config, ["ems.enabled=true", *sets])
        DeploymentPlan.build(cfg)


def test_crafted_trace_hits_exactly_on_colocated_dies(tmp_path):
    """Two pool ranks with room for every block, 2 colocated dies: a request's prefix is looked
    up when it reaches its die, its computed blocks put when its first token is sampled; 4
    requests hit, 10 blocks pulled, 9 put (1 already held), every token equal to the
    reference (serve_crafted checks the line)."""
    s = serve_crafted(tmp_path, "colocated", "ems.servers=2", config="colocated")
    want = expected(capacity=1000)
    assert s["ems_lookups"] == 6
    assert s["ems_requests_hit"] == want["requests_hit"] == 4
    assert s["ems_blocks_hit"] == want["blocks_hit"] == 10
    assert s["ems_bytes_pulled"] == 10 * BT * 1280  # 1280 B per token over the 4 layers
    assert s["ems_tokens_skipped"] == 10 * BT
    assert s["ems_blocks_put"] == want["blocks_put"] == 9
    assert (s["ems_blocks_stored"], s["ems_puts_already_held"]) == (8, want["held"])
    assert (s["ems_evictions"], s["ems_fallbacks"], s["ems_blocks_held"]) == (0, 0, 8)
    assert_pool_within_the_what_if(tmp_path, "colocated")


def test_a_block_evicted_mid_lookup_on_a_colocated_die_falls_back(tmp_path):
    """An ems.faults evict row names a colocated die: each die's first finding lookup has its
    block evicted between the record read and the pull; the prefix is recomputed from there
    (one fallback per eviction) and every token equals the reference."""
    s = serve_crafted(
        tmp_path,
        "evict",
        "ems.servers=2",
        "ems.faults=[{kind: evict, die: 1}, {kind: evict, die: 2}]",
        config="colocated",
    )
    assert s["ems_evicts_injected"] >= 1
    assert s["ems_fallbacks"] == s["ems_evicts_injected"] and s["ems_lost_fallbacks"] == 0
    assert s["ems_blocks_hit"] < 10  # the fault-free run's


def test_transient_faults_beside_the_pool_leave_its_hits_and_puts_as_without_faults(tmp_path):
    """Transient XCCL faults on the colocated dies that use the pool (0.3 per die and
    iteration: most iterations roll back once or more): whatever a rolled-back iteration held,
    the pool's counts are the fault-free run's (test_crafted_trace_hits_exactly_on_colocated_
    dies: nothing pulled again, nothing put twice), and every token equals the reference
    (serve_crafted checks the line)."""
    rate = ["faults.rate=0.3", "faults.rate_unit=iteration", "faults.max_retries=10"]
    s = serve_crafted(tmp_path, "transient", "ems.servers=2", *rate, config="colocated")
    assert s["faults_injected"] >= 3 and s["recomputed_iterations"] >= 3
    want = expected(capacity=1000)
    assert (s["ems_lookups"], s["ems_requests_hit"], s["ems_blocks_hit"]) == (6, 4, 10)
    assert s["ems_blocks_put"] == want["blocks_put"]
    assert (s["ems_blocks_stored"], s["ems_puts_already_held"]) == (8, want["held"])
    assert (s["ems_fallbacks"], s["ems_blocks_held"]) == (0, 8)
