"""The run file: written by the TE-shell at the end of `xds-mpi run`, read back field by field."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from harness import REPO_ROOT

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.topology import Topology
from xds_mpi.report.runfile import read_run_file, run_file_path, write_run_file

XDS_MPI = Path(sys.executable).parent / "xds-mpi"


def test_round_trip_keeps_config_topology_and_status(tmp_path):
    cfg = load_config(REPO_ROOT / "configs" / "afd.yaml", ["xccl.ring_slots=5"])
    topo = Topology.from_config(cfg)
    started = datetime(2025, 1, 2, 3, 4, 5, 6)
    path = write_run_file(
        tmp_path / "a" / "r.h5",
        cfg=cfg,
        topo=topo,
        status="failed: x",
        started_at=started,
        wall_time_s=1.5,
        handshake_s=0.25,
    )
    record = read_run_file(path)
    assert record.config == cfg and record.config.xccl.ring_slots == 5
    assert (record.name, record.status, record.world_size, record.num_dies) == (
        "r",
        "failed: x",
        8,
        7,
    )
    assert (record.wall_time_s, record.handshake_s) == (1.5, 0.25)
    assert record.started_at == "2025-01-02T03:04:05.000006"
    assert record.topology == topo.summary()
    assert list(record.ranks["role"]) == ["host"] + ["attention"] * 4 + ["expert"] * 3
    assert np.array_equal(record.ranks["die_idx"], [-1, 0, 1, 2, 3, 4, 5, 6])
    assert not list(path.parent.glob(".*.tmp"))  # the temp file was renamed away


def test_run_name_defaults_to_the_start_time_and_may_be_set():
    started = datetime(2025, 1, 2, 3, 4, 5, 6)
    cfg = load_config(REPO_ROOT / "configs" / "colocated.yaml")
    assert run_file_path(cfg, started).parent == Path("runs")
    assert run_file_path(cfg, started).name.startswith("run-20250102-030405-000006-")
    named = load_config(REPO_ROOT / "configs" / "colocated.yaml", ["run.name=mine"])
    assert run_file_path(named, started) == Path("runs/mine.h5")
    with pytest.raises(ConfigError, match="run.name must be a file name without '/'"):
        load_config(REPO_ROOT / "configs" / "colocated.yaml", ["run.name=a/b"])


def test_xds_mpi_run_writes_the_run_file_and_names_it_last(tmp_path):
    result = subprocess.run(
        [str(XDS_MPI), "run", "--set", "run.name=here", "--set", f"run.output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    path = tmp_path / "here.h5"
    assert result.stdout.rstrip().endswith(f"run completed; run file {path}")
    record = read_run_file(path)
    assert (record.status, record.world_size, record.config.run.name) == ("completed", 5, "here")
    assert 0 < record.handshake_s <= record.wall_time_s
