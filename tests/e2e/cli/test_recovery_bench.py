"""`xds-mpi bench recovery` (launch/bench/recovery.py) end to end on a small workload: a die dead
mid-run under two policies (ring replicas, and none: the run stops) beside the fault-free run,
and a refused policy; the priced failover read back as the times to detect and to resume."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

from xds_mpi.config.schema import load_config
from xds_mpi.plan.failures.loss import FailoverCost

HEALTH = ["health.timeout_s=4", "health.dp_interval_s=0.2"]
WORKLOAD = [
    "workload.num_requests=12",
    "workload.arrival=rate",
    "workload.rate_per_s=20",
    "workload.output_len=12",
    "workload.ignore_eos=true",
    "run.slo_tpot_ms=200",
]


def test_a_dead_die_under_ring_replicas_and_under_stop(tmp_path):
    plot, out = tmp_path / "recovery.png", tmp_path / "recovery.csv"
    command = [sys.executable, "-m", "launch.cli.main", "bench", "recovery", "colocated"]
    command += ["--scenario", "dead=[{kind: dead, die: 2, iteration: 5}]"]
    command += ["--policies", "ring", "stop", "restart", "--timeout", "200"]
    command += ["--plot", str(plot), "--out", str(out)]
    for s in HEALTH + WORKLOAD:
        command += ["--set", s]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with out.open() as f:
        rows = {(r["scenario"], r["policy"]): r for r in csv.DictReader(f)}
    assert list(rows) == [
        ("no fault", "-"),
        ("dead", "ring"),
        ("dead", "stop"),
        ("dead", "restart"),
    ]
    base, ring, stop, restart = rows.values()
    assert (base["outcome"], base["lost"], base["mismatches"]) == ("served", "0", "0")
    assert base["goodput"].endswith("/12") and base["detect_s"] == "-"
    # The failover's price on the virtual clock: detection, then release and rebuild before the
    # survivors decide the moved requests.
    cost = FailoverCost.of(load_config("configs/colocated.yaml", HEALTH).health)
    assert (ring["outcome"], ring["lost"], ring["mismatches"]) == ("dead", "0", "0")
    assert float(ring["detect_s"]) == pytest.approx(cost.detection_s, abs=0.005)
    assert float(ring["resume_s"]) == pytest.approx(cost.total_s, abs=0.005)
    assert int(ring["reprefilled"].rstrip("+")) > 0 and ring["goodput"].endswith("/12")
    # TTFT p99 includes the failover for the moved requests
    assert float(ring["ttft_p99_ms"]) > cost.total_s * 1e3 > float(base["ttft_p99_ms"])
    assert stop["outcome"].startswith("stopped") and stop["lost"] == "all open"
    assert (
        restart["outcome"].startswith("refused: ")
        and "on_expert_lost=restart" in restart["outcome"]
    )
    assert plot.stat().st_size > 10_000
