"""Make an MPI test failure end the whole job at once instead of leaving other ranks waiting.

pytest catches a failing test's exception, so `python -m mpi4py` alone would not abort: the other
ranks would wait forever in the collective the failing rank never joins. This hook prints the
failure (with the rank) and calls MPI_Abort.
"""

from __future__ import annotations

import faulthandler
import sys
import time

import pytest


def pytest_configure(config):
    # Print every rank's stack before pytest-timeout / MPIEXEC_TIMEOUT ends a stuck job.
    timeout = config.getoption("timeout", None)
    if timeout:
        faulthandler.dump_traceback_later(max(1, float(timeout) - 2), exit=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed or not item.config.getoption("with_mpi", False):
        return
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.size == 1:
        return
    sys.stderr.write(
        f"\n[rank {comm.rank}] FAILED {item.nodeid} ({report.when}):\n"
        f"{report.longreprtext}\n[rank {comm.rank}] aborting the MPI job\n"
    )
    sys.stderr.flush()
    # The launcher forwards a rank's output through a pipe; an abort at once can kill the job
    # before the message is read (CI saw an empty output). Give it a moment.
    time.sleep(1.0)
    comm.Abort(1)


def pytest_sessionfinish(session):
    """With XDS_PRINT_TRAFFIC=1 each rank prints what its windows did across nodes (the two-host
    tests read these lines to check that the cross-node path was taken)."""
    import os

    if os.environ.get("XDS_PRINT_TRAFFIC") != "1":
        return
    from dataclasses import asdict

    from mpi4py import MPI

    from xccl.gmem import PROCESS_TRAFFIC

    fields = " ".join(f"{k}={v}" for k, v in asdict(PROCESS_TRAFFIC).items())
    print(f"\nxccl traffic rank {MPI.COMM_WORLD.rank}: {fields}", flush=True)
