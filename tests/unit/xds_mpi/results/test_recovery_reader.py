"""xds_mpi/results/recovery.py on crafted run files whose answers are known by hand: a dead die
whose failover moved two requests (one had emitted a token before the fault), a memory fault's
victim, a request after the backlog; and a run that stopped on a lost expert (no requests)."""

from __future__ import annotations

import math

import h5py
import numpy as np
import pytest

from xds_mpi.results.failures import FailureRecord, write_failures
from xds_mpi.results.recovery import goodput_over_time, read_recovery, recovered_s

NAN = math.nan
VICTIM = "kv memory fault on die 3 blocks 0..7"
# req_id: (arrival, decided, first token, finish, tokens, prompt); None: lost, no /virtual row.
# SLOs 1000 ms / 150 ms: 0 and 5 meet both; 1 and 3 miss TTFT, 2 both, 6 TPOT (0.2 s).
REQUESTS = {
    0: (0.0, 0.0, 0.3, 1.3, 11, 4),
    1: (1.0, 1.0, 2.5, 3.5, 11, 4),
    2: (2.0, 11.2, 12.9, 13.9, 11, 7),  # moved, first token after the fault
    3: (3.0, 11.2, 11.5, 12.5, 11, 4),  # arrived during the failover
    4: None,  # a memory fault's victim
    5: (20.0, 20.0, 20.2, 20.2, 1, 4),  # one token: no TPOT
    6: (2.2, 2.2, 2.4, 14.4, 61, 5),  # moved, first token before the fault
}
FAULT = FailureRecord(
    kind="dead",
    die=2,
    role="colocated",
    injected_iteration=30,
    injected_wall_s=1.0,
    injected_virtual_s=2.5,
    detected_wall_s=5.0,
    detected_virtual_s=6.7,
    detected_by="heartbeat",
    verdict="dead",
    recovery="vertical scaling: 4 -> 3 decode dies; 2 requests re-prefilled on other DP groups",
    requests_affected=(2, 6),
)
MEMORY = FailureRecord(
    kind="memory",
    die=3,
    role="colocated",
    injected_iteration=60,
    injected_wall_s=3.0,
    injected_virtual_s=9.0,
    detected_wall_s=3.0,
    detected_virtual_s=9.0,
    detected_by="memory check",
    verdict="memory",
    requests_lost=(4,),
)


def _write(path, requests: dict, records, *, status="completed", summary=True) -> None:
    with h5py.File(path, "w") as f:
        f.attrs["status"] = status
        write_failures(f, records)
        if not summary:
            return
        f.create_group("summary").attrs.update(
            slo_ttft_ms=1000.0, slo_tpot_ms=150.0, recomputed_iterations=1, check_mismatches=0
        )
        ids = sorted(requests)
        group = f.create_group("requests")
        group["req_id"] = np.array(ids, np.int64)
        group["status"] = np.array(
            ["lost" if requests[r] is None else "done" for r in ids], dtype=h5py.string_dtype()
        )
        group["reason"] = np.array(
            [VICTIM if requests[r] is None else "" for r in ids], dtype=h5py.string_dtype()
        )
        group["arrival_s"] = np.array([4.0 if requests[r] is None else requests[r][0] for r in ids])
        group["prompt_len"] = np.array(
            [5 if requests[r] is None else requests[r][5] for r in ids], np.int64
        )
        served = [r for r in ids if requests[r] is not None]
        virtual = f.create_group("virtual")
        virtual["req_id"] = np.array(served, np.int64)
        rows = np.array([requests[r][:5] for r in served])  # [served, 5]
        arrival, decided, first, finish, tokens = rows.T
        virtual["arrival_s"], virtual["decided_s"] = arrival, decided
        virtual["first_token_s"], virtual["finish_s"] = first, finish
        virtual["ttft_s"] = first - arrival
        with np.errstate(invalid="ignore", divide="ignore"):
            virtual["tpot_s"] = np.where(tokens > 1, (finish - first) / (tokens - 1), NAN)


def _baseline(tmp_path):
    """The same window without the fault: every request served at its arrival + 0.3 s."""
    fault_free = {
        r: (t[0], t[0], t[0] + 0.3, t[0] + 1.3, 11, t[5]) if t else (4.0, 4.0, 4.3, 5.3, 11, 5)
        for r, t in REQUESTS.items()
    }
    _write(tmp_path / "base.h5", fault_free, [])
    return read_recovery(tmp_path / "base.h5")


def test_a_failover_s_costs_are_read_from_the_run_file(tmp_path):
    _write(tmp_path / "run.h5", REQUESTS, [FAULT, MEMORY])
    run = read_recovery(tmp_path / "run.h5")
    assert run.is_completed and run.num_requests == 7 and run.num_done == 6
    assert run.lost == ((4, VICTIM),)
    assert run.goodput_requests == 2  # requests 0 and 5
    assert run.goodput_fraction == pytest.approx(2 / 7)
    assert (run.fault_s, run.detected_s) == (2.5, 6.7)  # the earliest of the two records
    assert run.detect_s == pytest.approx(4.2)
    assert run.resumed_s == 11.2  # the moved request 2's decision: the resumption
    assert run.resume_s == pytest.approx(8.7)
    assert (run.verdict, run.detected_by) == ("dead", "heartbeat")
    # prompts 7 + 5, and request 6's first token before the fault: counted as one, inexact
    assert (run.num_moved, run.reprefill_tokens, run.reprefill_is_exact) == (2, 13, False)
    assert (run.recomputed_iterations, run.check_mismatches) == (1, 0)
    ttft = [0.3, 1.5, 10.9, 8.5, 0.2, 0.2]  # request 4 lost: none
    assert run.ttft_p99_ms == pytest.approx(np.percentile(ttft, 99) * 1e3)
    assert run.tpot_p99_ms == pytest.approx(np.percentile([0.1, 0.1, 0.1, 0.1, 0.2], 99) * 1e3)


def test_only_moved_requests_without_an_early_token_count_exactly(tmp_path):
    moved = FailureRecord(**{**vars(FAULT), "requests_affected": (2,)})
    _write(tmp_path / "run.h5", REQUESTS, [moved])
    run = read_recovery(tmp_path / "run.h5")
    assert (run.reprefill_tokens, run.reprefill_is_exact) == (7, True)


def test_recovered_is_the_arrival_after_the_last_late_request(tmp_path):
    _write(tmp_path / "run.h5", REQUESTS, [FAULT, MEMORY])
    run, base = read_recovery(tmp_path / "run.h5"), _baseline(tmp_path)
    # after the fault (2.5 s): request 3 late (8.5 s against 0.3 s), 4 lost, 5 on time at 20 s
    assert recovered_s(run, base, slack_s=0.25) == pytest.approx(17.5)
    assert recovered_s(base, base, slack_s=0.25) != recovered_s(base, base, slack_s=0.25)  # nan
    no_victim = {**REQUESTS, 4: (4.0, 4.0, 4.3, 5.3, 11, 5)}
    _write(tmp_path / "run2.h5", no_victim, [FAULT])
    assert recovered_s(read_recovery(tmp_path / "run2.h5"), base, slack_s=0.25) == 1.5  # at 4 s
    late_last = {**REQUESTS, 5: (20.0, 20.0, 22.0, 22.0, 1, 4)}
    _write(tmp_path / "run3.h5", late_last, [FAULT])
    assert math.isnan(recovered_s(read_recovery(tmp_path / "run3.h5"), base, slack_s=0.25))


def test_goodput_over_time_counts_the_good_requests_finished_by_each_time(tmp_path):
    _write(tmp_path / "run.h5", REQUESTS, [FAULT, MEMORY])
    finish, count = goodput_over_time(read_recovery(tmp_path / "run.h5"))
    assert list(finish) == [1.3, 20.2] and list(count) == [1, 2]  # requests 0 and 5


def test_a_stopped_run_has_its_fault_and_no_requests(tmp_path):
    stopped = FailureRecord(**{**vars(FAULT), "recovery": "none, the run stops"})
    why = "failed: health.on_expert_lost=stop: die rank 2: removing die 1 leaves no replica"
    _write(tmp_path / "stop.h5", {}, [stopped], status=why, summary=False)
    run = read_recovery(tmp_path / "stop.h5")
    assert not run.is_completed and run.status == why
    assert run.requests is None and (run.num_requests, run.goodput_requests) == (0, 0)
    assert run.detect_s == pytest.approx(4.2) and math.isnan(run.resumed_s)
    assert run.check_mismatches == -1
