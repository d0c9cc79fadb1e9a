"""`faults.events` and `health`: rows read, refused with a reason, and the failure records'
run-file round trip."""

from __future__ import annotations

import h5py
import pytest

from xds_mpi.config.schema import ConfigError, config_from_dict
from xds_mpi.plan.failures.checks import EMULATED, check_failures
from xds_mpi.plan.topology import Topology
from xds_mpi.results.failures import FailureRecord, read_failures, write_failures


def _check(events, **sections):
    cfg = config_from_dict({"faults": {"events": events}, **sections})
    check_failures(cfg, Topology.from_config(cfg))


@pytest.mark.parametrize(
    "events, reason",
    [
        ([{"kind": "bogus", "die": 1, "iteration": 0}], "unknown kind 'bogus'"),
        ([{"kind": "stuck", "die": 1, "iteration": 0, "delay_s": 1.0}], "takes no delay_s"),
        ([{"kind": "link", "die": 1, "iteration": 0}], "needs peer"),
        ([{"kind": "memory", "die": 1, "iteration": 0}], "either a KV block range"),
        (
            [{"kind": "dead", "die": 9, "iteration": 0}],
            r"die\(9\) is not a die: dies are ranks 1..4",
        ),
        ([{"kind": "dead", "die": 0, "iteration": 0}], "is not a die"),
        ([{"kind": "link", "die": 1, "iteration": 0, "peer": 2}], "rank 1 is a colocated die"),
        ([{"kind": "saturated", "die": 1, "iteration": 0, "delay_s": 0.1}], "pd.enabled is false"),
        (
            [{"kind": "memory", "die": 1, "iteration": 0, "first_block": 250, "num_blocks": 10}],
            "past the die's scheduler.num_kv_blocks_per_die",
        ),
        (
            [{"kind": "memory", "die": 1, "iteration": 0, "slot": 99}],
            r"rank 1 \(colocated\) has \d+ expert slots",
        ),
        (
            [
                {"kind": "dead", "die": 2, "iteration": 0},
                {"kind": "stuck", "die": 2, "iteration": 0},
            ],
            "overlap on die 2",
        ),
        (
            [
                {"kind": "memory", "die": 2, "iteration": 0, "first_block": 0, "num_blocks": 8},
                {"kind": "memory", "die": 2, "iteration": 0, "first_block": 7, "num_blocks": 2},
            ],
            "overlap on die 2",
        ),
    ],
)
def test_bad_rows_are_refused_with_a_reason(events, reason):
    with pytest.raises(ConfigError, match=reason):
        _check(events)


def test_a_row_no_die_emulates_is_refused(monkeypatch):
    monkeypatch.setattr("xds_mpi.plan.failures.checks.EMULATED", set())
    with pytest.raises(ConfigError, match="no recovery for it is built"):
        _check([{"kind": "dead", "die": 2, "iteration": 3}])


def test_disjoint_memory_ranges_on_one_die_are_accepted_when_emulated(monkeypatch):
    row = ("memory", "colocated", "colocated")
    monkeypatch.setattr("xds_mpi.plan.failures.checks.EMULATED", EMULATED | {row})
    _check(
        [
            {"kind": "memory", "die": 2, "iteration": 0, "first_block": 0, "num_blocks": 8},
            {"kind": "memory", "die": 2, "iteration": 0, "first_block": 8, "num_blocks": 2},
        ]
    )


def test_health_timeout_must_exceed_two_intervals():
    with pytest.raises(ConfigError, match="timeout_s"):
        config_from_dict({"health": {"timeout_s": 0.5, "control_interval_s": 0.5}})


def test_failure_records_round_trip_through_the_run_file(tmp_path):
    records = [
        FailureRecord(
            kind="dead",
            die=3,
            role="colocated",
            injected_iteration=4,
            injected_wall_s=0.5,
            injected_virtual_s=0.01,
            detected_wall_s=1.75,
            detected_virtual_s=0.02,
            detected_by="heartbeat",
            verdict="dead",
            recovery="vertical scaling: 4 -> 3 decode dies",
            requests_affected=(1, 5),
            tokens_per_s_before=100.0,
            tokens_per_s_after=80.0,
        ),
        FailureRecord(
            kind="memory",
            die=2,
            role="colocated",
            injected_iteration=1,
            injected_wall_s=0.2,
            injected_virtual_s=0.0,
            requests_lost=(7,),
        ),
    ]
    with h5py.File(tmp_path / "run.h5", "w") as f:
        write_failures(f, records)
    with h5py.File(tmp_path / "run.h5") as f:
        assert read_failures(f) == records
    assert records[0].detection_s == pytest.approx(1.25)
    assert "detected after 1.25 s by heartbeat" in records[0].describe()
    assert "never detected" in records[1].describe() and "lost [7]" in records[1].describe()


def test_stuck_and_dead_rows_on_colocated_dies_are_accepted():
    _check(
        [{"kind": "dead", "die": 2, "iteration": 3}, {"kind": "stuck", "die": 1, "iteration": 0}]
    )


@pytest.mark.parametrize(
    "row, sections, reason",
    [
        (
            {"kind": "dead", "die": 2},
            {},
            r"faults.events\[0\]: needs iteration \(the n-th iteration with work, from 0\) or "
            r"at_s \(virtual seconds, run.clock virtual\)",
        ),
        (
            {"kind": "dead", "die": 2, "iteration": 3, "at_s": 0.5},
            {},
            r"faults.events\[0\]: gives both iteration\(3\) and at_s\(0.5\); give one",
        ),
        ({"kind": "stuck", "die": 2, "at_s": -1.0}, {}, r"faults.events\[0\].at_s must be >= 0"),
        (
            {"kind": "memory", "die": 2, "at_s": 0.5, "slot": 0},
            {},
            r"faults.events\[0\].at_s: a memory row takes iteration, not at_s",
        ),
        (
            {"kind": "dead", "die": 2, "at_s": 0.5},
            {"run": {"clock": "wall"}},
            r"faults.events\[0\].at_s: a fault at a virtual time needs the virtual clock, and "
            r"serving runs on the wall clock here \(run.clock=wall\); give iteration instead",
        ),
        (
            {"kind": "dead", "die": 2, "at_s": 0.5},
            {"serve": {"enabled": True}},
            r"faults.events\[0\].at_s: .* on the wall clock here \(run.clock=auto: virtual "
            r"time is not built for xds-mpi serve .*\); give iteration instead",
        ),
    ],
)
def test_a_row_gives_iteration_or_at_s_and_at_s_only_on_the_virtual_clock(row, sections, reason):
    with pytest.raises(ConfigError, match=reason):
        _check([row], **sections)


@pytest.mark.parametrize("clock", ["auto", "virtual"])
def test_at_s_rows_are_accepted_on_the_virtual_clock(clock):
    cfg = config_from_dict(
        {
            "faults": {
                "events": [
                    {"kind": "dead", "die": 2, "at_s": 1.25},
                    {"kind": "stuck", "die": 3, "at_s": 0.0, "duration_s": 1.5},
                ]
            },
            "run": {"clock": clock},
        }
    )
    check_failures(cfg, Topology.from_config(cfg))
    assert [(e.iteration, e.at_s) for e in cfg.faults.events] == [(None, 1.25), (None, 0.0)]


@pytest.mark.parametrize(
    "sections, reason",
    [
        ({"health": {"enabled": False}}, "found by heartbeats, and health.enabled is false"),
        (
            {"health": {"on_expert_lost": "restart"}},
            "on_expert_lost=restart .* a fixed MPI world cannot do; use stop",
        ),
        (
            {"xccl": {"poll_timeout_s": 20}, "health": {"timeout_s": 10}},
            r"xccl.poll_timeout_s\(20\) must exceed detection and release, health.timeout_s\(10\)"
            r" \+ dp_interval_s\(0.2\) \+ 2 x 5 s = 20.2 s",
        ),
    ],
)
def test_undetectable_stuck_or_dead_rows_are_refused(sections, reason):
    with pytest.raises(ConfigError, match=reason):
        _check([{"kind": "dead", "die": 2, "iteration": 3}], **sections)


@pytest.mark.parametrize(
    "row",
    [
        {"kind": "dead", "die": 2, "iteration": 3},
        {"kind": "stuck", "die": 2, "iteration": 3},  # for good
        {"kind": "stuck", "die": 2, "iteration": 3, "duration_s": 12},  # past health.timeout_s
    ],
)
def test_a_decode_die_that_may_be_lost_with_mtp_is_refused(row):
    with pytest.raises(ConfigError, match=r"scheduler.mtp_depth\(1\) is refused"):
        _check([row], scheduler={"mtp_depth": 1})
    _check([{**row, "kind": "stuck", "duration_s": 1.5}], scheduler={"mtp_depth": 1})


def test_ring_replicas_without_their_slots_are_refused():
    # With EPLB the ring needs one slot more: tests/e2e/failover/test_eplb_failover.py.
    with pytest.raises(ConfigError, match=r"deployment.redundant_slots_per_die\(0\) must be >= 4"):
        _check([], health={"replicas": "ring"})
