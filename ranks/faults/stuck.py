"""A `stuck` row (xds_mpi/config/failures.py): the die blocks inside its first dispatch
(colocated) or A2E (afd) of iteration `iteration`, its data staged and its record not published,
so that every peer waits for it, for `duration_s` wall seconds (0: for good). The process is
alive and answers nothing meanwhile (it is not in its event loop).
On the virtual clock (run.clock virtual, colocated or afd) a row may give `at_s` instead: the first
iteration whose virtual start (the dies' common start) is at or after it; and a stall that ends
costs its die `duration_s` virtual seconds too (the peers' clocks follow it through the
dispatch), as it would on the pod. A stall the fence ends is undone with its iteration and the
failover priced instead (ranks/recovery/scale_down.py)."""

from __future__ import annotations

import time
from typing import Protocol

from mpi4py import MPI

from ranks.core.decode_die import DieWatch
from ranks.core.messages import SHELL, TAG_STOP, FaultBegan
from xccl.vclock import VirtualClock
from xds_mpi.config.schema import Config

# Where a stuck die blocks: a colocated die's dispatch; an afd die's A2E (the attention die's
# tokens, or a trampoline's / expert die's forwarded rows).
STUCK_OPS = ("dispatch", "a2e")


class StuckDie(Protocol):
    """What the stall reads of its die: the busy iterations it has run (the same count on every
    die: the row's `iteration` is one), its virtual clock, and, a colocated die's, the virtual
    start of the running iteration (`iteration_start_s`, -1 on the wall clock; an afd die has
    none: `start_s`)."""

    busy_iterations: int
    clock: VirtualClock


def start_s(die: StuckDie) -> float:
    """The running iteration's virtual start; -1 off the virtual clock (afd dies: always)."""
    return getattr(die, "iteration_start_s", -1.0)


class Stall:
    """The fault hook (xccl/recovery/faults.py) of the die a stuck row names: blocks once."""

    def __init__(self, row, comm: MPI.Comm, die: StuckDie, health: DieWatch) -> None:
        self.row, self.comm, self.die, self.health = row, comm, die, health
        self.has_stalled = False

    def __call__(self, op: str, event_id: int) -> None:
        row = self.row
        if self.has_stalled or op not in STUCK_OPS:
            return
        if row.at_s is not None:  # virtual clock: the first iteration starting at or after it
            if start_s(self.die) < row.at_s:
                return
        elif self.die.busy_iterations < row.iteration:  # afd: an idle domain's die skips some
            return
        self.has_stalled = True
        note = FaultBegan(
            die=self.comm.rank,
            kind="stuck",
            iteration=self.die.busy_iterations,
            wall_time=time.time(),
            virtual_s=self.die.clock.now_ns / 1e9,
        )
        self.health.tell(note)
        until = time.monotonic() + row.duration_s if row.duration_s > 0 else float("inf")
        # Blocked: no loop, no answers. The job's end (the TE-shell's or JE's stop) unblocks it, so
        # that a die stuck for good still exits (the emulator's need, not the fault's).
        while time.monotonic() < until and not self.comm.iprobe(source=SHELL, tag=TAG_STOP):
            time.sleep(min(0.05, max(until - time.monotonic(), 0.0)))
        if row.duration_s > 0 and start_s(self.die) >= 0:  # virtual: the stall's cost
            self.die.clock.advance(row.duration_s * 1e9)


def stall(cfg: Config, comm: MPI.Comm, die: StuckDie, health: DieWatch | None) -> Stall | None:
    """The stall of the stuck row naming this die, on a watched die; else None (no hook)."""
    rows = [e for e in cfg.faults.events if e.die == comm.rank and e.kind == "stuck"]
    if health is None or not rows:
        return None
    return Stall(rows[-1], comm, die, health)
