"""A signal to `xds-mpi run` ends the whole MPI job: mpiexec and every rank, within seconds.

hydra starts each rank in a session of its own, so a launcher that dies alone leaves the job
running until MPIEXEC_TIMEOUT. The job is found by an environment marker every process of it
inherits (mpiexec passes the environment on to the ranks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from harness import REPO_ROOT

from launch.job.shm_leftovers import ShmLeftovers

XDS_MPI = Path(sys.executable).parent / "xds-mpi"
MARKER_ENV = "XDS_TEST_JOB_MARKER"
# The job must be gone this many seconds after the signal (the launcher allows mpiexec 5 s).
MAX_STOP_S = 10


def job_pids(marker: str) -> list[int]:
    """Processes whose environment carries the marker (the launcher, mpiexec, proxy, ranks)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                pids.append(int(environ.parent.name))
        except OSError:
            continue  # gone meanwhile, or not ours
    return [pid for pid in pids if not is_zombie(pid)]


def mpi_segments() -> set[str]:
    """The MPI shared-memory segments in /dev/shm (launch/job/shm_leftovers.py)."""
    return ShmLeftovers().before


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"no {text!r} within {timeout_s:g} s:\n{''.join(lines)}")


def _default_sigint() -> None:
    """The launcher as a terminal would start it. A test run started in the background by a
    shell without job control (`cmd &` in a script) ignores SIGINT, a child inherits that, and
    Python keeps an inherited ignore: the launcher would never see the Ctrl-C this test sends
    (a CI run started that way failed here with every process of the job still running)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the job through /proc")
@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_ends_mpiexec_and_every_rank(tmp_path, signo):
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_ENV: marker}
    segments_before = mpi_segments()
    launcher = subprocess.Popen(
        [str(XDS_MPI), "run", "--set", "workload.num_requests=400"]
        + ["--set", f"run.output_dir={tmp_path}"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_default_sigint,
    )
    try:
        wait_for_line(launcher, "ranks agree", timeout_s=120)
        assert len(job_pids(marker)) >= 1 + 5, "the job's ranks are not running"
        launcher.send_signal(signo)
        deadline = time.monotonic() + MAX_STOP_S
        while job_pids(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = job_pids(marker)
        assert not left, (
            f"{len(left)} processes of the job still run {MAX_STOP_S} s after {signo.name}"
        )
        output = launcher.communicate(timeout=5)[0]
        assert launcher.returncode == 128 + signo, output
        assert f"stopped by {signo.name}" in output
        assert mpi_segments() <= segments_before, "the job's windows were left in /dev/shm"
    finally:
        for pid in job_pids(marker):
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()
