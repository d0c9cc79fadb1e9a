"""A decode die lost in a PD run (xDeepServe §6.1-6.2, "P/D separate failover"): the decode
TE-shell's heartbeats find it, its fence releases the surviving decode dies, which scale
vertically (ring replicas); the JE re-routes the tasks whose KV was still at prefill and has the
requests the die was decoding prefilled again; prefill never stops, and every token equals the
reference.

configs/pd.yaml: JE 0, decode TE-shell 1, colocated decode dies 2-5, prefill dies 6-7.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from harness import REPO_ROOT, busy_processes
from test_decode_failover import CEILING_S, EARLY, HEALTH, RING, assert_detected, served
from test_serving import check_line
from test_virtual_time import _virtual_columns

from xds_mpi.config.schema import ConfigError, config_from_dict, load_config
from xds_mpi.plan.failures.checks import check_failures
from xds_mpi.plan.failures.loss import FailoverCost
from xds_mpi.plan.topology import Topology

# Probes past detection and release (the survivors echo none until released); a small workload.
PD = [
    "health.probe_timeout_s=12",
    "workload.num_requests=6",
    "workload.output_len=10",
    "workload.max_output_len=10",
    "workload.ignore_eos=true",
]
SERVED = "check: 6 requests, 60 tokens, 0 mismatches"  # 6 x 10: none lost, none twice


def lost_die(tmp_path, row: str, *settings: str):
    result, run_file, records = served(tmp_path, [row], *RING, *PD, *settings, config="pd")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert check_line(result) == SERVED, out[-3000:]
    [record] = records  # no false verdict (heartbeat or link probe) on any other die
    assert record.recovery.startswith("vertical scaling: 4 -> 3 decode dies"), record.describe()
    assert record.tokens_per_s_after > 0
    assert (run_file["requests"]["num_tokens"][()] > 0).all()
    return record, out


def priced_resumption(record, out: str, config: str, health) -> float:
    """A decode loss failed over on the virtual clock: the fault it logged is the record's, found
    one detection later; returns the survivors' resumption, the fault plus FailoverCost."""
    path = REPO_ROOT / "configs" / f"{config}.yaml"
    cost = FailoverCost.of(load_config(path, list(health)).health)
    [logged] = re.findall(r"decode failover on the virtual clock: fault at (\S+) s", out)
    fault_s = float(logged)
    assert fault_s == pytest.approx(record.injected_virtual_s, abs=1e-5)
    assert record.detected_virtual_s == pytest.approx(fault_s + cost.detection_s, abs=1e-5)
    return fault_s + cost.total_s


def moved(record) -> tuple[int, int]:
    """(requests prefilled again, PD tasks re-routed), from the record's recovery."""
    found = re.search(
        r"(\d+) requests prefilled again through the JE, (\d+) PD tasks re-routed", record.recovery
    )
    assert found, record.describe()
    return int(found[1]), int(found[2])


@pytest.mark.failure_cell("pd", "dead")
def test_a_dead_decode_die_mid_run_is_scaled_away_its_requests_prefilled_again(tmp_path):
    record, out = lost_die(tmp_path, "{kind: dead, die: 3, iteration: 3}")
    assert_detected(record, 3, "dead")
    assert record.injected_iteration == 3 and record.tokens_per_s_before > 0
    # It was decoding some: their KV left prefill, they go back through the JE (any task it had
    # not pulled yet is re-routed, its KV still at prefill).
    prefilled, rerouted = moved(record)
    assert prefilled >= 1 and prefilled + rerouted == len(record.requests_affected), out[-3000:]


@pytest.mark.failure_matrix
def test_a_decode_die_dead_at_its_first_iteration_gets_its_tasks_re_routed(tmp_path):
    record, out = lost_die(tmp_path, "{kind: dead, die: 2, iteration: 0}", *EARLY)
    assert_detected(record, 2, "dead", CEILING_S)  # no die answered before: the ceiling
    assert record.injected_iteration == 0 and record.requests_affected
    # It never pulled a KV: every task sent to it is re-routed, its KV still at prefill.
    assert moved(record) == (0, len(record.requests_affected)), out[-3000:]


BASE = {
    "pd": {"enabled": True},
    "deployment": {"num_prefill_dies": 2, "num_host_ranks": 2, "redundant_slots_per_die": 4},
    "health": {"replicas": "ring", "timeout_s": 4, "probe_timeout_s": 12},
}


def _check(row: dict, **changes) -> None:
    sections = {k: {**v, **changes.get(k, {})} for k, v in BASE.items()}
    cfg = config_from_dict({**sections, "faults": {"events": [row]}})
    check_failures(cfg, Topology.from_config(cfg))


def test_a_dead_or_stuck_for_good_pd_decode_die_is_accepted():
    _check({"kind": "dead", "die": 3, "iteration": 2})
    _check({"kind": "stuck", "die": 4, "iteration": 2})


@pytest.mark.parametrize(
    "row, changes, reason",
    [
        (
            {"kind": "stuck", "die": 3, "iteration": 0, "duration_s": 2.0},
            {},
            r"stuck for duration_s\(2.0\) comes back, .* only stuck for good",
        ),
        (
            {"kind": "dead", "die": 3, "iteration": 0},
            {"health": {"replicas": "none"}},
            "health.replicas=ring",
        ),
        (
            {"kind": "dead", "die": 3, "iteration": 0},
            {"deployment": {"num_host_ranks": 1}},
            r"num_host_ranks\(1\) gives the JE the decode balancing",
        ),
        (
            {"kind": "dead", "die": 3, "iteration": 0},
            {"health": {"probe_timeout_s": 5}},
            r"probe_timeout_s\(5\) must exceed detection and release \(8.2 s",
        ),
    ],
)
def test_pd_decode_losses_that_do_not_run_are_refused(row, changes, reason):
    with pytest.raises(ConfigError, match=reason):
        _check(row, **changes)


def test_a_pd_decode_loss_with_another_fault_row_is_refused():
    cfg = config_from_dict(
        {
            **BASE,
            "faults": {
                "events": [
                    {"kind": "dead", "die": 3, "iteration": 0},
                    {"kind": "saturated", "die": 4, "iteration": 0, "delay_s": 2.0},
                ]
            },
        }
    )
    with pytest.raises(ConfigError, match=r"other fault rows \(faults.events\[1\]\)"):
        check_failures(cfg, Topology.from_config(cfg))


# configs/pd_afd.yaml with one DP domain of two attention dies, so that the domain keeps one:
# JE 0, decode TE-shell 1, attention dies 2-3, expert dies 4-5, prefill die 6.
PD_AFD = [
    "deployment.num_dp_domains=1",
    "deployment.dp_groups_per_domain=2",
    "run.trace=false",
    *PD,
]


def lost_attention_die(tmp_path, row: str, *settings: str):
    """A PD run's afd decode side losing attention die `row` names: served in full, one record."""
    result, run_file, records = served(tmp_path, [row], *PD_AFD, *settings, config="pd_afd")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert check_line(result) == SERVED, out[-3000:]
    [record] = records  # no false verdict on the other attention die or the expert dies
    assert record.role == "attention", record.describe()
    assert record.recovery.startswith("vertical scaling: 2 -> 1 attention dies"), record.describe()
    assert sum(moved(record)) == len(record.requests_affected) >= 1, out[-3000:]
    assert (run_file["requests"]["num_tokens"][()] > 0).all()
    return record, out, run_file


@pytest.mark.failure_matrix
def test_a_dead_attention_die_of_a_pd_afd_decode_side_is_dropped_its_requests_prefilled_again(
    tmp_path,
):
    """The decode TE-shell watches the attention and expert dies, fences the A2E/E2A waits, the
    survivors rebuild A2E/E2A without die 2 and the JE moves its requests; on the virtual clock
    (`run.clock` auto), priced as a colocated decode die's loss (the survivors resume at the
    fault plus FailoverCost, the requests prefilled again arrive then), the same beside two busy
    processes."""
    runs = []
    for i, num_busy in enumerate((0, 2)):
        with busy_processes(num_busy):
            row = "{kind: dead, die: 2, at_s: 0.5}"
            record, out, run_file = lost_attention_die(tmp_path / f"run{i}", row)
        assert run_file["summary"].attrs["serving_clock"] == "virtual"
        runs.append((_virtual_columns(run_file), record, out))
    (quiet, record, out), (loaded, record_loaded, _) = runs
    assert quiet.keys() == loaded.keys()
    for name in quiet:
        assert np.array_equal(quiet[name], loaded[name], equal_nan=True), name
    assert record.detected_virtual_s == record_loaded.detected_virtual_s
    assert_detected(record, 2, "dead")
    resumed_s = priced_resumption(record, out, "pd_afd", HEALTH)
    fault_s = record.injected_virtual_s
    assert fault_s >= 0.5
    decided = quiet["virtual/decided_s"]
    prefilled, _ = moved(record)
    assert prefilled >= 1, out[-3000:]
    again = [r for r in record.requests_affected if decided[r] > fault_s]
    assert len(again) == prefilled  # the others were re-routed, decided before the fault
    for req_id in again:  # prefilled again, arriving at the resumption
        assert decided[req_id] == pytest.approx(resumed_s, abs=1e-5), req_id
    finish = quiet["virtual/finish_s"]
    assert all(finish[r] > resumed_s for r in record.requests_affected)


@pytest.mark.failure_matrix
def test_an_attention_die_of_a_pd_afd_decode_side_stuck_for_good_is_lost(tmp_path):
    """On the wall clock (the path `xds-mpi serve` would take)."""
    row = "{kind: stuck, die: 3, iteration: 3}"
    record, _, _ = lost_attention_die(tmp_path, row, "run.clock=wall")
    assert record.kind == "stuck" and record.injected_iteration == 3
    assert_detected(record, 3, "dead")  # never answers again


@pytest.mark.failure_matrix
def test_a_decode_die_stuck_for_good_is_lost_and_the_survivors_late_echoes_are_no_verdict(
    tmp_path,
):
    # Stuck inside its dispatch: never answers again, so the verdict is "dead"; the survivors
    # waiting for it echo the prefill dies' dummies late until released, which the JE puts
    # down to the loss ([record] in lost_die: no false saturated / link verdict). On the
    # virtual clock (a decode die lost for good) at 0.3 s: die 3 holds a request then (die 4 at
    # its iteration 2, as on the wall clock before, held none).
    record, out = lost_die(tmp_path, "{kind: stuck, die: 3, at_s: 0.3}")
    assert record.kind == "stuck"
    assert_detected(record, 3, "dead")
    assert sum(moved(record)) == len(record.requests_affected) >= 1, out[-3000:]


def test_verdicts_a_decode_loss_explains_are_no_false_verdict():
    from types import SimpleNamespace

    from ranks.core.messages import FaultBegan
    from ranks.recovery.decode_loss import DecodeBook, DecodeLoss
    from ranks.recovery.je_decode_loss import DecodeLossWatch, Moved
    from xds_mpi.results.failures import FailureRecord

    health = SimpleNamespace(probe_timeout_s=12)
    watch = DecodeLossWatch.__new__(DecodeLossWatch)  # the JE's side, without a JE
    watch.je = SimpleNamespace(ctx=SimpleNamespace(cfg=SimpleNamespace(health=health)))
    loss = DecodeLoss(lost=(4,), batches={}, orphans=(), before=4, after=3, detected_at=105.0)
    watch.moved = [Moved(loss=loss, handled_at=108.0)]
    began = FaultBegan(die=4, kind="stuck", iteration=2, wall_time=103.0, virtual_s=1.0)
    watch.book = DecodeBook(began={4: began}, detections=[])

    def verdict(die: int, at: float, kind: str = "none") -> FailureRecord:
        return FailureRecord(
            kind=kind,
            die=die,
            role="colocated",
            injected_iteration=-1,
            injected_wall_s=-1.0,
            injected_virtual_s=-1.0,
            detected_wall_s=at,
        )

    # started at 100: the fault at 3 s, requests moved at 8 s, probes time out 12 s later.
    late_echo, lost_pair, after, before = (
        verdict(2, 9.0),
        verdict(4, 50.0),
        verdict(5, 21.0),
        verdict(5, 2.0),
    )
    row = verdict(3, 9.0, kind="saturated")  # an injected row's record is always kept
    kept = watch.explained([late_echo, lost_pair, after, before, row], started=100.0)
    assert kept == [after, before, row]
