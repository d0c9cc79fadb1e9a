"""Link probing of the KV-transfer path (xDeepServe §6.1) in PD runs: a link fault and a
saturated decode die are told apart in both directions, a fault-free run gets no verdict, and
every request checks equal to the reference after the recovery (re-routing, steering away).

Probe timings are generous (the machine is shared): a decode iteration under load stays well
below health.probe_slow_s, and a saturated die's delay lies between it and probe_timeout_s.
"""

from __future__ import annotations

import pytest
from test_serving_pd import explain, serve

from xds_mpi.config.schema import ConfigError, config_from_dict
from xds_mpi.pd.failover import PdFailover
from xds_mpi.plan.failures.checks import check_failures
from xds_mpi.plan.topology import Topology
from xds_mpi.results.failures import read_failures

PROBES = (
    "health.probe_interval_s=1",
    "health.probe_timeout_s=4",
    "health.probe_slow_s=1.5",
    "workload.num_requests=12",
    # JE, decode TE-shell, decode dies 2 and 3, prefill die 4: every pair carries KV.
    "deployment.dp_groups_per_domain=2",
    "deployment.num_prefill_dies=1",
)


def _failures(tmp_path, *sets):
    result, run_file = serve(tmp_path, *PROBES, *sets)
    assert result.returncode == 0, explain(result)
    assert "12 requests" in result.stdout and " 0 mismatches" in result.stdout, explain(result)
    return result, read_failures(run_file)


def test_a_fault_free_run_has_no_verdict(tmp_path):
    _, records = _failures(tmp_path)
    assert records == []


@pytest.mark.failure_cell("pd", "link")
def test_a_link_fault_is_called_link_and_its_requests_rerouted(tmp_path):
    # prefill die 4 -> decode die 2 drops everything from its first batch on, for good.
    result, records = _failures(
        tmp_path, "faults.events=[{kind: link, die: 4, peer: 2, iteration: 0}]"
    )
    assert [(r.kind, r.verdict, r.detected_by) for r in records] == [
        ("link", "link", "link probe")
    ], explain(result)
    record = records[0]
    assert record.detection_s > 0 and record.detected_virtual_s >= 0
    assert record.requests_affected, record  # their KV went over another pair
    assert "re-routed to other decode dies" in record.recovery
    assert record.requests_lost == ()


@pytest.mark.failure_matrix
def test_a_saturated_die_is_called_saturated_and_routed_around(tmp_path):
    # decode die 3 takes each KV transfer 2.5 s late (the echo too) for 8 s; requests keep
    # arriving for 8 s, so there are transfers left to steer once it is found.
    row = "faults.events=[{kind: saturated, die: 3, iteration: 0, delay_s: 2.5, duration_s: 8}]"
    arrivals = ("workload.arrival=rate", "workload.rate_per_s=1.5")
    result, records = _failures(tmp_path, row, *arrivals)
    assert [(r.kind, r.verdict) for r in records] == [("saturated", "saturated")], explain(result)
    assert records[0].detection_s > 0 and records[0].requests_affected
    assert "steered away from decode die 3" in records[0].recovery


@pytest.mark.parametrize(
    "row, health, decode_dies, reason",
    [
        (
            {"kind": "saturated", "die": 2, "iteration": 0, "delay_s": 0.5},
            {},
            4,
            r"delay_s\(0.5\) must lie",
        ),
        (
            {"kind": "saturated", "die": 2, "iteration": 0, "delay_s": 9.0},
            {},
            4,
            "looks like a link fault",
        ),
        (
            {"kind": "link", "die": 6, "iteration": 0, "peer": 2},
            {"enabled": False},
            4,
            "no probe would find",
        ),
        (
            {"kind": "link", "die": 3, "iteration": 0, "peer": 2},
            {},
            1,
            "only decode die 2 leaves its KV no",
        ),
    ],
)
def test_channel_rows_the_prober_cannot_name_are_refused(row, health, decode_dies, reason):
    deployment = {"num_prefill_dies": 2, "num_host_ranks": 2, "dp_groups_per_domain": decode_dies}
    cfg = config_from_dict(
        {"pd": {"enabled": True}, "deployment": deployment, "faults": {"events": [row]}}
        | {"health": health}
    )
    with pytest.raises(ConfigError, match=reason):
        check_failures(cfg, Topology.from_config(cfg))


def test_failover_book_rules_pairs_and_dies_out_and_back_in():
    from ranks.recovery.link_probe import LinkReport

    book = PdFailover()

    def report(kind, p, d, ids=()):
        return LinkReport(kind=kind, prefill=p, decode=d, wall=1.0, virtual_s=0.1, req_ids=ids)

    assert book.on_report(report("link", 6, 2, (4, 5))) == (4, 5)
    assert book.on_report(report("saturated", 7, 3, (1,))) == ()
    assert book.avoid(6, 8) == ((2,), (3,)) and book.avoid(7, 9) == ((), (3,))
    book.on_report(report("restored", 6, 2))
    book.on_report(report("cleared", 7, 3))
    assert book.avoid(6, 10) == ((), ()) and book.steered == {3: [8, 9]}
