"""Run MPI jobs from plain pytest tests so that no test can hang.

Every job runs in its own process group under `python -m mpi4py` (one rank's exception aborts the
job), with MPIEXEC_TIMEOUT set, and the whole group is killed if it outlives the timeout. MPI test
bodies (tests/mpi/body_*.py) run under pytest-mpi at several rank counts through `run_bodies`;
tests/mpi/conftest.py aborts the job as soon as one rank's test fails, after printing why.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from launch.job.mpiexec import JobResult, mpi_command, run_job

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
MPI_DIR = TESTS_DIR / "mpi"
RANK_COUNTS = (2, 4, 8)
# Seconds the outer kill waits beyond MPIEXEC_TIMEOUT, so MPI's own timeout reports first.
KILL_GRACE_S = 10


def fresh_python(code: str) -> str:
    """What `python -c code` prints, run in the repository by a fresh interpreter (so that
    what it imports is its own, not the test process's)."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    return out.stdout.strip()


def run_mpi(num_procs: int, args: Sequence[str], *, timeout_s: float = 60) -> JobResult:
    """`mpiexec -n N python -m mpi4py ARGS...`, output captured, never outliving the timeout."""
    program = [sys.executable, "-m", "mpi4py", *args]
    command = mpi_command(num_procs, program, timeout_s=timeout_s)
    return run_job(command, timeout_s=timeout_s + KILL_GRACE_S, capture=True, cwd=REPO_ROOT)


def run_bodies(
    num_procs: int, *paths: str | Path, timeout_s: float = 120, extra: Sequence[str] = ()
) -> JobResult:
    """Run MPI test bodies with pytest-mpi on every rank of an `mpiexec -n N` job."""
    return run_mpi(num_procs, body_args(paths, timeout_s, extra), timeout_s=timeout_s)


def body_args(paths: Sequence[str | Path], timeout_s: float, extra: Sequence[str] = ()) -> list:
    """The per-rank arguments after `python -m mpi4py` that run test bodies under pytest-mpi."""
    return [
        "-m",
        "pytest",
        "--with-mpi",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "python_files=body_*.py",
        f"--timeout={int(timeout_s)}",
        *extra,
        *(str(p) for p in paths),
    ]


def explain(result: JobResult) -> str:
    tail = result.output[-6000:]
    return f"exit code {result.returncode}, timed out: {result.timed_out}\n--- output ---\n{tail}"


@contextmanager
def busy_processes(num: int) -> Iterator[None]:
    """`num` processes spinning on the CPU while the block runs (a machine under load), killed
    after it."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(num)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()
