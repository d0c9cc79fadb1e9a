"""`xds-mpi submit` against a real Slurm: a job, an array job of a sweep, a job over its time
limit. The job script itself, without Slurm: tests/unit/launch/test_slurm_script.py.

These tests need a running Slurm (SLURM_CONF set, sbatch on PATH): `hpc/local_slurm.sh
run-tests python -m pytest tests` brings one up on this machine. Without one they skip, unless
XDS_MPI_SLURM=1 (set by run-tests and so in CI), where a missing Slurm fails them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
from harness import REPO_ROOT

from xds_mpi.config.schema import load_config
from xds_mpi.report.runfile import read_run_file

XDS_MPI = Path(sys.executable).parent / "xds-mpi"
COLOCATED = REPO_ROOT / "configs" / "colocated.yaml"
# A 5-rank job takes a few seconds on an idle 2-core machine but far longer when it is loaded:
# generous limits, so only a hung job fails on time.
JOB_TIMEOUT_S = 240


def xds_mpi(*args: str, cwd: Path, timeout: float = 120, env: dict | None = None):
    return subprocess.run(
        [str(XDS_MPI), *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env
    )


def _slurm_missing() -> str | None:
    if not os.environ.get("SLURM_CONF"):
        return (
            "SLURM_CONF is not set; run under `hpc/local_slurm.sh run-tests ...` or source "
            "the environment `hpc/local_slurm.sh start` prints"
        )
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH"
    out = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def slurm() -> None:
    missing = _slurm_missing()
    if missing and os.environ.get("XDS_MPI_SLURM") == "1":
        pytest.fail(f"XDS_MPI_SLURM=1 but no usable Slurm: {missing}")
    if missing:
        pytest.skip(missing)


@pytest.fixture(scope="module")
def timeout_job(slurm, tmp_path_factory):
    """A job whose launcher holds past a 1-minute limit. Slurm checks limits every 30 s, so it
    takes 60-90 s: it is submitted before the other Slurm tests and overlaps them."""
    workdir = tmp_path_factory.mktemp("timeout")
    slow = workdir / "slow-mpiexec"
    real = Path(sys.executable).parent / "mpiexec"
    # Answers --version at once (MPI detection at submit time), holds every launch.
    slow.write_text(
        f'#!/bin/bash\n[ "$1" = --version ] && exec {real} --version\nsleep 600\nexec {real} "$@"\n'
    )
    slow.chmod(0o755)
    proc = subprocess.Popen(
        [
            str(XDS_MPI),
            "submit",
            "--wait",
            "--time",
            "00:01:00",
            "--mpiexec",
            str(slow),
            "--set",
            "run.name=held",
        ],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc, workdir, time.monotonic()
    if proc.poll() is None:
        proc.kill()


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_a_job_runs_to_completion_and_writes_its_run_file(timeout_job, tmp_path):
    started = time.monotonic()
    # run.check: the TE-shell compares every served token with the single-process reference.
    result = xds_mpi(
        "submit",
        "--wait",
        "--set",
        "run.name=single",
        "--set",
        "run.check=true",
        cwd=tmp_path,
        timeout=JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = re.search(r"submitted job (\d+): 5 ranks on 1 node\(s\)", result.stdout).group(1)
    run_file = tmp_path / "runs" / "single.h5"
    assert f"job {job_id}: COMPLETED (exit 0:0" in result.stdout
    assert f"run file {run_file}" in result.stdout
    record = read_run_file(run_file)
    assert (record.name, record.status, record.world_size, record.num_dies) == (
        "single",
        "completed",
        5,
        4,
    )
    assert list(record.ranks["role"]) == ["host"] + ["colocated"] * 4
    assert record.config == load_config(COLOCATED, ["run.name=single", "run.check=true"])
    with h5py.File(run_file) as f:  # the decode results: all 8 requests served
        assert list(f["requests/status"].asstr()[()]) == ["done"] * 8
        assert f["summary"].attrs["check_mismatches"] == 0
    log = (tmp_path / "runs" / "jobs" / "single" / f"slurm-{job_id}.out").read_text()
    assert "summary: 8 requests served, 0 rejected" in log
    assert re.search(
        r"run completed; run file \S+\s+check: 8 requests, \d+ tokens, 0 mismatches$", log.rstrip()
    ), log[-2000:]
    assert f"run completed; run file {run_file}" in log
    print(f"single job: {time.monotonic() - started:.1f} s")


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_a_failed_job_leaves_no_shared_memory_on_its_node(timeout_job, tmp_path):
    """The job script removes what the ranks left in /dev/shm once they are gone, however they
    ended (launch/job/shm_leftovers.py on every node): here a launcher that leaves a segment, as a
    crashed rank's window does, and fails."""
    segment = Path("/dev/shm") / f"mpich_shm_xds_test_{os.getpid()}"
    crash = tmp_path / "crashing-mpiexec"
    real = Path(sys.executable).parent / "mpiexec"
    crash.write_text(
        f'#!/bin/bash\n[ "$1" = --version ] && exec {real} --version\n'
        f"head -c 8192 /dev/zero >{segment}\nexit 3\n"
    )
    crash.chmod(0o755)
    try:
        result = xds_mpi(
            "submit", "--wait", "--mpiexec", str(crash), "--set", "run.name=crashed",
            cwd=tmp_path, timeout=JOB_TIMEOUT_S,
        )  # fmt: skip
        assert result.returncode != 0, result.stdout + result.stderr
        job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
        assert f"job {job_id}: FAILED (exit 3:0" in result.stdout, result.stdout
        log = (tmp_path / "runs" / "jobs" / "crashed" / f"slurm-{job_id}.out").read_text()
        assert "removed 1 shared-memory segment(s) the job left in /dev/shm" in log, log
        assert not segment.exists()
    finally:
        segment.unlink(missing_ok=True)


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_a_three_element_sweep_writes_three_run_files(slurm, tmp_path):
    started = time.monotonic()
    result = xds_mpi(
        "submit",
        "--wait",
        "--launcher",
        "srun",
        "--set",
        "run.name=sweep",
        "--sweep",
        "xccl.ring_slots=4,8,16",
        cwd=tmp_path,
        timeout=2 * JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = re.search(r"submitted array job of 3 elements (\d+)", result.stdout).group(1)
    for i, slots in enumerate([4, 8, 16]):
        assert f"job {job_id}_{i}: COMPLETED (exit 0:0" in result.stdout, result.stdout
        record = read_run_file(tmp_path / "runs" / f"sweep-{i}.h5")
        assert (record.name, record.status, record.world_size) == (f"sweep-{i}", "completed", 5)
        assert record.config.xccl.ring_slots == slots
    assert sorted(p.name for p in (tmp_path / "runs").glob("*.h5")) == [
        "sweep-0.h5",
        "sweep-1.h5",
        "sweep-2.h5",
    ]
    print(f"3-element sweep: {time.monotonic() - started:.1f} s")


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_a_job_over_its_time_limit_is_reported_as_timeout(timeout_job):
    proc, workdir, started = timeout_job
    stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 124, stdout + stderr
    job_id = re.search(r"submitted job (\d+)", stdout).group(1)
    assert f"job {job_id}: TIMEOUT" in stdout and "over its time limit 00:01:00" in stdout
    assert f"did not complete: {job_id} TIMEOUT" in stderr
    assert stderr.count("\n") == 1
    assert not (workdir / "runs" / "held.h5").exists()
    print(f"time-limit job: {time.monotonic() - started:.1f} s")
