"""`xds-mpi plan` end to end on a small synthetic window: the search, the table, the plot, the
frontier's configs (each loads and validates), and `--verify 1`'s emulation on the virtual
clock with its planned-vs-emulated row."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO_ROOT

from xds_mpi.config.schema import load_config

XDS_MPI = Path(sys.executable).parent / "xds-mpi"


@pytest.mark.timeout(180)
def test_plan_writes_the_frontier_and_verifies_the_top_candidate(tmp_path):
    out = tmp_path / "plan"
    args = [
        "plan",
        "--synthetic",
        "2000,100",
        "--rate",
        "4",
        "--duration",
        "10",
        "--chips",
        "48",
        "--kinds",
        "colocated,pd",
        "--mtp",
        "1",
        "--slo",
        "ttft=3s,tpot=50ms",
        "--verify",
        "1",
        "--verify-requests",
        "4",
        "--out",
        str(out),
        "--timeout",
        "120",
    ]
    result = subprocess.run(
        [str(XDS_MPI), *args], capture_output=True, text=True, timeout=170, cwd=REPO_ROOT
    )
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    assert "ranked by goodput per chip" in text and "Pareto frontier" in text
    assert (out / "plan.png").stat().st_size > 0
    configs = sorted(out.glob("frontier_*.yaml"))
    assert configs
    for path in configs:
        cfg = load_config(path)
        assert cfg.deployment.dp_groups_per_domain >= 16  # pod scale, as planned
    check = subprocess.run(
        [str(XDS_MPI), "validate", str(configs[0])],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # the verification's row: planned and emulated goodput, both numbers (not "failed")
    lines = text.splitlines()
    table_at = next(i for i, line in enumerate(lines) if line.startswith("planned vs emulated"))
    row = lines[table_at + 3]  # the title, the header, the rule, then candidate 1
    assert row.startswith("1 ") and "(pd) x" in row or "(colocated) x" in row, row
    assert "failed" not in row
    numbers = re.findall(r"\d+\.\d{4}", row)
    assert len(numbers) >= 2, row
    # beside goodput, the distributions: 4 quantiles with their errors, the verdict flips of 4
    assert len(re.findall(r"\([+-]\d+%\)", row)) == 4, row
    assert re.search(r" [0-4]/4 \(\d+%\) ", row) and ("agree" in row or "MISS" in row), row
