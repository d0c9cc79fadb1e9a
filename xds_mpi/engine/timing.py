"""Per-iteration timing of a die (torch-free, so control-plane code can carry it): what the
executor measures with one `Meter`, and the `IterationTiming` it reports."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

from xccl.vclock import VirtualClock
from xds_mpi.report import trace


@dataclass(frozen=True, kw_only=True)
class IterationTiming:
    """Wall seconds of one iteration on one die, by kind of work."""

    num_rows: int
    num_sampled: int  # entries that step (decode-only when rows = sampled + drafted)
    attention_s: float
    xccl_s: float  # dispatch + combine, waiting for peers included
    experts_s: float  # gate, routed experts, shared expert
    total_s: float
    vtime_s: float  # the same iteration on the 910C virtual clock
    num_tokens: int = 0  # tokens the step produced (accepted drafts included)
    num_drafted: int = 0  # MTP drafts verified
    num_accepted: int = 0  # MTP drafts accepted


class Meter:
    """One iteration's clocks: wall seconds by kind of work (`with meter("xccl"): ...`), the wall
    time since the meter started, and the virtual time the die's clock advanced meanwhile.

    Kinds are those of IterationTiming: "attention", "xccl", "experts"; work outside every
    `with` (embedding, dense FFN, sampling) counts in the total only. With tracing on, each
    `with` is also a span (`name`, default the kind; xds_mpi/report/trace.py) from the same
    readings."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.started_s, self.vstart_ns = time.perf_counter(), clock.now_ns
        self.seconds: defaultdict[str, float] = defaultdict(float)  # kind -> wall seconds

    @contextmanager
    def __call__(self, kind: str, name: str = "", **args):
        started_s, vstart_ns = time.perf_counter(), self.clock.now_ns
        try:
            yield
        finally:
            ended_s = time.perf_counter()
            self.seconds[kind] += ended_s - started_s
            trace.record(name or kind, (started_s, ended_s), (vstart_ns, self.clock.now_ns), **args)

    def total_s(self) -> float:
        return time.perf_counter() - self.started_s

    def vtime_s(self) -> float:
        return (self.clock.now_ns - self.vstart_ns) / 1e9


def iteration_timing(entries, sampled: dict[int, list[int]], meter: Meter) -> IterationTiming:
    """An executor's iteration as the die reports it: rows, samples, the meter's seconds per
    part, MTP drafts verified and accepted."""
    steps = [e for e in entries if e.is_sampled]
    spent = meter.seconds
    return IterationTiming(
        num_rows=sum(len(e.input_ids) for e in entries),
        num_sampled=len(steps),
        attention_s=spent["attention"],
        xccl_s=spent["xccl"],
        experts_s=spent["experts"],
        total_s=meter.total_s(),
        vtime_s=meter.vtime_s(),
        num_tokens=sum(len(t) for t in sampled.values()),
        num_drafted=sum(e.num_drafts for e in steps),
        num_accepted=sum(len(sampled[e.req_id]) - 1 for e in steps),
    )
