"""An XCCL wait that times out on a peer still alive becomes a token recomputation
(faults.on_timeout recompute, xDeepServe §6.2 stage 3), and what the validator accepts for it.

The serving case: die 3 is stuck 2 s (shorter than health.timeout_s, so the heartbeats never
suspect it) while its peers' dispatch waits give up after xccl.poll_timeout_s = 1 s. Every die
rolls back and recomputes the iteration; every token equals the reference."""

from __future__ import annotations

import pytest
from harness import REPO_ROOT
from test_decode_failover import RING, SERVED, assert_scaled, served
from test_serving import check_line

from xds_mpi.config.schema import ConfigError, config_from_dict, load_config
from xds_mpi.plan.failures.checks import check_failures
from xds_mpi.plan.topology import Topology

# 1 s, not less: the TE-shell's own end-of-run waits take xccl.poll_timeout_s too.
RECOMPUTE = ["faults.on_timeout=recompute", "xccl.poll_timeout_s=1"]
STUCK = "{kind: stuck, die: 3, iteration: 4, duration_s: 2}"


def test_a_wait_timed_out_on_a_slow_peer_is_recomputed_and_recorded(tmp_path):
    result, run_file, records = served(tmp_path, [STUCK], *RECOMPUTE)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert check_line(result) == SERVED
    summary = run_file["summary"].attrs
    assert summary["faults_injected"] == 0 and summary["xccl_timeouts"] >= 1
    assert summary["rollbacks"] >= summary["xccl_timeouts"]
    assert "timed out waiting for die 3: xccl.poll_timeout_s" in out
    [record] = records  # one record: the stuck row's, no heartbeat verdict on anyone
    assert (record.kind, record.die, record.verdict) == ("stuck", 3, "transient")
    assert record.detected_by == "xccl timeout", record.describe()
    assert "silent for more than" not in out
    # The first timeout fires one poll timeout after the die stalled, well before it is back.
    assert 0.8 < record.detection_s < 2, record.describe()
    assert record.detected_virtual_s > record.injected_virtual_s
    assert record.recovery.startswith("token recomputation: die rank "), record.recovery
    assert "for die rank 3 timed out" in record.recovery


@pytest.mark.parametrize(
    "row, die, verdict",
    [
        ("{kind: stuck, die: 2, iteration: 5, duration_s: 0}", 2, "dead"),  # stuck for good
        ("{kind: dead, die: 2, iteration: 5}", 2, "dead"),
        # Back late: silent through detection and the first grace (lost), back in the second.
        pytest.param(
            "{kind: stuck, die: 2, iteration: 6, duration_s: 7}",
            2,
            "stuck",
            marks=pytest.mark.failure_matrix,
        ),
    ],
)
def test_a_lost_peer_is_left_to_the_heartbeats(tmp_path, row, die, verdict):
    """The peers' waits time out within 1 s, but the lost die never votes: the vote outlasts
    detection and release, the fence ends it, and vertical scaling runs as without timeouts
    (afd: tests/e2e/failover/test_afd_failover.py). A die back after the fence is not taken
    back: it was scaled away."""
    result, run_file, records = served(tmp_path, [row], *RECOMPUTE, *RING)
    assert_scaled(result, records, die, verdict, "vertical scaling: 4 -> 3")
    assert run_file["summary"].attrs["xccl_timeouts"] == 0  # no recomputation: the fence won


def _check(sections):
    cfg = config_from_dict(sections)
    check_failures(cfg, Topology.from_config(cfg))


def test_a_short_poll_timeout_is_accepted_with_recompute_and_refused_without():
    stuck = {"events": [{"kind": "stuck", "die": 3, "iteration": 4, "duration_s": 1.5}]}
    short = {"xccl": {"poll_timeout_s": 0.5}, "health": {"timeout_s": 4}}
    _check({"faults": {**stuck, "on_timeout": "recompute"}, **short})
    with pytest.raises(
        ConfigError, match=r"poll_timeout_s\(0.5\) must exceed .*faults.on_timeout=recompute"
    ):
        _check({"faults": stuck, **short})


@pytest.mark.parametrize(
    "config, named",
    [
        ("colocated", "health.enabled False"),
        ("pd_afd", "pd.enabled True"),
        ("pd", "pd.enabled True"),
        ("eplb", "eplb.enabled True"),
    ],
)
def test_recompute_on_timeout_is_refused_where_it_does_not_run(config, named):
    overrides = ["faults.on_timeout=recompute"]
    overrides += ["health.enabled=false"] if config == "colocated" else []
    cfg = load_config(REPO_ROOT / "configs" / f"{config}.yaml", overrides)
    with pytest.raises(ConfigError, match=f"on_timeout=recompute .*{named}"):
        check_failures(cfg, Topology.from_config(cfg))


def test_an_unknown_on_timeout_is_refused():
    with pytest.raises(ConfigError, match="faults.on_timeout must be stop or recompute"):
        config_from_dict({"faults": {"on_timeout": "retry"}})
