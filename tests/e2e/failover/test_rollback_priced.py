"""A rolled-back attempt costs virtual time (token recomputation on the virtual clock,
ranks/recovery/recompute.py): the failed attempt up to its detection and the rollback's price
stay on every die's clock, so the requests served after the fault finish later than in the same
run without it. Before, the rollback restored the dies' clocks and a recomputed attempt was free:
a 1.5 s stall recomputed on an XCCL timeout left every finish time where the fault-free run had
it. With rollbacks priced, PD's transient decode faults run on the virtual clock too."""

from __future__ import annotations

import numpy as np
import pytest
from harness import busy_processes
from test_recompute import serve
from test_serving import check_line
from test_virtual_time import _virtual_columns

# 8 requests at t=0 of 16 tokens each (configs/colocated.yaml), whatever EOS says: the batches
# do not depend on when the iterations run, so a fault only shifts the finish times.
FIXED = ["workload.ignore_eos=true"]
SERVED = "check: 8 requests, 128 tokens, 0 mismatches"


def _finishes(tmp_path, name: str, settings: list[str]) -> tuple[np.ndarray, float]:
    """(each request's virtual finish, the summary's virtual time lost to rollbacks)."""
    result, run_file = serve(tmp_path / name, "colocated", [*FIXED, *settings])
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert check_line(result) == SERVED
    summary = run_file["summary"].attrs
    assert summary["serving_clock"] == "virtual"
    return run_file["virtual/finish_s"][:], float(summary["vtime_lost_s"])


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> np.ndarray:
    finishes, lost_s = _finishes(tmp_path_factory.mktemp("clean"), "clean", [])
    assert lost_s == 0.0
    return finishes


def test_an_injected_fault_moves_every_later_finish_by_the_attempt_s_cost(tmp_path, fault_free):
    table = "faults.table=[{die: 2, op: combine, layer: 2, iteration: 4}]"
    finishes, lost_s = _finishes(tmp_path, "fault", [table])
    # The failed attempt ran up to die 2's second MoE layer: tens of virtual ms on this config.
    assert lost_s > 0.01
    # Every request is still decoding at iteration 4: each finishes exactly that much later.
    np.testing.assert_allclose(finishes - fault_free, lost_s, rtol=0, atol=1e-9)


def test_a_stall_recomputed_on_a_timeout_costs_the_stall(tmp_path, fault_free):
    """The bench-recovery scenario (faults.on_timeout recompute), small: die 3 stuck 1.5 s in
    iteration 4's dispatch; its peers time out after 0.5 s and vote, the vote completes when die
    3 is back, and the iteration is recomputed. The pod's dies waited out the stall."""
    settings = [
        "faults.on_timeout=recompute",
        "xccl.poll_timeout_s=0.5",
        "health.timeout_s=4",
        "faults.events=[{kind: stuck, die: 3, iteration: 4, duration_s: 1.5}]",
    ]
    finishes, lost_s = _finishes(tmp_path, "stuck", settings)
    assert 1.5 <= lost_s < 1.6  # the stall and the attempt's start before it
    np.testing.assert_allclose(finishes - fault_free, lost_s, rtol=0, atol=1e-9)


# PD: configs/pd.yaml, 6 requests at t=0 of 5 tokens each, decode die 4's dispatch at MoE layer
# 1 failing in its third iteration; configs/pd_afd.yaml (6 requests, MTP depth 1), A2E and E2A
# calls failing at 5 % per die and iteration (seed 1: 6 faults in 2 iterations).
PD_CASES = {
    "pd": (
        [
            "workload.num_requests=6",
            "workload.output_len=5",
            "workload.max_output_len=5",
            "workload.ignore_eos=true",
        ],
        ["faults.table=[{die: 4, op: dispatch, layer: 1, iteration: 2}]"],
        "check: 6 requests, 30 tokens, 0 mismatches",
    ),
    "pd_afd": (
        ["scheduler.mtp_depth=1", "run.seed=1"],
        [
            "faults.rate=0.05",
            "faults.rate_unit=iteration",
            "faults.ops=[a2e, e2a]",
        ],
        "check: 6 requests, 48 tokens, 0 mismatches",
    ),
}


def _pd_served(tmp_path, config: str, faults: list[str], num_busy: int = 0):
    workload, _, served = PD_CASES[config]
    with busy_processes(num_busy):
        result, run_file = serve(tmp_path, config, [*workload, *faults])
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert check_line(result) == served
    assert run_file["summary"].attrs["serving_clock"] == "virtual"
    return run_file


def test_pd_decode_faults_run_on_the_virtual_clock_and_cost_their_attempts(tmp_path):
    """Transient faults on PD's decode dies run on the virtual clock (before: PD with any fault
    ran on the wall clock, xds_mpi/plan/clock.py): the same virtual results beside busy
    processes, and the requests decoding at a fault finish later by its cost."""
    _served_on_the_virtual_clock(tmp_path, "pd")


@pytest.mark.failure_matrix
def test_pd_afd_decode_faults_run_on_the_virtual_clock_and_cost_their_attempts(tmp_path):
    """The same with afd decode dies (attention and expert dies' A2E and E2A)."""
    _served_on_the_virtual_clock(tmp_path, "pd_afd")


def _served_on_the_virtual_clock(tmp_path, config: str) -> None:
    faults = PD_CASES[config][1]
    clean = _pd_served(tmp_path / "clean", config, [])
    quiet = _pd_served(tmp_path / "quiet", config, faults)
    loaded = _pd_served(tmp_path / "loaded", config, faults, num_busy=2)
    assert quiet["summary"].attrs["rollbacks"] > 0
    quiet_columns, loaded_columns = _virtual_columns(quiet), _virtual_columns(loaded)
    for name in quiet_columns:
        assert np.array_equal(quiet_columns[name], loaded_columns[name], equal_nan=True), name
    lost_s = float(quiet["summary"].attrs["vtime_lost_s"])
    moved = quiet["virtual/finish_s"][:] - clean["virtual/finish_s"][:]
    # A request decoding at a fault moves by the attempts failed while it decoded; one that
    # joins later, after its KV lands, may be delayed by them, never advanced.
    assert np.all(moved >= 0) and moved.max() > 0
    assert moved.max() <= lost_s + 1e-9
    if config == "pd":  # one fault: the first prefill batch, decoding then, moves by all of it
        assert np.isclose(moved, lost_s, rtol=0, atol=1e-9).any()
