"""Failover on the virtual clock (run.clock virtual, docs/virtual_time.md): a lost die's failover
priced as the pod would pay it (detection, release, rebuild: xds_mpi/plan/failures/loss.py
FailoverCost), its requests readmitted at the virtual time it completes, and the same config
giving the same virtual results beside busy processes, on colocated and afd dies alike; a row at
a virtual time (`at_s`) fires at the first iteration starting at or after it."""

from __future__ import annotations

import re

import numpy as np
import pytest
from harness import REPO_ROOT, busy_processes
from test_decode_failover import HEALTH, RING
from test_recompute import serve
from test_serving import check_line
from test_virtual_time import _virtual_columns

from xds_mpi.config.schema import load_config
from xds_mpi.plan.failures.loss import REBUILD_S, FailoverCost
from xds_mpi.results.failures import read_failures

# Requests arrive while the dies serve (some during the failover), on 4 dies with ring replicas.
WORKLOAD = [
    "workload.num_requests=12",
    "workload.arrival=rate",
    "workload.rate_per_s=20",
    "workload.output_len=12",
    "workload.ignore_eos=true",
]
SERVED = "check: 12 requests, 144 tokens, 0 mismatches"
COLOCATED = REPO_ROOT / "configs" / "colocated.yaml"


def _served(tmp_path, row: str, num_busy: int = 0, config: str = "colocated"):
    """A run with `row` on `config` (colocated: with ring replicas; afd: an attention die's loss
    needs none, its DP domain goes on with the die it has left)."""
    ring = RING if config == "colocated" else []
    with busy_processes(num_busy):
        settings = [f"faults.events=[{row}]", *HEALTH, *ring, *WORKLOAD]
        result, run_file = serve(tmp_path, config, settings, timeout=400)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert check_line(result) == SERVED
    assert run_file["summary"].attrs["serving_clock"] == "virtual"
    return out, run_file


def test_the_failover_s_price_is_detection_release_and_rebuild():
    cfg = load_config(COLOCATED, HEALTH)  # timeout_s 4, dp_interval_s 0.2: graces of 2 s
    cost = FailoverCost.of(cfg.health)
    assert (cost.detection_s, cost.release_s, cost.rebuild_s) == (4.2, 4.0, REBUILD_S)
    assert cost.total_s == pytest.approx(8.7, abs=1e-12)


@pytest.mark.parametrize(
    "config",
    [
        "colocated",
        # afd: before, its dies sent no clock with their Ready and kept their clocks through
        # the rebuild: the TE-shell took the fault at -1 s and resumed at 7.7 s, whatever the
        # fault's time, while the survivors served on unpriced.
        pytest.param("afd", marks=pytest.mark.failure_matrix),
    ],
)
def test_a_dead_die_gives_the_same_virtual_results_beside_busy_processes(tmp_path, config):
    row = "{kind: dead, die: 2, iteration: 5}"  # afd: an attention die of domain 0
    runs = []
    for i, num_busy in enumerate((0, 2)):
        out, run_file = _served(tmp_path / f"run{i}", row, num_busy, config)
        runs.append((_virtual_columns(run_file), read_failures(run_file)))
    (quiet, [record]), (loaded, [record_loaded]) = runs
    assert quiet.keys() == loaded.keys()
    for name in quiet:
        assert np.array_equal(quiet[name], loaded[name], equal_nan=True), name
    assert record.detected_virtual_s == record_loaded.detected_virtual_s
    # The failover's price: the lost die's requests and those that arrived meanwhile are
    # decided when it completes, the fault's virtual time plus detection, release and rebuild.
    cost = FailoverCost.of(load_config(COLOCATED, HEALTH).health)
    assert "failover on the virtual clock: fault at" in out
    assert record.verdict == "dead" and record.requests_affected
    decided, arrival = quiet["virtual/decided_s"], quiet["virtual/arrival_s"]
    resumed_s = decided.max()
    orphans = list(record.requests_affected)
    assert np.all(decided[orphans] == resumed_s)
    fault_s = resumed_s - cost.total_s
    [logged] = re.findall(r"failover on the virtual clock: fault at (\S+) s", out)
    assert float(logged) == pytest.approx(fault_s, abs=1e-5) and fault_s > 0
    assert record.detected_virtual_s == pytest.approx(fault_s + cost.detection_s, abs=1e-9)
    assert np.all(decided[decided < resumed_s] < fault_s)  # none decided during the failover
    assert np.all(decided[arrival > fault_s] == resumed_s)  # arrivals meanwhile: at resumption
    assert quiet["virtual/finish_s"].min() > resumed_s  # the survivors waited it out too


@pytest.mark.parametrize(
    "config",
    [
        "colocated",
        # afd: before, its dies never checked an at_s row ("never injected: the run ended
        # before it", though the run served past it)
        "afd",
    ],
)
def test_an_at_s_dead_row_falls_silent_at_the_first_iteration_starting_at_or_after_it(
    tmp_path, config
):
    at_s = 0.3
    _, run_file = _served(tmp_path, f"{{kind: dead, die: 2, at_s: {at_s}}}", config=config)
    [record] = read_failures(run_file)
    assert record.verdict == "dead"
    # The iteration it did not run started at injected_virtual_s (the dies' common start), at
    # or after at_s; the one before it started before at_s: at the latest the common start
    # less the longest a survivor took for it (the lost die leaves no die report).
    n = record.injected_iteration
    assert n > 0
    before = max(float(run_file[f"dies/{d}/vtime_s"][()][n - 1]) for d in run_file["dies"])
    assert record.injected_virtual_s >= at_s
    assert record.injected_virtual_s - before < at_s
