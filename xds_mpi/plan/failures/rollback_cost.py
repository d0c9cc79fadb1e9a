"""A rolled-back attempt priced on the virtual clock (token recomputation, xDeepServe §6.2 stage
3; ranks/recovery/recompute.py). The failed attempt's time up to its detection (the injected
error's point, or the wait's `xccl.poll_timeout_s`, or a stalled die's return) stays on every
die's clock, as it would on the pod; the rollback itself adds the abort word and the vote over
the fabric (xccl/recovery/rollback.py): both are one-word writes and one small exchange, so
they cost microseconds beside the attempt."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RollbackCost:
    """Seconds a failed vote adds after the failed attempt's detection.
    notify_s: the abort word written into every die's window, flushed (the writes go out at
    once: one write latency); vote_s: every die's row written to every die and read back (one
    write and one read latency)."""

    notify_s: float
    vote_s: float

    @classmethod
    def of(cls, *, write_latency_s: float, read_latency_s: float) -> RollbackCost:
        return cls(notify_s=write_latency_s, vote_s=write_latency_s + read_latency_s)

    @property
    def total_s(self) -> float:
        return self.notify_s + self.vote_s
