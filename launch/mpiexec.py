"""Build and run the mpiexec line of a job, with the environment each MPI needs.

Which mpiexec: $XDS_MPIEXEC, else the one installed beside this Python (the `mpich` wheel puts
hydra's mpiexec in the venv's bin/), else the first on PATH (a site MPI loaded with `module load`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

MpiFlavor = Literal["mpich", "openmpi", "unknown"]
# How long the launcher waits beyond MPIEXEC_TIMEOUT before killing the group.
LAUNCH_GRACE_S = 30

# MPICH: without it every Win.Flush runs the whole progress engine (docs/mpi.md §3).
MPICH_ENV = {"MPIR_CVAR_CH4_RMA_ENABLE_DYNAMIC_AM_PROGRESS": "1"}
# Open MPI: osc/ucx prints a warning on every window; root needs explicit consent.
OPENMPI_ENV = {"OMPI_MCA_osc": "^ucx"}
OPENMPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def find_mpiexec() -> str:
    explicit = os.environ.get("XDS_MPIEXEC")
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise FileNotFoundError(
            "no mpiexec found: install the project (it brings the mpich wheel),"
            " load your site MPI, or set XDS_MPIEXEC"
        )
    return found


@cache
def mpi_flavor(mpiexec: str) -> MpiFlavor:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text:
        return "mpich"
    return "unknown"


@dataclass(frozen=True, kw_only=True)
class MpiCommand:
    argv: tuple[str, ...]
    env: dict[str, str]  # only the variables this launch adds or changes

    def shell_line(self) -> str:
        import shlex

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}".strip()


def mpi_command(
    num_procs: int,
    program: Sequence[str],
    *,
    timeout_s: float | None = None,
    mpiexec: str | None = None,
    placement: Sequence[str] = (),
) -> MpiCommand:
    """`mpiexec -n N <program...>` plus the flags and environment the detected MPI needs;
    `placement`: flags that put the ranks on hosts (launch/hosts.py)."""
    mpiexec = mpiexec or find_mpiexec()
    flavor = mpi_flavor(mpiexec)
    argv = [mpiexec, "-n", str(num_procs), *placement]
    # One BLAS thread per rank: the ranks share the cores (xds_mpi/model/blas.py).
    env = {"PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1"}
    if flavor == "openmpi":
        argv.append("--oversubscribe")
        env.update(OPENMPI_ENV)
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            env.update(OPENMPI_ROOT_ENV)
    else:
        env.update(MPICH_ENV)
    if timeout_s is not None:
        env["MPIEXEC_TIMEOUT"] = str(max(1, int(timeout_s)))
    return MpiCommand(argv=tuple(argv) + tuple(program), env=env)


def rank_program(config_path: str | Path, overrides: Sequence[str] = ()) -> list[str]:
    """The per-rank command: mpi4py's runner aborts the whole job on any rank's exception."""
    program = [sys.executable, "-m", "mpi4py", "-m", "launch.rank", str(config_path)]
    for text in overrides:
        program += ["--set", text]
    return program


@dataclass(frozen=True, kw_only=True)
class JobResult:
    returncode: int
    timed_out: bool
    output: str  # stdout + stderr when captured, else ""


def run_job(
    command: MpiCommand, *, timeout_s: float, capture: bool = False, cwd: str | Path | None = None
) -> JobResult:
    """Run the job in its own process group; on timeout or Ctrl-C kill the whole group.

    A job that lasted MPIEXEC_TIMEOUT counts as timed out whatever its exit code: hydra
    sometimes exits 0 after killing a job at its timeout (seen with the mpich 5.0.2 wheel).
    """
    env = {**os.environ, **command.env}
    out = subprocess.PIPE if capture else None
    mpi_timeout_s = float(command.env.get("MPIEXEC_TIMEOUT", "inf"))
    started = time.monotonic()
    proc = subprocess.Popen(
        command.argv,
        env=env,
        cwd=cwd,
        stdout=out,
        stderr=subprocess.STDOUT if capture else None,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
        timed_out = time.monotonic() - started >= mpi_timeout_s
        return JobResult(returncode=proc.returncode, timed_out=timed_out, output=stdout or "")
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, _ = proc.communicate()
        return JobResult(returncode=proc.returncode, timed_out=True, output=stdout or "")
    except BaseException:
        kill_group(proc)
        proc.wait()
        raise


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
