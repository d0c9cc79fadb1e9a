"""A memory fault in an expert slot with a replica elsewhere (xDeepServe §6.2 stage 3): every die
drops the slot from the placement it routes with, the other replica serves the expert, and the
tokens equal the reference although the faulty slot's weights turned to NaN (a row still sent
there would break the check). Slots whose expert would keep no replica are refused."""

from __future__ import annotations

import pytest
from test_recompute import serve
from test_serving import check_line

from xds_mpi.config.schema import ConfigError, config_from_dict
from xds_mpi.plan.failures.checks import check_failures
from xds_mpi.plan.topology import Topology
from xds_mpi.results.failures import read_failures

RING = {"deployment": {"redundant_slots_per_die": 4}, "health": {"replicas": "ring"}}
# configs/colocated.yaml with RING: die rank 2's slots 0-3 are routed experts 4-7 (physical 8-11),
# 4-7 redundant, holding the ring's copies of die rank 3's experts 8-11 (physical 12-15); die
# rank 1's redundant slots (physical 4-7) hold copies of experts 4-7.


def test_a_routed_and_a_redundant_slot_are_masked_and_the_tokens_equal_the_reference(tmp_path):
    rows = (
        "[{kind: memory, die: 2, iteration: 3, slot: 1},"
        " {kind: memory, die: 3, iteration: 6, slot: 5}]"
    )
    settings = ["deployment.redundant_slots_per_die=4", "health.replicas=ring"]
    result, run_file = serve(tmp_path, "colocated", [f"faults.events={rows}", *settings])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == "check: 8 requests, 128 tokens, 0 mismatches"
    routed, redundant = read_failures(run_file)
    assert (routed.die, routed.injected_iteration, routed.detected_by) == (2, 3, "memory check")
    assert routed.verdict == "faulty expert slot 1 (physical slot 9, expert 5)"
    assert routed.recovery.startswith("slot masked: expert 5 served by its replica at physical")
    assert redundant.verdict == "faulty expert slot 5 (physical slot 21, expert 13)"
    assert "[25]" in redundant.recovery  # expert 13's routed slot on die rank 4
    assert not routed.requests_lost and not redundant.requests_lost


def _check(events, **sections):
    cfg = config_from_dict({**sections, "faults": {"events": events}})
    check_failures(cfg, Topology.from_config(cfg))


def test_a_slot_with_a_ring_replica_is_accepted():
    _check(
        [
            {"kind": "memory", "die": 2, "iteration": 0, "slot": 1},
            {"kind": "memory", "die": 3, "iteration": 0, "slot": 5},
        ],
        **RING,
    )


@pytest.mark.parametrize(
    "events, sections, reason",
    [
        (
            [{"kind": "memory", "die": 2, "iteration": 0, "slot": 1}],
            {},
            "holds the only copy of routed expert 5",
        ),
        ([{"kind": "memory", "die": 2, "iteration": 0, "slot": 8}], RING, "holds shared expert 0"),
        (
            # expert 5: routed on die rank 2 (slot 1), its ring copy on die rank 1 (slot 5)
            [
                {"kind": "memory", "die": 2, "iteration": 0, "slot": 1},
                {"kind": "memory", "die": 1, "iteration": 0, "slot": 5},
            ],
            RING,
            r"hold every replica of routed expert\(s\) \[5\]",
        ),
        (
            [
                {"kind": "memory", "die": 2, "iteration": 0, "slot": 1},
                {"kind": "dead", "die": 3, "iteration": 0},
            ],
            RING,
            r"beside stuck/dead rows \(1\) or with eplb.enabled\(False\) is refused",
        ),
    ],
)
def test_slots_that_cannot_be_masked_are_refused_naming_why(events, sections, reason):
    with pytest.raises(ConfigError, match=reason):
        _check(events, **sections)
