"""A `dead` row (xds_mpi/config/failures.py): at its iteration the die stops taking part. The
process stays alive (MPI aborts a job whose rank exits): it answers no heartbeat and runs no
iteration until the TE-shell's stop (ranks/core/decode_die.py `out_turn`, `leave`).
A row at virtual time `at_s` (run.clock virtual) takes effect at the first iteration whose
virtual start, the dies' agreed common start, is at or after it: the die falls silent instead of
running it (`at_start`), its peers wait for it in that iteration's first dispatch."""

from __future__ import annotations

import time

from ranks.core.decode_die import DieWatch
from ranks.core.messages import FaultBegan
from xccl.vclock import VirtualClock
from xds_mpi.config.schema import Config


class DeadDie:
    """The dead row of die `rank`; `after(num_iterations)` once per busy iteration the die
    completed (and once when it is built, for a row at iteration 0)."""

    def __init__(self, row, rank: int, health: DieWatch, clock: VirtualClock) -> None:
        self.iteration, self.rank, self.health, self.clock = row.iteration, rank, health, clock
        self.at_s = row.at_s  # None: the row gives an iteration

    def after(self, num_iterations: int) -> DeadDie | None:
        """The die has run `num_iterations` busy iterations: at the row's, it falls silent and
        tells the watcher when (for the failure record). Returns itself until then, else None
        (nothing left to check)."""
        if self.at_s is not None or num_iterations < self.iteration:
            return self
        return self._fall_silent(num_iterations)

    def at_start(self, start_s: float, num_iterations: int) -> bool:
        """An at_s row: the dies agreed to start an iteration at virtual `start_s`, after
        `num_iterations` busy ones; at or after at_s the die falls silent instead of running it
        (True)."""
        if self.at_s is None or start_s < self.at_s:
            return False
        self._fall_silent(num_iterations)
        return True

    def _fall_silent(self, num_iterations: int) -> None:
        self.health.fall_silent()
        note = FaultBegan(
            die=self.rank,
            kind="dead",
            iteration=num_iterations,
            wall_time=time.time(),
            virtual_s=self.clock.now_ns / 1e9,
        )
        self.health.tell(note)


def dead_die(cfg: Config, rank: int, health: DieWatch | None, clock) -> DeadDie | None:
    """The dead row naming die `rank` on a watched die (its heartbeats go silent), else None;
    a row at iteration 0 takes effect at once (before the die's first turn)."""
    rows = [e for e in cfg.faults.events if e.die == rank and e.kind == "dead"]
    if health is None or not rows:
        return None
    return DeadDie(rows[-1], rank, health, clock).after(0)
