"""A buffer's log of its waits for peers, for the caller's trace. xccl imports nothing of the
project, so the caller hands in where the waits go (xds_mpi/report/trace.py `wait_log`), chosen
when the buffer is built, or None when it does not trace: then no wait logs, or calls, anything.
Logging is an append to a list, no call back into the caller."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class WaitLog:
    """events: the list each logged wait is appended to, as (name, wall_start_us, wall_end_us,
    vstart_us, vend_us, args): wall time in microseconds since the epoch (time.perf_counter()
    x 1e6 + offset_us), virtual time in microseconds of the buffer's clock."""

    events: list
    offset_us: float

    def add(self, name: str, started_s: float, vstarted_ns: float, vnow_ns: float, **args) -> None:
        """A wait that began at perf_counter() `started_s` and virtual `vstarted_ns`, ending now
        (virtual `vnow_ns`)."""
        offset = self.offset_us
        self.events.append(
            (name, started_s * 1e6 + offset, time.perf_counter() * 1e6 + offset,
             vstarted_ns / 1e3, vnow_ns / 1e3, args)
        )  # fmt: skip
