"""The MPI test harness cannot hang: failures and stuck jobs end in seconds, with the reason."""

from __future__ import annotations

import os
import time

import pytest
from harness import MPI_DIR, explain, run_bodies, run_mpi


@pytest.mark.parametrize("num_procs", [2, 4])
def test_a_raising_rank_ends_the_job_with_its_message(num_procs):
    started = time.monotonic()
    result = run_mpi(
        num_procs, [str(MPI_DIR / "raise_script.py"), str(num_procs - 1)], timeout_s=60
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0, explain(result)
    assert not result.timed_out, explain(result)
    assert f"rank {num_procs - 1} raises on purpose" in result.output, explain(result)
    assert elapsed < 10, f"took {elapsed:.1f} s\n{explain(result)}"


def test_a_failing_mpi_test_aborts_the_job_with_its_message():
    started = time.monotonic()
    result = run_bodies(4, MPI_DIR / "abort_case.py", timeout_s=60)
    elapsed = time.monotonic() - started
    assert result.returncode != 0 and not result.timed_out, explain(result)
    assert "die 0 (rank 1) found a wrong token" in result.output, explain(result)
    assert "[rank 1] FAILED" in result.output, explain(result)
    assert elapsed < 10, f"took {elapsed:.1f} s\n{explain(result)}"


def test_a_stuck_job_is_killed_at_its_timeout(tmp_path):
    pid_file = tmp_path / "pids"
    started = time.monotonic()
    result = run_mpi(2, [str(MPI_DIR / "hang_script.py"), str(pid_file)], timeout_s=2)
    elapsed = time.monotonic() - started
    assert result.timed_out, explain(result)
    assert elapsed < 2 + 10 + 5, f"took {elapsed:.1f} s"
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2
    time.sleep(0.5)
    survivors = [p for p in pids if _alive(p)]
    assert not survivors, f"ranks {survivors} outlived the job"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead but still listed
        return stat.read().split()[2] != "Z"


def test_the_process_group_is_killed_when_mpi_timeout_does_not_fire(tmp_path):
    # A launcher that ignores MPIEXEC_TIMEOUT: the outer kill must still end it and its children.
    from launch.job.mpiexec import MpiCommand, run_job

    pid_file = tmp_path / "pid"
    script = f"sleep 3600 & echo $! > {pid_file}; wait"
    started = time.monotonic()
    result = run_job(MpiCommand(argv=("sh", "-c", script), env={}), timeout_s=1, capture=True)
    assert result.timed_out and time.monotonic() - started < 5
    time.sleep(0.3)
    assert not _alive(int(pid_file.read_text())), "the child of the killed job survived"
