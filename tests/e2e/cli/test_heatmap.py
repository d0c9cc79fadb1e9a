"""`xds-mpi heatmap` end to end on a 1 x 1 x 1 grid: two `xds-mpi run`s (the PD pair and the
colocated TE), the file read back, its cell the two runs' mean JCTs' gain."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO_ROOT

from xds_mpi.cluster.heatmap import read_heatmap

XDS_MPI = Path(sys.executable).parent / "xds-mpi"


@pytest.mark.timeout(240)
def test_a_one_cell_study_writes_a_finite_cell(tmp_path):
    out = tmp_path / "study"
    args = ["heatmap", "--prompts", "64", "--ratios", "0.25", "--rps", "4", "--requests", "4"]
    result = subprocess.run(
        [str(XDS_MPI), *args, "--out", str(out), "--timeout", "180"],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "run 2/2 prompt64_ratio0.25_rps4 pd: mean JCT" in result.stdout
    assert "(DeepServe §5.3.1: over 80%)" in result.stdout
    heatmap = read_heatmap(out / "heatmap.json")
    assert (out / "heatmap.png").stat().st_size > 0
    assert heatmap.rps == (4.0,) and heatmap.cell_of(64, 16) == (0, 0)
    jct = heatmap.meta["jct_s"]
    colocated, pd = jct["colocated"][0][0][0], jct["pd"][0][0][0]
    # each batch's last request arrives at 0.75 s, and every JCT holds at least a decode step
    assert 0 < colocated < 60 and 0 < pd < 60
    cell = heatmap.cells[0][0][0]
    assert math.isfinite(cell) and cell == pytest.approx(colocated / pd - 1)
    assert heatmap.combined == ((cell,),) and heatmap.sign_stable_share == 1.0
    assert heatmap.meta["failed"] == []
