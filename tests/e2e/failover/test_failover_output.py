"""A failover run ends with its check line and nothing after it: no UCX warnings about the windows
the lost die leaves allocated (launch/job/mpiexec.py FAILOVER_ENV says why they are left)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import REPO_ROOT

XDS_MPI = Path(sys.executable).parent / "xds-mpi"


def test_a_failover_run_prints_no_ucx_warnings(tmp_path):
    sets = [
        "health.timeout_s=4",
        "health.dp_interval_s=0.2",
        "deployment.redundant_slots_per_die=4",
        "health.replicas=ring",
        "faults.events=[{kind: dead, die: 2, iteration: 5}]",
        f"run.output_dir={tmp_path}",
    ]
    argv = [str(XDS_MPI), "run", "--check", *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "vertical scaling: 4 -> 3 decode dies" in output
    assert "0 mismatches" in output
    warnings = [line for line in output.splitlines() if "UCX" in line and "WARN" in line]
    assert not warnings, f"{len(warnings)} UCX warnings, the first: {warnings[0]}"
