"""Build and run the mpiexec line of a job, with the environment each MPI needs.

Which mpiexec: $XDS_MPIEXEC, else the one installed beside this Python (the `mpich` wheel puts
hydra's mpiexec in the venv's bin/), else the first on PATH (a site MPI loaded with `module load`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from launch.job.shm_leftovers import ShmLeftovers

MpiFlavor = Literal["mpich", "openmpi", "unknown"]
# How long the launcher waits beyond MPIEXEC_TIMEOUT before killing the group.
LAUNCH_GRACE_S = 30
# How long mpiexec gets to end its ranks after a SIGTERM before everything is SIGKILLed.
STOP_GRACE_S = 5
# Signals to the launcher that end the whole job (exit code 128 + signo); SIGINT does too, as
# the KeyboardInterrupt it raises (so that a Ctrl-C still interrupts a caller such as pytest).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

# MPICH: without it every Win.Flush runs the whole progress engine (docs/mpi.md §3).
MPICH_ENV = {"MPIR_CVAR_CH4_RMA_ENABLE_DYNAMIC_AM_PROGRESS": "1"}
# Open MPI: osc/ucx prints a warning on every window; root needs explicit consent.
OPENMPI_ENV = {"OMPI_MCA_osc": "^ucx"}
OPENMPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# A run that can lose a die: after a failover the windows that span the lost die are never freed
# (their frees are collectives it would not join), so at MPI_Finalize MPICH's UCX layer warns
# once per leaked registration ("ucp_rcache: destroying inuse region", "object ... was not
# returned to mpool ucp_rkeys": ~118 lines for one dead die of 4). UCX has no switch for those two
# warnings alone: its log level drops every warning, so it is set only for such runs.
FAILOVER_ENV = {"UCX_LOG_LEVEL": "error"}


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
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}".strip()


def mpi_command(
    num_procs: int,
    program: Sequence[str],
    *,
    timeout_s: float | None = None,
    mpiexec: str | None = None,
    placement: Sequence[str] = (),
    can_fail_over: bool = False,
) -> MpiCommand:
    """`mpiexec -n N <program...>` plus the flags and environment the detected MPI needs;
    `placement`: flags that put the ranks on hosts (launch/job/hosts.py); `can_fail_over`: the run
    may lose a die (FAILOVER_ENV, unless the user set those variables)."""
    mpiexec = mpiexec or find_mpiexec()
    flavor = mpi_flavor(mpiexec)
    argv = [mpiexec, "-n", str(num_procs), *placement]
    # One BLAS thread per rank: the ranks share the cores (xds_mpi/model/blas.py).
    env = {"PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1"}
    # numpy asks for transparent huge pages on every array of 4 MiB or more: the first store
    # into a page of a die's KV cache then zeroes 2 MiB, and a die touches its cache a few slots
    # at a time (docs/mpi.md §3). A user's own setting wins.
    if "NUMPY_MADVISE_HUGEPAGE" not in os.environ:
        env["NUMPY_MADVISE_HUGEPAGE"] = "0"
    if flavor == "openmpi":
        argv.append("--oversubscribe")
        env.update(OPENMPI_ENV)
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            env.update(OPENMPI_ROOT_ENV)
    else:
        env.update(MPICH_ENV)
    if can_fail_over:
        env.update({k: v for k, v in FAILOVER_ENV.items() if k not in os.environ})
    if timeout_s is not None:
        env["MPIEXEC_TIMEOUT"] = str(max(1, int(timeout_s)))
    return MpiCommand(argv=tuple(argv) + tuple(program), env=env)


def rank_program(
    config_path: str | Path, overrides: Sequence[str] = (), resolved: Path | None = None
) -> list[str]:
    """The per-rank command: mpi4py's runner aborts the whole job on any rank's exception.
    resolved: the launcher's JSON copy of the config and overrides, which the ranks read instead
    when they find it (xds_mpi/plan/resolved.py)."""
    program = [sys.executable, "-m", "mpi4py", "-m", "launch.job.rank", str(config_path)]
    for text in overrides:
        program += ["--set", text]
    if resolved is not None:
        program += ["--resolved", str(resolved)]
    return program


@dataclass(frozen=True, kw_only=True)
class JobResult:
    returncode: int  # 128 + signo when a signal to the launcher stopped the job
    timed_out: bool
    output: str  # stdout + stderr when captured, else ""
    stopped_by: int | None = None  # the signal (SIGTERM, SIGHUP) that stopped the job


class _Stopped(Exception):
    """A signal to the launcher, raised in the main thread while run_job waits."""

    def __init__(self, signo: int):
        super().__init__(signal.Signals(signo).name)
        self.signo = signo


def run_job(
    command: MpiCommand,
    *,
    timeout_s: float,
    capture: bool = False,
    cwd: str | Path | None = None,
    while_waiting: Callable[[], None] | None = None,
) -> JobResult:
    """Run the job in its own session; a timeout, SIGTERM, SIGHUP or Ctrl-C ends the whole job
    (SIGINT: after the job is gone, the KeyboardInterrupt goes on to the caller).
    `while_waiting` is called about every second while the job runs (the start-up count).

    A job that lasted MPIEXEC_TIMEOUT counts as timed out whatever its exit code: hydra
    sometimes exits 0 after killing a job at its timeout (seen with the mpich 5.0.2 wheel).
    """
    env = {**os.environ, **command.env}
    out = subprocess.PIPE if capture else None
    mpi_timeout_s = float(command.env.get("MPIEXEC_TIMEOUT", "inf"))
    started = time.monotonic()
    leftovers = ShmLeftovers()  # a job stopped or failed may leave its windows in /dev/shm
    with _signals_stop_the_job(), _removing(leftovers):
        proc = subprocess.Popen(
            command.argv,
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT if capture else None,
            text=True,
            start_new_session=True,  # a Ctrl-C reaches the launcher only; it ends the job
        )
        try:
            stdout = _wait(proc, started + timeout_s, while_waiting)
            timed_out = time.monotonic() - started >= mpi_timeout_s
            return JobResult(returncode=proc.returncode, timed_out=timed_out, output=stdout or "")
        except subprocess.TimeoutExpired:
            stop_job(proc)
            return JobResult(returncode=proc.returncode, timed_out=True, output=_rest(proc))
        except _Stopped as stop:
            stop_job(proc)
            return JobResult(
                returncode=128 + stop.signo,
                timed_out=False,
                output=_rest(proc),
                stopped_by=stop.signo,
            )
        except BaseException:
            stop_job(proc)
            raise


def _wait(proc: subprocess.Popen, deadline: float, while_waiting) -> str:
    """The job's output once it ends; subprocess.TimeoutExpired at the deadline."""
    while True:
        left = deadline - time.monotonic()
        try:
            return proc.communicate(timeout=max(min(left, 1.0), 0.0))[0] or ""
        except subprocess.TimeoutExpired:
            if left <= 1.0:
                raise
            if while_waiting is not None:
                while_waiting()


@contextmanager
def _removing(leftovers: ShmLeftovers):
    """Once the job is gone, however it ended: the shared memory it left, removed."""
    try:
        yield
    finally:
        leftovers.remove_and_say()


@contextmanager
def _signals_stop_the_job():
    """While the job runs, SIGTERM/SIGHUP to the launcher raise _Stopped instead of
    killing the launcher alone: mpiexec and the ranks live in other sessions and would stay."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signo, _frame):
        raise _Stopped(signo)

    previous = {signo: signal.signal(signo, stop) for signo in STOP_SIGNALS}
    try:
        yield
    finally:
        for signo, handler in previous.items():
            signal.signal(signo, handler)


def _rest(proc: subprocess.Popen) -> str:
    """What a stopped job wrote that was not read yet (its pipe closes when the job is gone)."""
    try:
        return proc.communicate()[0] or ""
    except (OSError, ValueError):
        return ""


def stop_job(proc: subprocess.Popen) -> None:
    """End mpiexec and every rank: SIGTERM first (mpiexec forwards it to its ranks, which hydra
    starts in sessions of their own, out of reach of a signal to mpiexec's group), then after
    STOP_GRACE_S SIGKILL to mpiexec's group and to every process it had started."""
    below = _descendants(proc.pid)
    _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and (proc.poll() is None or any(map(_alive, below))):
        time.sleep(0.1)
    _signal_group(proc.pid, signal.SIGKILL)
    for pid in below:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, signo: int) -> None:
    try:
        os.killpg(pgid, signo)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(pid: int, signo: int) -> None:
    try:
        os.kill(pid, signo)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(root: int) -> list[int]:
    """Every process below `root` (Linux /proc; elsewhere none, and the group signal must do)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        pid, ppid = int(text.split()[0]), int(text.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead but still listed
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
