"""Where a die's time goes in MPI: every window call timed, split by whether a wait for a peer
was in progress (`xds-mpi bench serve` reads it; off unless XDS_TIME_MPI=1, so the default runs
pay nothing).

DieMemory makes its calls through `timed(win)`: the window itself when timing is off, else a
proxy that adds each call's duration to MPI_TIME.work_s, or to MPI_TIME.wait_s while
`waiting()` is active (poll_until below marks its loop).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from xccl.errors import XcclTimeout

TIME_MPI_ENV = "XDS_TIME_MPI"


@dataclass
class MpiTime:
    work_s: float = 0.0  # MPI window calls outside any wait for a peer
    wait_s: float = 0.0  # MPI window calls made while polling for a peer
    calls: int = 0
    in_wait: bool = False


MPI_TIME = MpiTime()


def is_enabled() -> bool:
    return os.environ.get(TIME_MPI_ENV) == "1"


class _TimedWin:
    """Forwards every attribute of an MPI.Win; its methods are timed."""

    def __init__(self, win) -> None:
        self._win = win

    def __getattr__(self, name: str):
        method = getattr(self._win, name)

        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                MPI_TIME.calls += 1
                if MPI_TIME.in_wait:
                    MPI_TIME.wait_s += spent
                else:
                    MPI_TIME.work_s += spent

        return call


def timed(win):
    """The object DieMemory calls the window through."""
    return _TimedWin(win) if is_enabled() else win


@contextmanager
def waiting():
    """Marks a wait for a peer (nested waits keep the outer mark)."""
    outer, MPI_TIME.in_wait = MPI_TIME.in_wait, True
    try:
        yield
    finally:
        MPI_TIME.in_wait = outer


def poll_until(
    ready: Callable[[], bool],
    *,
    deadline: float,
    describe: Callable[[], str],
    interrupt: Callable[[], None] | None = None,
    park: Callable[[], None] | None = None,
) -> None:
    """Spin on `ready()` yielding the CPU between tries, or with `park` sleeping in it
    (`WakeWords.sleeper`, a bounded sleep until a writer wakes us); raise XcclTimeout after
    `deadline`.

    `interrupt` is called between tries (e.g. to raise a rollback signal) so no wait is deaf.
    A condition that holds at the first try is no wait: it returns before any of the set-up.
    """
    if ready():
        return
    with waiting():
        while not ready():
            if interrupt is not None:
                interrupt()
            if time.monotonic() > deadline:
                raise XcclTimeout(describe())
            if park is None:
                os.sched_yield()
            else:
                park()
