"""What token recomputation counts on a die (ranks/recovery/recompute.py), and how it names a failed
attempt's faults in words: injected XCCL errors and waits that timed out on a slow peer."""

from __future__ import annotations

import time
from dataclasses import dataclass

from xccl.recovery.vote import FaultReport, Outcome
from xds_mpi.faults import EventMap


@dataclass
class RecoveryCounters:
    """Per die. rollbacks: failed attempts (the same on every die); recomputed_iterations:
    iterations that needed at least one re-execution; faults_injected: faults raised on this
    die; wall_lost_s / vtime_lost_s: wall and virtual time of the failed attempts.
    timeouts: failed attempts in which some die's wait timed out (faults.on_timeout recompute;
    the same on every die); timeout_die / timeout_peer / timeout_iteration / timeout_wall: the
    first such timeout's waiting die, the die its wait leads to (Outcome.blamed: the die it
    waited for, or the one that die was waiting for, ...), its iteration and the wall time
    (time.time()) of the vote that saw it (-1: none); timeout_via: the die the timed-out wait
    itself named."""

    rollbacks: int = 0
    recomputed_iterations: int = 0
    faults_injected: int = 0
    wall_lost_s: float = 0.0
    vtime_lost_s: float = 0.0
    timeouts: int = 0
    timeout_die: int = -1
    timeout_peer: int = -1
    timeout_via: int = -1
    timeout_iteration: int = -1
    timeout_wall: float = -1.0

    def count_timeouts(self, outcome: Outcome, iteration: int, timed_out_at: float) -> None:
        """A failed vote: one more timed-out attempt if any die's wait timed out.
        timed_out_at: when this die's own wait timed out in this attempt (time.time()), -1 if it
        did not (the vote's time stands in; the earliest over the dies is the timeout's)."""
        timeouts = outcome.timeouts
        if not timeouts:
            return
        self.timeouts += 1
        if self.timeout_wall < 0:
            first = timeouts[0]
            self.timeout_die, self.timeout_via = first.die, first.peer
            self.timeout_peer = outcome.blamed(first)
            self.timeout_iteration = iteration
            # The earliest timeout any die voted (expert dies report their counters to nobody).
            voted = [f.at_us / 1e6 for f in timeouts if f.at_us >= 0]
            fallback = timed_out_at if timed_out_at >= 0 else time.time()
            self.timeout_wall = min(voted, default=fallback)


def describe(outcome: Outcome, events: EventMap) -> str:
    """The faults of a failed attempt: die, operation, MoE layer, event id, and the error code
    or the peer a timed-out wait waited for (and the die the waits lead to, when another)."""
    return (
        "; ".join(
            f"die {f.die} {f.op} at layer {events.layer_of_event(f.event_id)} (event "
            f"{f.event_id}, {_what(f, outcome)})"
            for f in outcome.faults
        )
        or "none reported"
    )


def _what(f: FaultReport, outcome: Outcome) -> str:
    if not f.is_timeout:
        return f"code {f.code}"
    said = f"timed out waiting for die {f.peer}: xccl.poll_timeout_s"
    blamed = outcome.blamed(f)
    return said if blamed == f.peer else f"{said}; the waits lead to die {blamed}"
