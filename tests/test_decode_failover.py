"""Stuck and dead decode dies (xDeepServe §6.1): the TE-shell's heartbeats find them, its fence
releases the dies waiting for them, and the run never hangs: a stuck die back before
health.timeout_s ends as a transient (every token equal to the reference); a lost one stops the
run with an error naming it, after writing its failure record."""

from __future__ import annotations

import pytest
from test_recompute import serve
from test_serving import check_line

from xds_mpi.failures import read_failures

# Generous against false verdicts on a loaded machine; release grace = timeout_s / 2.
HEALTH = ["health.timeout_s=4", "health.dp_interval_s=0.2"]


def events(*rows: str) -> str:
    return "faults.events=[" + ", ".join(rows) + "]"


def served(tmp_path, *rows: str):
    result, run_file = serve(tmp_path, "colocated", [events(*rows), *HEALTH], timeout=400)
    assert run_file is not None, result.stdout[-3000:] + result.stderr[-3000:]
    return result, run_file, read_failures(run_file)


def assert_stopped(result, run_file, records, die: int, verdict: str, timeout_s: float = 4):
    """The run ended (no hang) with an error naming the die; one record, the detector's."""
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert f"die rank {die} ({verdict}) silent for more than health.timeout_s" in out
    assert run_file.attrs["status"].startswith("failed: die rank")
    [record] = records
    assert (record.die, record.verdict, record.detected_by) == (die, verdict, "heartbeat")
    # Silence counts from the die's last answer, which precedes its fault by up to an iteration.
    assert 0 < record.detection_s < timeout_s + 2, record.describe()
    assert record.detected_virtual_s > record.injected_virtual_s


def test_a_dead_die_mid_run_is_found_and_the_run_stops_naming_it(tmp_path):
    result, run_file, records = served(tmp_path, "{kind: dead, die: 2, iteration: 5}")
    assert_stopped(result, run_file, records, 2, "dead")
    assert records[0].injected_iteration == 5 and records[0].requests_affected
    # configs/colocated.yaml: die rank 2 (die index 1) holds experts 4-7, with no replica
    # elsewhere (no redundant slots), in each of the 3 MoE layers (mtp_depth 0).
    lost = "; ".join(f"layer {layer}: experts [4, 5, 6, 7]" for layer in range(3))
    stop = "health.on_expert_lost=stop: die rank 2: removing die 1 leaves no replica of: "
    assert stop + lost in result.stdout + result.stderr
    assert records[0].tokens_per_s_before > records[0].tokens_per_s_after


def test_a_stuck_die_back_before_the_timeout_is_a_transient(tmp_path):
    result, run_file, records = served(
        tmp_path, "{kind: stuck, die: 3, iteration: 4, duration_s: 1.5}"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == "check: 8 requests, 128 tokens, 0 mismatches"
    [record] = records  # no false verdict on any other die
    assert (record.kind, record.die, record.verdict) == ("stuck", 3, "transient")
    assert record.detection_s == -1 and record.injected_iteration == 4
    assert "silent for more than" not in result.stdout + result.stderr


MATRIX = [
    ("dead", 1, 0, "dead"),  # early: before its first iteration
    ("stuck", 4, 1, "dead"),  # early, for good: never answers again
    ("stuck", 2, 6, "stuck"),  # mid-run, back after the fence: answers again later
]


@pytest.mark.parametrize("kind, die, iteration, verdict", MATRIX)
def test_failure_matrix(tmp_path, request, kind, die, iteration, verdict):
    if not request.config.getoption("--failure-matrix"):
        pytest.skip("the {stuck, dead} x {early, mid-run} matrix runs with --failure-matrix")
    # Stuck for timeout + 1.5 graces: silent at detection and the first grace, back before the
    # second.
    duration = ", duration_s: 7" if verdict == "stuck" else ""
    row = f"{{kind: {kind}, die: {die}, iteration: {iteration}{duration}}}"
    result, run_file, records = served(tmp_path, row)
    assert_stopped(result, run_file, records, die, verdict)
