"""Which clock a PD run with faults serves on (xds_mpi/plan/clock.py): transient XCCL faults on
the decode dies only, and colocated decode dies or afd attention dies lost for good, run on the
virtual clock (their rollbacks and failovers are priced there); KV-transfer faults and the
other faults.events rows keep the wall clock, and `run.clock=virtual` is refused for them
naming why."""

from __future__ import annotations

import pytest

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.clock import serving_clock

DECODE_ROW = "faults.table=[{die: 4, op: dispatch, layer: 1, iteration: 2}]"
KV_ROW = "faults.table=[{die: 6, op: p2p_send, layer: 0, iteration: 1}]"
DEAD = "faults.events=[{kind: dead, die: 2, iteration: 1}]"  # configs/pd.yaml: a decode die
STUCK_FOR_GOOD = "faults.events=[{kind: stuck, die: 3, at_s: 0.5}]"
PREFILL_DEAD = "faults.events=[{kind: dead, die: 6, iteration: 1}]"
STUCK_A_WHILE = "faults.events=[{kind: stuck, die: 3, iteration: 1, duration_s: 2}]"
# configs/pd_afd.yaml in one DP domain of attention dies 2 and 3, expert dies 4 and 5, so that
# a lost attention die leaves its domain another.
ONE_DOMAIN = [
    "deployment.num_dp_domains=1",
    "deployment.dp_groups_per_domain=2",
    "health.timeout_s=4",
    "health.probe_timeout_s=12",
]
BOTH = "faults.events=[{kind: dead, die: 2, iteration: 1}, {kind: dead, die: 6, iteration: 1}]"


def _clock(config: str, *sets: str):
    return serving_clock(load_config(f"configs/{config}.yaml", list(sets)))


@pytest.mark.parametrize(
    "config, sets",
    [
        ("pd", [DECODE_ROW]),
        ("pd", ["faults.rate=0.01", "faults.rate_unit=iteration", "faults.ops=[dispatch]"]),
        ("pd_afd", ["faults.rate=0.01", "faults.rate_unit=iteration", "faults.ops=[a2e, e2a]"]),
        ("pd", [DEAD]),
        ("pd", [STUCK_FOR_GOOD]),
        ("pd", [DEAD, DECODE_ROW]),
        ("pd_afd", [*ONE_DOMAIN, DEAD]),  # die 2: an attention die
        ("pd_afd", [*ONE_DOMAIN, "faults.events=[{kind: stuck, die: 3, at_s: 0.5}]"]),
    ],
)
def test_transient_decode_faults_and_decode_dies_lost_serve_on_the_virtual_clock(config, sets):
    assert _clock(config, *sets).kind == "virtual"
    assert _clock(config, "run.clock=virtual", *sets).kind == "virtual"


@pytest.mark.parametrize(
    "sets, named",
    [
        ([KV_ROW], "faults on the KV transfers"),
        ([DECODE_ROW, KV_ROW], "faults on the KV transfers"),
        (["faults.rate=0.001"], "faults on the KV transfers"),  # faults.ops: every operation
        ([PREFILL_DEAD], "PD with faults.events"),
        ([STUCK_A_WHILE], "PD with faults.events"),
        ([BOTH], "PD with faults.events"),
        ([DEAD, KV_ROW], "faults on the KV transfers"),
    ],
)
def test_kv_transfer_faults_and_events_keep_the_wall_clock(sets, named):
    clock = _clock("pd", *sets)
    assert clock.kind == "wall" and named in clock.why
    with pytest.raises(ConfigError, match=r"run\.clock\(virtual\)") as refused:
        _clock("pd", "run.clock=virtual", *sets)
    assert named in str(refused.value)
