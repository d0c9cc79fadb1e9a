"""Stuck and dead decode dies (xDeepServe §6.1-6.2): the TE-shell's heartbeats find them, its fence
releases the dies waiting for them, and the run never hangs. A stuck die back before
health.timeout_s is a transient; a lost die whose experts all keep a replica (health.replicas
ring) is scaled away and its requests re-prefilled elsewhere, every token equal to the reference;
a lost die holding an expert's last replica stops the run with an error naming both."""

from __future__ import annotations

import pytest
from test_recompute import serve
from test_serving import check_line

from xds_mpi.results.failures import read_failures

# Generous against false verdicts on a loaded machine; release grace = timeout_s / 2.
HEALTH = ["health.timeout_s=4", "health.dp_interval_s=0.2"]
RING = ["deployment.redundant_slots_per_die=4", "health.replicas=ring"]
SERVED = "check: 8 requests, 128 tokens, 0 mismatches"


def served(tmp_path, rows: list[str], *settings: str, config: str = "colocated"):
    events = "faults.events=[" + ", ".join(rows) + "]"
    result, run_file = serve(tmp_path, config, [events, *HEALTH, *settings], timeout=400)
    assert run_file is not None, result.stdout[-3000:] + result.stderr[-3000:]
    return result, run_file, read_failures(run_file)


def assert_detected(record, die: int, verdict: str, timeout_s: float = 4):
    assert (record.die, record.verdict, record.detected_by) == (die, verdict, "heartbeat")
    # Silence counts from the die's last answer, which precedes its fault by up to an iteration.
    assert 0 < record.detection_s < timeout_s + 2, record.describe()
    assert record.detected_virtual_s > record.injected_virtual_s


def assert_scaled(
    result, records, die: int, verdict: str, recovery: str, served: str = SERVED, patience_s=4
):
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert check_line(result) == served
    [record] = records  # no false verdict on any other die
    assert_detected(record, die, verdict, patience_s)
    assert record.recovery.startswith(recovery), record.describe()
    assert record.tokens_per_s_after > 0
    return record


@pytest.mark.failure_cell("colocated", "dead")
def test_a_dead_die_mid_run_is_scaled_away_and_its_requests_served_elsewhere(tmp_path):
    result, _, records = served(tmp_path, ["{kind: dead, die: 2, iteration: 5}"], *RING)
    record = assert_scaled(result, records, 2, "dead", "vertical scaling: 4 -> 3 decode dies")
    assert record.injected_iteration == 5 and record.requests_affected
    assert record.tokens_per_s_before > 0


def test_a_dead_die_holding_the_last_replica_stops_the_run_naming_die_and_experts(tmp_path):
    result, run_file, records = served(tmp_path, ["{kind: dead, die: 2, iteration: 5}"])
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert run_file.attrs["status"].startswith("failed: die rank 2 (dead) silent")
    [record] = records
    assert_detected(record, 2, "dead")
    # configs/colocated.yaml: die rank 2 (die index 1) holds experts 4-7, with no replica
    # elsewhere (no redundant slots), in each of the 3 MoE layers (mtp_depth 0).
    lost = "; ".join(f"layer {layer}: experts [4, 5, 6, 7]" for layer in range(3))
    stop = "health.on_expert_lost=stop: die rank 2: removing die 1 leaves no replica of: "
    assert stop + lost in out


@pytest.mark.failure_cell("colocated", "stuck")
def test_a_stuck_die_back_before_the_timeout_is_a_transient(tmp_path):
    rows = ["{kind: stuck, die: 3, iteration: 4, duration_s: 1.5}"]
    result, _, records = served(tmp_path, rows)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == SERVED
    [record] = records  # no false verdict on any other die
    assert (record.kind, record.die, record.verdict) == ("stuck", 3, "transient")
    assert record.detection_s == -1 and record.injected_iteration == 4
    assert "silent for more than" not in result.stdout + result.stderr


@pytest.mark.failure_matrix
def test_a_stuck_die_back_before_the_timeout_with_mtp_is_a_transient(tmp_path):
    """With MTP drafts (depth 1): the stall loses no die, so nothing is prefilled again and
    the drafts and their acceptance equal the reference's step by step."""
    rows = ["{kind: stuck, die: 3, iteration: 4, duration_s: 1.5}"]
    result, run_file, records = served(tmp_path, rows, "scheduler.mtp_depth=1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == SERVED
    [record] = records
    assert (record.kind, record.die, record.verdict) == ("stuck", 3, "transient")
    assert run_file["summary"].attrs["mtp_accepted"] > 0


# Stuck for timeout + 1.5 graces (7 s): silent through detection and the first grace (lost),
# back during the second (verdict stuck). Stuck for 5 s: back within the first grace, nobody
# lost: the buffers are rebuilt on every die and the interrupted iteration recomputed.
# Early (iteration 0 or 1): the peers wait for the die from their first iteration on and may
# never have answered a heartbeat; with no pace shown the detector waits up to its ceiling,
# xccl.poll_timeout_s - dp_interval_s - 2 graces (ranks/recovery/watch.py): 12 s -> 7.8 s.
EARLY = ["xccl.poll_timeout_s=12"]
CEILING_S = 12 - 0.2 - 2 * 2
REBUILT_ON_4 = "buffers rebuilt on all 4"
MATRIX = [  # dead at iteration 0: the default-suite test after this one
    ("{kind: stuck, die: 4, iteration: 1}", 4, "dead", "vertical scaling: 4 -> 3", EARLY),
    ("{kind: stuck, die: 2, iteration: 6, duration_s: 7}", 2, "stuck", "vertical scaling", []),
    ("{kind: stuck, die: 3, iteration: 4, duration_s: 5}", 3, "stuck", REBUILT_ON_4, []),
]


@pytest.mark.parametrize("row, die, verdict, recovery, settings", MATRIX)
def test_failure_matrix(tmp_path, request, row, die, verdict, recovery, settings):
    if not request.config.getoption("--failure-matrix"):
        pytest.skip("the {stuck, dead} x {early, mid-run} matrix runs with --failure-matrix")
    result, _, records = served(tmp_path, [row], *RING, *settings)
    assert_scaled(result, records, die, verdict, recovery, patience_s=CEILING_S if settings else 4)


def test_a_die_dead_at_its_first_iteration_is_found_at_the_ceiling_and_scaled_away(tmp_path):
    """In the default suite (the rest of the matrix runs with --failure-matrix): no die answers
    before the first iteration, so only the ceiling finds this one; without it the run ended
    on the peers' XCCL timeout."""
    result, _, records = served(tmp_path, ["{kind: dead, die: 1, iteration: 0}"], *RING, *EARLY)
    record = assert_scaled(
        result, records, 1, "dead", "vertical scaling: 4 -> 3", patience_s=CEILING_S
    )
    assert record.injected_iteration == 0
    assert "no die had answered yet" in result.stdout + result.stderr


def test_eight_dies_lose_one_mid_run(tmp_path, request):
    if not request.config.getoption("--failure-matrix"):
        pytest.skip("8 dies losing one runs with --failure-matrix")
    eight = [
        "deployment.dp_groups_per_domain=8",
        "deployment.redundant_slots_per_die=2",  # 16 experts: 2 routed per die
        "health.replicas=ring",
        "workload.num_requests=16",
    ]
    result, _, records = served(tmp_path, ["{kind: dead, die: 5, iteration: 6}"], *eight)
    served_16 = "check: 16 requests, 256 tokens, 0 mismatches"
    record = assert_scaled(result, records, 5, "dead", "vertical scaling: 8 -> 7", served_16)
    print(record.describe())


def test_dies_slower_than_the_timeout_are_not_fenced(tmp_path):
    """An emulated iteration can outlast health.timeout_s (ep288 on one workstation: seconds
    per iteration): the detector waits 3x the slowest gap the dies showed between two answers.
    With the fixed timeout this run fenced every healthy die and stopped (before the pace)."""
    fast = ["health.timeout_s=0.05", "health.dp_interval_s=0.01", "health.control_interval_s=0.01"]
    result, run_file = serve(tmp_path, "colocated", fast, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert check_line(result) == SERVED
    assert "fenced" not in out
    assert "a die is now suspected after" in out  # the log says why it waits longer
    assert read_failures(run_file) == []


def test_a_silence_a_fence_found_harmless_becomes_the_pace():
    """A fence after which every die answered (ranks/recovery/detector.py): the silence it
    ended (the first busy iteration's, no answer had shown it) counts as pace, so the
    recomputed iteration is not fenced again for the same slowness; up to the ceiling."""
    from mpi4py import MPI

    from ranks.recovery.watch import HeartbeatSender

    sender = HeartbeatSender(MPI.COMM_SELF, [0], interval_s=0.2, timeout_s=10, ceiling_s=45)
    sender.started_at, sender.last_answer[0] = 0.0, 0.0
    assert sender.silent(now=11) == [0]  # no pace yet: health.timeout_s
    assert sender.silence_s(0, now=11) == 11
    sender.count_silence(11)
    assert sender.patience_s == 33
    assert sender.silent(now=30) == [] and sender.silent(now=34) == [0]
    sender.count_silence(20)
    assert sender.patience_s == 45  # 3 x 20, capped before the peers' XCCL waits time out
